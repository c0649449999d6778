"""A mixture of experts' two forms (slora.kernels.reference): the picked experts alone as
grouped GEMMs (`experts_grouped`) against every expert on every token (`experts_dense`), and
the routing they share (`route`), on the CPU and, where there is one, on CUDA (in a CUDA graph
too, where the grouped GEMM needs no host sync)."""

import pytest
import torch

from slora.kernels import reference as ref
from slora.model.llama import grouped_gemm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _experts(T, E, k, H, I, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype=dtype, device=device)

    return (rnd(T, H), rnd(E, H), rnd(E, 2 * I, H, std=H ** -0.5), rnd(E, H, I, std=I ** -0.5))


def test_route_picks_the_top_k_of_the_softmax():
    h, router, _, _ = _experts(5, 6, 2, 16, 8, torch.float32, "cpu")
    probs = torch.softmax(h @ router.t(), dim=-1)
    for renormalise in (False, True):
        w, pick = ref.route(h, router, 3, renormalise)
        assert pick.shape == (5, 3) and w.dtype == torch.float32
        assert torch.equal(pick, probs.topk(3, dim=-1).indices)
        want = probs.gather(1, pick)
        assert torch.allclose(w, want / want.sum(-1, keepdim=True) if renormalise else want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,k", [(1, 4, 2), (7, 8, 2), (33, 16, 4), (5, 64, 8), (64, 8, 1)])
def test_grouped_experts_equal_every_expert_on_every_token(device, T, E, k):
    """Whatever the routing (experts picked by no token, by one, by most), the grouped form
    equals the dense one: within rounding in float32, and in bfloat16 within bfloat16's."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        h, router, gate_up, down = _experts(T, E, k, 64, 48, dtype, device, seed=T + E)
        w, pick = ref.route(h, router, k, renormalise=E % 2 == 0)
        grouped = ref.experts_grouped(h, gate_up, down, w, pick, ref.silu_mul)
        dense = ref.experts_dense(h, gate_up, down, w, pick, ref.silu_mul)
        assert grouped.dtype == dtype and grouped.shape == (T, 64)
        torch.testing.assert_close(grouped.float(), dense.float(), atol=tol, rtol=tol)
        # against a loop over the tokens and their picks, in float32
        x, gu, dn = h.float(), gate_up.float(), down.float()
        want = torch.stack([sum(w[t, j] * (ref.silu_mul(x[t] @ gu[pick[t, j]].t())
                                           @ dn[pick[t, j]].t()) for j in range(k))
                            for t in range(T)])
        torch.testing.assert_close(grouped.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_in_a_cuda_graph():
    """Where `grouped_gemm` holds (bfloat16 on compute capability 9.0 and up), the grouped
    form is captured in a CUDA graph and its replays follow new inputs and new routings."""
    h, router, gate_up, down = _experts(16, 8, 2, 64, 48, torch.bfloat16, "cuda")
    if not grouped_gemm(h):
        pytest.skip("torch._grouped_mm loops on the host on this GPU and dtype")

    def run():
        w, pick = ref.route(h, router, 2, True)
        return ref.experts_grouped(h, gate_up, down, w, pick, ref.silu_mul)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):
        h.copy_(_experts(16, 8, 2, 64, 48, torch.bfloat16, "cuda", seed=seed)[0])
        graph.replay()
        w, pick = ref.route(h, router, 2, True)
        want = ref.experts_dense(h, gate_up, down, w, pick, ref.silu_mul)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
