"""DoRA's per-row rescale of a LoRA group's output, read from each adapter's DoRA rows.

Twin: `reference.dora_scale`. After a group's base linear and its LoRA expand, each token whose
adapter has a DoRA row for module g (LoraMeta's `offsets_d[slot, g]` >= 0) gets
    out[t, cols_g] += d_g * (out[t, cols_g] - bias[cols_g])
with d_g = magnitude / ||W + s B A||_row - 1 (reference.py's docstring): one more read of the
row's output and of one d_out-element vector of the adapter's pages. Rows of other adapters and
base rows return at once, so one launch serves a batch that mixes them, and the launch's grid
depends on the batch's shape alone (a CUDA graph replays it for any adapters).

Grid: (token, module x 64*CHN output columns). The DoRA row follows the pool's alignment rule
(its offset and P are multiples of 64): each 64-element chunk lies in one page, looked up once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slora.kernels import pdl
from slora.kernels.adapter_pages import CHUNK, CK, MAX_GROUP, dims4, select

CHN = 4  # 64-element chunks a program rescales
NUM_WARPS = 1  # a program's 256 elements in 8 per thread: 16-byte loads of 16-bit rows


# The page-table width (stride_pg) changes with the batch's adapters: not specialized on, or a
# step would compile another variant while serving.
@triton.jit(do_not_specialize=["stride_pg"])
def _dora_scale_kernel(
    out_ptr, bias_ptr, pool_ptr, pages_ptr, offs_ptr, slot_ptr,
    stride_out, P, stride_pg, stride_of0, stride_of1, G,
    d0, d1, d2, d3,
    HAS_BIAS: tl.constexpr, CHN: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1) % G
    n0 = (tl.program_id(1) // G) * (CHN * CK)
    # before the wait, the step's metadata only (no kernel of the step writes it)
    slot = tl.load(slot_ptr + t)
    d_out = select(g, d0, d1, d2, d3)
    off = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1, mask=slot >= 0, other=-1)
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    if (off < 0) | (n0 >= d_out):
        return
    col = select(g, 0, d0, d0 + d1, d0 + d1 + d2)
    nc = n0 + tl.arange(0, CHN)[:, None] * CK  # [CHN, 1] chunk starts
    e = tl.arange(0, CK)[None, :]
    cmask = nc < d_out
    mask = cmask if EVEN_N else cmask & (nc + e < d_out)
    v = off + nc
    page = tl.load(pages_ptr + slot.to(tl.int64) * stride_pg + v // P, mask=cmask, other=0)
    base = tl.multiple_of(page.to(tl.int64) * P + (v % P), [CK, CK])
    d = tl.load(pool_ptr + base + e, mask=mask, other=0.0).to(tl.float32)
    ptrs = out_ptr + t.to(tl.int64) * stride_out + col + nc + e
    o = tl.load(ptrs, mask=mask, other=0.0)
    y = o.to(tl.float32)
    if HAS_BIAS:
        y0 = y - tl.load(bias_ptr + col + nc + e, mask=mask, other=0.0).to(tl.float32)
    else:
        y0 = y
    tl.store(ptrs, (y + d * y0).to(o.dtype), mask=mask)


def dora_scale(out: torch.Tensor, bias: torch.Tensor | None, pool_l: torch.Tensor,
               pages: torch.Tensor, offsets_d: torch.Tensor, token_slot: torch.Tensor,
               out_dims: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """In place: out[t, cols_g] += d_g * (out[t, cols_g] - bias[cols_g]) for the tokens whose
    adapter row has a DoRA row for module g; see the module docstring and the twin
    `reference.dora_scale` (same arguments)."""
    assert out.dim() == 2 and out.stride(1) == 1, "out must be 2-D with unit column stride"
    assert pool_l.dim() == 2 and pool_l.is_contiguous() and pool_l.shape[1] % CHUNK == 0
    assert pages.dtype == torch.int32 and offsets_d.dtype == torch.int64
    T, G = out.shape[0], len(out_dims)
    assert offsets_d.shape[1] == G <= MAX_GROUP and out.shape[1] == sum(out_dims)
    assert token_slot.shape[0] >= T
    if bias is not None:
        assert bias.is_contiguous() and bias.shape == (out.shape[1],)
    if T == 0:
        return
    d, _ = dims4(out_dims, strides)
    grid = (T, G * triton.cdiv(max(out_dims), CHN * CHUNK))
    _dora_scale_kernel[grid](
        out, bias if bias is not None else out, pool_l, pages, offsets_d, token_slot,
        out.stride(0), pool_l.shape[1], pages.stride(0), offsets_d.stride(0),
        offsets_d.stride(1), G, *d, HAS_BIAS=bias is not None, CHN=CHN,
        EVEN_N=all(x % CHUNK == 0 for x in out_dims), num_warps=NUM_WARPS,
        **pdl.options(out.device))
