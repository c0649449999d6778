"""The DoRA rescale kernel (kernels/dora.py) against its torch twin (reference.dora_scale).

Without CUDA the kernel runs under the Triton interpreter on small shapes; with CUDA on the
GPU (bf16 included). Each adapter's DoRA rows sit in scattered, shuffled pool pages (rows that
straddle a page boundary included), every element no DoRA row owns is NaN, and the batch mixes
base rows, adapters without DoRA and adapters with DoRA on some modules only, so a read outside
a row or a rescale of the wrong row shows.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from slora.kernels import reference as ref  # noqa: E402
from slora.kernels.dora import dora_scale  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALIGN = ref.LORA_ALIGN
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def setup(out_dims, T, n_a, dtype, gen, page_size=128):
    """(pool, pages, offsets_d, token_slot): adapter 0 without DoRA, the others with DoRA on a
    random non-empty subset of the modules, at offsets that make rows straddle pages."""
    G = len(out_dims)
    offsets = torch.full((n_a, G), -1, dtype=torch.int64)
    sizes = []
    for a in range(n_a):
        off = ALIGN * int(torch.randint(0, 3, (1,), generator=gen))  # other rows first
        on = torch.rand(G, generator=gen) < 0.7
        on[int(torch.randint(G, (1,), generator=gen))] = a > 0
        for g in range(G):
            if a > 0 and bool(on[g]):
                offsets[a, g] = off
                off += pad(out_dims[g])
        sizes.append(max(off, 1))
    need = [-(-n // page_size) for n in sizes]
    num_pages = sum(need) + 3
    pool = torch.full((num_pages, page_size), float("nan"), dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen)
    pages = torch.zeros(n_a, max(need) + 1, dtype=torch.int32)
    used = 0
    for a in range(n_a):
        pages[a, :need[a]] = perm[used:used + need[a]].to(torch.int32)
        used += need[a]
        virt = pool[pages[a, :need[a]].long()].reshape(-1)
        for g in range(G):
            if offsets[a, g] >= 0:
                o = int(offsets[a, g])
                virt[o:o + out_dims[g]] = (torch.randn(out_dims[g], generator=gen) * 0.2).to(dtype)
        pool[pages[a, :need[a]].long()] = virt.view(need[a], page_size)
    token_slot = torch.randint(-1, n_a, (T,), generator=gen, dtype=torch.int32)
    return pool, pages, offsets, token_slot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dims", [(96,), (128, 40), (128, 64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_dora_scale_matches_twin(out_dims, bias, dtype):
    gen = torch.Generator().manual_seed(len(out_dims) * 7 + bias)
    T, n_a = 9, 4
    pool, pages, offsets, slot = setup(out_dims, T, n_a, dtype, gen)
    out = torch.randn(T, sum(out_dims), generator=gen).to(dtype)
    b = torch.randn(sum(out_dims), generator=gen).to(dtype) if bias else None
    strides = tuple(pad(d) for d in out_dims)
    want = out.clone()
    ref.dora_scale(want, b, pool, pages, offsets, slot, out_dims, strides)
    dev = [t.to(DEVICE, copy=True) if t is not None else None
           for t in (out, b, pool, pages, offsets, slot)]
    dora_scale(dev[0], dev[1], *dev[2:], out_dims, strides)
    # float32: a GPU may fuse the multiply-add (one rounding less than the twin)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dev[0].cpu(), want, **tol, equal_nan=False)
    # rows of the base model and of adapters without DoRA are untouched; DoRA rows change
    col = 0
    for g, d in enumerate(out_dims):
        for t in range(T):
            s = int(slot[t])
            rescaled = s >= 0 and int(offsets[s, g]) >= 0
            same = torch.equal(want[t, col:col + d], out[t, col:col + d])
            assert same != rescaled, (t, g)
        col += d
