"""slora.kernels.launch: the cached launch path of the Triton kernels in eager steps.

On CPU a fake kernel stands in for Triton's (the interpreter takes Triton's own path): the
key must separate every argument difference Triton specializes on, and a cached launch must
pass the kernel every parameter in order. On a GPU the keys are checked against the kernels
Triton itself picks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slora.kernels import launch
from slora.kernels.launch import FastKernel


class FakeCompiled:
    def __init__(self, n):
        self.n, self.function, self.packed_metadata, self.runs = n, f"fn{n}", f"meta{n}", []

    def run(self, *a):
        self.runs.append(a)


class FakeJit:
    """Parameters (x, n, m, BLOCK: constexpr, FLAG: constexpr = True); m not specialized."""

    def __init__(self):
        p = lambda name, c=False, dns=False, default=None: SimpleNamespace(  # noqa: E731
            name=name, is_constexpr=c, do_not_specialize=dns, default=default)
        self.params = [p("x"), p("n"), p("m", dns=True), p("BLOCK", c=True), p("FLAG", c=True, default=True)]
        self.compiles = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            k = FakeCompiled(len(self.compiles))
            self.compiles.append((grid, args, kwargs))
            return k
        return run


@pytest.fixture
def fk(monkeypatch):
    k = FastKernel(FakeJit())
    monkeypatch.setattr(k, "_eligible", lambda args: True)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda idx: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return k


def test_cached_launch_passes_every_parameter_in_order(fk):
    x = torch.zeros(64, dtype=torch.bfloat16)
    first = fk[(4, 2)](x, 3, 5, 32, num_warps=4)
    assert len(fk.fn.compiles) == 1 and fk.fast_launches == 0  # Triton's path first
    again = fk[(8,)](x, 3, 99, 32, num_warps=4)  # m is not specialized: same kernel
    assert again is first and len(fk.fn.compiles) == 1 and fk.fast_launches == 1
    # grid padded to 3 dims, the raw stream, no launch metadata or hooks, then all parameters
    # (the default of FLAG included)
    assert first.runs == [(8, 1, 1, 7, "fn0", "meta0", None, None, None, x, 3, 99, 32, True)]


@pytest.mark.parametrize("change", [
    "dtype", "misaligned", "n_is_1", "n_mult_16", "m_64bit", "constexpr", "kwarg", "num_warps"])
def test_key_separates_what_triton_specializes(fk, change):
    x = torch.zeros(64, dtype=torch.bfloat16)
    fk[(1,)](x, 3, 5, 32, num_warps=4)
    args, kwargs = [x, 3, 5, 32], {"num_warps": 4}
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float32)
    elif change == "misaligned":
        args[0] = x[1:]  # 2 bytes past a 16-byte boundary
    elif change == "n_is_1":
        args[1] = 1
    elif change == "n_mult_16":
        args[1] = 32
    elif change == "m_64bit":
        args[2] = 1 << 40
    elif change == "constexpr":
        args[3] = 64
    elif change == "kwarg":
        kwargs["FLAG"] = False
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    fk[(1,)](*args, **kwargs)
    assert len(fk.fn.compiles) == 2 and fk.fast_launches == 0


def test_triton_path_where_the_fast_one_does_not_apply():
    """CPU tensors (the interpreter) and kernels without parameters go Triton's way."""
    calls = []

    class Rec(FakeJit):
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    k = FastKernel(Rec())
    k[(2,)](torch.zeros(4), 1, 2, 16)  # CPU tensors
    k[(2,)](torch.zeros(4), 1, 2, 16)
    assert len(calls) == 2 and k.fast_launches == 0
    no_params = Rec()
    del no_params.params  # as the interpreter's function
    assert FastKernel(no_params).kinds is None
    FastKernel(no_params)[(1,)](torch.zeros(4), 1, 2, 16)
    assert len(calls) == 3


def test_hooks_installed_reads_triton_hook_chains(monkeypatch):
    """Triton keeps launch hooks as chains that are never None (the first H200 run of this
    path found it never taken): only a chain with a hook in it counts."""
    from triton import knobs

    assert not launch.hooks_installed()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch.hooks_installed()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch.hooks_installed()


def test_eligible_on_cuda_tensors_without_hooks(monkeypatch):
    k = FastKernel(FakeJit())
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda idx: 0)
    assert not k._eligible((torch.zeros(2), 1))  # a CPU tensor: the interpreter's path
    monkeypatch.setattr(launch, "_on_cuda", lambda a: True)
    assert k._eligible((torch.zeros(2), 1))
    monkeypatch.setattr(launch, "hooks_installed", lambda: True)
    assert not k._eligible((torch.zeros(2), 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_kernels_are_the_ones_triton_picks():
    """MBGMV and MBGMM launched through the cache over arguments that vary the way serving
    varies them (token counts, offsets into buffers, ranks): for every call, the kernel the
    cache launched is the one Triton's own path compiles for those arguments."""
    from slora.kernels import lora

    gen = torch.Generator().manual_seed(0)
    dev = "cuda"
    P, d, r = 4096, 256, 16
    pool = torch.randn(1, 64, P, generator=gen).to(torch.bfloat16).to(dev)[0]
    pages = torch.arange(64, dtype=torch.int32, device=dev).view(8, 8)
    offs = torch.tensor([[0, 0]] * 8, dtype=torch.int64, device=dev)
    ranks = torch.full((8, 1), r, dtype=torch.int32, device=dev)
    kernels = [lora._mbgmv_shrink_kernel, lora._mbgmv_expand_kernel]
    seen = {k: {} for k in kernels}
    orig = FastKernel.launch

    def checked(self, grid, args, kwargs):
        kernel = orig(self, grid, args, kwargs)
        if self in seen:
            ref = self.fn.warmup(*args, grid=grid, **kwargs)
            assert kernel is ref
            seen[self][id(kernel)] = True
        return kernel

    FastKernel.launch = checked
    try:
        for T in (1, 3, 16, 17, 32, 64):
            for start in (0, 1, 8):  # elements into a buffer: 1 leaves x misaligned
                buf = torch.randn(T * d + 8, generator=gen).to(torch.bfloat16).to(dev)
                x = buf[start:start + T * d].view(T, d)
                slots = torch.randint(-1, 8, (T,), generator=gen, dtype=torch.int32).to(dev)
                xa = lora.mbgmv_shrink(x, pool, pages, offs[:, :1], ranks, slots, 256, r)
                out = torch.zeros(T, d, dtype=torch.bfloat16, device=dev)
                lora.mbgmv_expand(xa, out, pool, pages, offs[:, 1:], ranks, slots, (d,), (256,))
        torch.cuda.synchronize()
    finally:
        FastKernel.launch = orig
    assert all(k.fast_launches > 0 for k in kernels)
