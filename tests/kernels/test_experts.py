"""A mixture of experts' forms: the picked experts alone as grouped GEMMs
(`reference.experts_grouped`) against every expert on every token (`experts_dense`), the
routing they share (`route`), and the few-rows Triton kernels (slora.kernels.experts: the
routing from the logits, each pair's GLU) against those twins; on the CPU (the kernels
interpreted) and, where there is one, on CUDA (in a CUDA graph too)."""

import pytest
import torch

from slora.kernels import experts
from slora.kernels import reference as ref
from slora.model.llama import grouped_gemm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# the Triton kernels' device: the GPU, else the CPU (interpreted)
TRITON = "cuda" if torch.cuda.is_available() else "cpu"


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


def _replays_follow(T, E, k, run, want):
    """`run(h, router, gate_up, down)` captured in a CUDA graph: each replay over new inputs
    (and so new routings) equals `want` of the same inputs, in bfloat16's tolerance."""
    h, router, gate_up, down = _experts(T, E, k, 64, 48, torch.bfloat16, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(h, router, gate_up, down)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(h, router, gate_up, down)
    for seed in (1, 2):
        h.copy_(_experts(T, E, k, 64, 48, torch.bfloat16, "cuda", seed=seed)[0])
        graph.replay()
        w, pick = ref.route(h, router, k, True)
        torch.testing.assert_close(out.float(), want(h, gate_up, down, w, pick).float(),
                                   atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_in_a_cuda_graph():
    """Where `grouped_gemm` holds (bfloat16 on compute capability 9.0 and up), the grouped
    form is captured in a CUDA graph and its replays follow new inputs and new routings."""
    if not grouped_gemm(torch.empty(1, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("torch._grouped_mm loops on the host on this GPU and dtype")

    def run(h, router, gate_up, down):
        w, pick = ref.route(h, router, 2, True)
        return ref.experts_grouped(h, gate_up, down, w, pick, ref.silu_mul)

    _replays_follow(16, 8, 2, run, lambda *a: ref.experts_dense(*a, ref.silu_mul))


@pytest.mark.parametrize("T,E,k", [(1, 4, 2), (3, 8, 2), (5, 60, 4), (2, 128, 8), (4, 8, 1)])
def test_fused_route_picks_the_twins_experts(T, E, k, device=TRITON):
    """The routing kernel from the router's logits: the twin's experts in the twin's order and
    their weights, renormalised or not (float32 logits: no ties)."""
    h, router, _, _ = _experts(T, E, k, 64, 48, torch.float32, device, seed=E)
    for renormalise in (False, True):
        want_w, want_pick = ref.route(h, router, k, renormalise)
        w, pick = experts.route(h @ router.t(), k, renormalise)
        assert pick.dtype == torch.int64 and torch.equal(pick, want_pick)
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)


def _biases(E, H, I, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*shape, generator=g) * 0.5).to(dtype=dtype, device=device)
                 for shape in ((E,), (E, 2 * I), (E, H)))


def test_swiglu_oai_clamps_as_gpt_oss_does():
    """gpt-oss's GLU over [gate | up]: the gate clamped from above, up on both sides, then
    gate sigmoid(alpha gate) (up + 1); as HF's interleaved form computes it."""
    gate = torch.tensor([[-9.0, -1.0, 0.5, 3.0, 12.0]])
    up = torch.tensor([[-9.0, 0.25, -0.5, 6.0, 9.0]])
    limit, alpha = 2.0, 1.702
    g = gate.clamp(max=limit)
    want = g * torch.sigmoid(alpha * g) * (up.clamp(-limit, limit) + 1)
    torch.testing.assert_close(ref.Glu("swiglu_oai", limit, alpha)(torch.cat((gate, up), 1)),
                               want)
    assert want[0, 4] == pytest.approx(2 * torch.sigmoid(torch.tensor(2 * alpha)) * 3)


@pytest.mark.parametrize("device", DEVICES)
def test_expert_biases_in_the_grouped_and_dense_forms(device):
    """A router's bias moves the routing (the logits h router^T + b); each expert's gate|up
    and down biases are added to its products: the grouped form equals the dense one and a
    loop over the tokens' picks."""
    T, E, k, H, I = 9, 8, 2, 32, 24
    act = ref.Glu("swiglu_oai", 1.5, 1.702)
    h, router, gate_up, down = _experts(T, E, k, H, I, torch.float32, device, seed=3)
    rb, gub, db = _biases(E, H, I, torch.float32, device, seed=4)
    w, pick = ref.route(h, router, k, True, rb * 20)
    assert not torch.equal(pick, ref.route(h, router, k, True)[1])
    grouped = ref.experts_grouped(h, gate_up, down, w, pick, act, gub, db)
    dense = ref.experts_dense(h, gate_up, down, w, pick, act, gub, db)
    torch.testing.assert_close(grouped, dense, atol=1e-5, rtol=1e-5)
    want = torch.stack([sum(w[t, j] * (act(h[t] @ gate_up[e].t() + gub[e]) @ down[e].t() + db[e])
                            for j, e in enumerate(pick[t].tolist())) for t in range(T)])
    torch.testing.assert_close(grouped, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "swiglu_oai"])
@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 2, 64, 48), (3, 8, 2, 96, 40), (6, 16, 4, 64, 48),
                                       (2, 8, 8, 32, 24)])
def test_fused_experts_equal_the_grouped_twin(act, T, E, k, H, I, device=TRITON):
    """Each pair's GLU and the weighted sum over its token's picks equal the grouped twin's
    (in float32 within rounding, in bfloat16 within its), H and I off the tiles' widths too;
    every expert picked by some token (k = E) and by none; gpt-oss's clamped SwiGLU with the
    experts' biases (a limit the products cross)."""
    glu = ref.Glu(act, 1.0, 1.702)
    dtypes = ((torch.float32, 1e-5),) + (((torch.bfloat16, 3e-2),) if device == "cuda" else ())
    for dtype, tol in dtypes:
        h, router, gate_up, down = _experts(T, E, k, H, I, dtype, device, seed=T * E + k)
        biases = _biases(E, H, I, dtype, device, seed=E)[1:] if act == "swiglu_oai" else ()
        w, pick = ref.route(h, router, k, renormalise=True)
        out = experts.experts(h, gate_up, down, w, pick, glu, *biases)
        assert out.dtype == dtype and out.shape == (T, H)
        want = ref.experts_grouped(h, gate_up, down, w, pick, glu, *biases)
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_in_a_cuda_graph():
    """The few-rows kernels, routing included, captured in a CUDA graph: replays follow new
    inputs and new routings."""
    def run(h, router, gate_up, down):
        w, pick = experts.route(h @ router.t(), 4, True)
        return experts.experts(h, gate_up, down, w, pick)

    _replays_follow(4, 16, 4, run, lambda *a: ref.experts_grouped(*a, ref.silu_mul))


def test_few_rows_stop_where_pairs_outgrow_the_picked_experts():
    """"auto"'s rule: rows while rows x k <= 1.5 x the experts picked in expectation; one row
    always (its k pairs are k distinct experts)."""
    assert experts.few_rows(128, 8) == 14 and experts.few_rows(8, 2) == 4
    for E, k in ((4, 4), (8, 1), (60, 4), (128, 8), (256, 8)):
        n = experts.few_rows(E, k)
        assert n >= 1
        for rows, fits in ((n, True), (n + 1, False)):
            picked = E * (1 - (1 - k / E) ** rows)
            assert (rows * k <= experts.PAIRS_OVER_PICKED * picked) == fits
