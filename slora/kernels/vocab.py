"""The embedding LoRA's shrink (Triton): a gather of one column of each token's adapter's A.

Semantics: exactly `reference.embedding_shrink` (the torch twin), with token_slot[t] picking
each token's adapter row (-1 = base model only):

    xa[t, 0, :r] = A[:, ids[t]]       A [r, vocab] as PEFT's lora_embedding_A; fp32, zero past
                                      the rank and on base-only rows

The expand (`+= xa @ B^T`, B^T [r, hidden]) and lm_head's shrink and expand are the ordinary
MBGMV / MBGMM launches over the same layout (see `TritonBackend.embed_lora` / `head_lora`).

Layout (core.adapters.AdapterLayout): embed_tokens' A is r rows of `stride` = vocab rounded up
to 64 elements in layer 0's slot of the adapter's pages. Element (i, id) sits at virtual
element off_a + i * stride + id, so a token reads r scattered elements, one page lookup each:
r (<= a few hundred) loads a token, far below the expand's r x hidden, which is why the
gather needs no tiling beyond one program per (token, rank tile).

PDL (`pdl.py`): the step's metadata (slots, ranks, offsets) is read before the wait; the token
ids (which the step before may write, async scheduling) and the adapter pages after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .adapter_pages import CHUNK
from .tuning import pow2


@triton.jit(do_not_specialize=["stride_pg"])
def _embedding_shrink_kernel(
    ids_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr, xa_ptr,
    stride, P, stride_pg, stride_of0, stride_rk0, max_rank,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t)
    rank = tl.load(ranks_ptr + slot * stride_rk0, mask=slot >= 0, other=0)
    off_a = tl.load(offs_ptr + slot * stride_of0, mask=slot >= 0, other=0)
    pdl.wait(PDL)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    ok = (offs_r < rank) & (tok >= 0) & (tok < stride)  # (an id past the row reads 0)
    v = off_a + offs_r.to(tl.int64) * stride + tok  # [BLOCK_R] virtual elements
    pages_row = pages_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pg
    page = tl.load(pages_row + v // P, mask=ok, other=0)
    a = tl.load(pool_ptr + page.to(tl.int64) * P + v % P, mask=ok, other=0.0)
    pdl.launch_next(PDL)
    tl.store(xa_ptr + t.to(tl.int64) * max_rank + offs_r, a.to(tl.float32),
             mask=offs_r < max_rank)


def embedding_shrink(ids: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                     offsets_a: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                     stride: int, max_rank: int) -> torch.Tensor:
    """xa [T, 1, max_rank] float32: column ids[t] of token t's adapter's embedding A.

    ids [T] token ids; offsets_a int64 [n_a, 1]; ranks int32 [n_a, 1] (any strides);
    token_slot int32 [T] (-1 = base model); pool_l [num_pages, P] contiguous.
    Twin: `reference.embedding_shrink`. Grid: (token, rank tile)."""
    assert pool_l.dim() == 2 and pool_l.is_contiguous() and pool_l.shape[1] % CHUNK == 0
    assert pages.dtype == torch.int32 and offsets_a.dtype == torch.int64
    assert ranks.dtype == torch.int32 and offsets_a.shape == ranks.shape
    assert offsets_a.shape[1] == 1 and stride % CHUNK == 0
    T = ids.shape[0]
    xa = torch.empty(T, 1, max_rank, dtype=torch.float32, device=ids.device)
    if T == 0 or max_rank == 0:
        return xa.zero_()
    block_r = min(64, pow2(max_rank))
    grid = (T, triton.cdiv(max_rank, block_r))
    _embedding_shrink_kernel[grid](
        ids, pool_l, pages, offsets_a, ranks, token_slot, xa,
        stride, pool_l.shape[1], pages.stride(0), offsets_a.stride(0), ranks.stride(0),
        max_rank, BLOCK_R=block_r, **pdl.options(ids.device))
    return xa
