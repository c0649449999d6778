"""How the LoRA kernels (MBGMV, MBGMM) read an adapter's rows from the paged pool.

Page layout (reference.py states it). Adapter `a` owns pages `pages[a, :]`; its per-layer
virtual buffer is pool_l[pages[a, 0]] ++ pool_l[pages[a, 1]] ++ ..., so virtual element v sits
at pool_l[pages[a, v // P], v % P]. Module g's A row i starts at offsets_a[a, g] + i * stride,
its B^T row i at offsets_b[a, g] + i * strides[g].

Alignment rule: offsets, strides and P are multiples of LORA_ALIGN = 64 elements, so every
64-element chunk that starts at a multiple of 64 inside a row lies in one page. Every helper
here reads whole such chunks: the page id is looked up once per (row, chunk), never per
element, and the 64 elements are contiguous, so the loads are 16-byte vectors (each helper
tells the compiler that the chunk base is a multiple of 64, on the address expression itself:
a hint set on a jit function's result is dropped).

Batch metadata checked here: pages int32 [n_a, max_pages]; offsets int64 [n_a, G]; ranks int32
[n_a, G] (this layer), any strides (so the runner passes slices of its [n_a, 7, 2] and
[L, n_a, 7] tensors without copies); x and out 2-D with unit column stride; pool_l
[num_pages, P] contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import LORA_ALIGN

CHUNK = LORA_ALIGN  # elements in one aligned chunk: one page lookup each
CK = tl.constexpr(CHUNK)  # the same, for use inside kernels
MAX_GROUP = 4  # modules per launch (q/k/v is the largest group a model has)


# ----------------------------------------------------------------------------- host checks

def check_meta(x, pool_l, pages, offsets, ranks):
    """Assert the layout and dtypes every LoRA kernel relies on (see the module docstring)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be 2-D with unit column stride"
    assert pool_l.dim() == 2 and pool_l.is_contiguous(), "pool_l must be a contiguous [pages, P]"
    assert pool_l.shape[1] % CHUNK == 0, f"page size must be a multiple of {CHUNK}"
    assert pages.dtype == torch.int32 and offsets.dtype == torch.int64
    assert ranks.dtype == torch.int32 and offsets.shape == ranks.shape
    assert offsets.shape[1] <= MAX_GROUP, f"at most {MAX_GROUP} modules per launch"


def dims4(out_dims, strides):
    """A group's output widths and B^T row strides, padded with zeros to MAX_GROUP entries (the
    expand kernels take four of each as scalars)."""
    assert len(out_dims) == len(strides) <= MAX_GROUP
    assert all(s % CHUNK == 0 and s >= d for d, s in zip(out_dims, strides))
    d = list(out_dims) + [0] * (MAX_GROUP - len(out_dims))
    s = list(strides) + [0] * (MAX_GROUP - len(strides))
    return d, s


# ----------------------------------------------------------------------------- in kernels

@triton.jit
def add_rounded(o, delta):
    """o + delta rounded to o's dtype first, as the twin adds (out += delta.to(out.dtype)).
    The sum itself runs in fp32: the interpreter gets bf16 arithmetic wrong."""
    return (o.to(tl.float32) + delta.to(o.dtype).to(tl.float32)).to(o.dtype)


@triton.jit
def select(g, a0, a1, a2, a3):
    """a_g of four scalars, g in 0..3 (a module's value from the four passed per launch)."""
    return tl.where(g == 0, a0, tl.where(g == 1, a1, tl.where(g == 2, a2, a3)))


@triton.jit
def a_chunks(pool_ptr, pages_row, row_v, row_ok, kc, d_in, P, EVEN_K: tl.constexpr):
    """[R, CH, 64] of one adapter's A: the rows starting at virtual `row_v` ([R, 1, 1]), at the
    chunks starting at `kc` ([1, CH, 1]); rows not `row_ok` and columns past d_in give 0."""
    e3 = tl.arange(0, CK)[None, None, :]
    cmask = row_ok & (kc < d_in)
    v = row_v + kc
    page = tl.load(pages_row + v // P, mask=cmask, other=0)
    base = tl.multiple_of(page.to(tl.int64) * P + (v % P), [CK, CK, CK])
    amask = cmask if EVEN_K else cmask & (kc + e3 < d_in)
    return tl.load(pool_ptr + base + e3, mask=amask, other=0.0)


@triton.jit
def b_rows(pool_ptr, pages_row, off_b, rows, rank, nc, d_out, stride, P, EVEN_N: tl.constexpr):
    """fp32 [R, CHN, 64]: B^T[rows] of one adapter's module at the column chunks starting at
    `nc` ([1, CHN, 1]); rows at or past `rank` and columns past d_out give 0."""
    e3 = tl.arange(0, CK)[None, None, :]
    cmask = (rows < rank) & (nc < d_out)
    v = off_b + rows * stride + nc
    page = tl.load(pages_row + v // P, mask=cmask, other=0)
    base = tl.multiple_of(page.to(tl.int64) * P + (v % P), [CK, CK, CK])
    if EVEN_N:
        bmask = cmask
    else:
        bmask = cmask & (nc + e3 < d_out)
    return tl.load(pool_ptr + base + e3, mask=bmask, other=0.0).to(tl.float32)


@triton.jit
def row_pages(pages_row, v0, span, ok, P, TWO_PAGES: tl.constexpr):
    """A row of `span` <= P elements starting at virtual `v0` lies in at most two pages: (index
    of the first, its page, the next page or 0), loaded once before a kernel's loop so that the
    loop's loads need no page lookup of their own (`chunk_base`). Without TWO_PAGES: nothing
    loaded."""
    i0 = v0 // P
    if TWO_PAGES:
        p0 = tl.load(pages_row + i0, mask=ok, other=0)
        p1 = tl.load(pages_row + i0 + 1, mask=ok & ((v0 + span - 1) // P > i0), other=0)
    else:
        p0 = i0
        p1 = i0
    return i0, p0, p1


@triton.jit
def chunk_base(pages_row, v, ok, P, i0, p0, p1, TWO_PAGES: tl.constexpr):
    """Pool offsets (multiples of 64) of the aligned chunks starting at virtual `v` ([R] or
    [R, C, 1]): from the rows' two pages (`row_pages`) or, for rows longer than a page, one
    lookup each. The alignment hint is set here, on the expression, not on a caller's copy of
    the result (where the compiler drops it and the tiles load 2 bytes at a time)."""
    if TWO_PAGES:
        page = tl.where(v // P > i0, p1, p0)
    else:
        page = tl.load(pages_row + v // P, mask=ok, other=0)
    off = page.to(tl.int64) * P + (v % P)
    if len(v.shape) == 3:
        off = tl.multiple_of(off, [CK, CK, CK])
    else:
        off = tl.multiple_of(off, [CK])
    return off
