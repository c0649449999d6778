"""MBGMV: the decode rows' multi-LoRA shrink and expand (Triton), reading adapter weights
straight from the paged pool (`adapter_pages`).

Semantics: exactly `reference.lora_shrink` / `reference.lora_expand` (the torch twins), with
token_slot[t] picking each token's adapter row (-1 = base model only):

    shrink:  xa[t, g, :r] = x[t] @ A_g^T            (fp32, zero past the rank and on base rows)
    expand:  out[t, cols_g] += xa[t, g, :r] @ B_g^T  (fp32 accumulation, added in out's dtype)

for the G modules of one group that share an input (q/k/v, or gate/up, or a single module).

Tiling, and why:
  * MBGMV is memory-bound: each token reads its own adapter's A (r x d_in) and B^T (r x d_out),
    once. Shrink programs own (token, module, rank tile) and stream the whole d_in, CH aligned
    chunks per iteration ([BLOCK_R, CH, 64] tiles), reducing each chunk at once into a small
    fp32 [BLOCK_R, CH] accumulator. Expand programs own (token, module, 64*CHN output columns),
    read their out tile first (its latency hides behind the adapter reads) and stream the rank
    rows ([BLOCK_R, CHN, 64] tiles). Small tiles keep registers low, so more programs fit on an
    SM and more loads are in flight: occupancy decides the speed more than tile size does.
    A launch of few rows has SMs to spare and is latency-bound: there (in the `generic`
    table) an expand program takes 64 columns and up to 64 rank rows a trip, so a rank-64
    row costs one trip of dependent loads, not sixteen. The tiles per GPU and shape are data
    (`_mbgmv_shrink_cfg`, `_mbgmv_expand_cfg`).
  * Rows with slot -1 return at their first instruction; ranks differ per adapter and per
    module and every load is masked to the row's own rank, so the grid is sized for `max_rank`
    but an adapter of rank r reads r rows, not max_rank.
  * The page-table width (`stride_pg`: the most pages of any adapter in the batch) changes from
    step to step; it is exempt from Triton's integer specialization, so a width of a new class
    (1, a multiple of 16, other) met while serving compiles no new variant. The page size P,
    fixed for an engine's life, is a compile-time constant: each chunk's page lookup divides
    by it with a multiply and a shift.

PDL (`pdl.py`): each kernel reads the step's metadata (slots, ranks, offsets, page ids) before
its wait, and x, xa and out after it. A launch of at most PRE_WAIT_ROWS (token x rank) rows a
module also loads each program's first adapter tile before the wait (adapter pages are written
only by the copies before the step).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import pdl, tuning
from .adapter_pages import CHUNK, CK, a_chunks, add_rounded, b_rows, check_meta, dims4, select
from .tuning import pow2


@triton.jit(do_not_specialize=["stride_pg"])
def _mbgmv_shrink_kernel(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr, xa_ptr,
    stride_x, d_in, stride, P: tl.constexpr,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank,
    BLOCK_R: tl.constexpr, CH: tl.constexpr, EVEN_K: tl.constexpr, PRE: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_R
    offs_r = r0 + tl.arange(0, BLOCK_R)
    xa_row = xa_ptr + (t * G + g) * max_rank + offs_r
    # Before the wait, what no kernel of the step writes: the step's metadata and, with PRE,
    # the first CH chunks of this program's A rows (adapter pages are written only by the
    # copies before the step; masked to nothing on base-only rows and rank tiles past the rank)
    slot = tl.load(slot_ptr + t)
    rank = tl.load(ranks_ptr + slot * stride_rk0 + g * stride_rk1, mask=slot >= 0, other=0)
    off_a = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1, mask=slot >= 0,
                    other=0).to(tl.int32)
    if PRE:  # (r3 and c3 as in _shrink_rows)
        r3 = offs_r[:, None, None]
        a0 = a_chunks(pool_ptr, pages_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pg,
                      off_a + r3 * stride, r3 < rank, tl.arange(0, CH)[None, :, None] * CK,
                      d_in, P, EVEN_K)
    pdl.wait(PDL)
    if r0 >= rank:  # base-only row, or a rank tile past this adapter's rank: zeros, done
        tl.store(xa_row, tl.zeros((BLOCK_R,), tl.float32), mask=offs_r < max_rank)
        return

    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    x_row = x_ptr + t.to(tl.int64) * stride_x
    res = _shrink_rows(x_row, pool_ptr, pages_row, off_a, offs_r, rank, d_in, stride, P,
                       a0 if PRE else 0, BLOCK_R, CH, EVEN_K, PRE)
    pdl.launch_next(PDL)
    tl.store(xa_row, res, mask=offs_r < max_rank)


@triton.jit
def _shrink_rows(x_row, pool_ptr, pages_row, off_a, rows, rank, d_in, stride, P, a0,
                 BLOCK_R: tl.constexpr, CH: tl.constexpr, EVEN_K: tl.constexpr,
                 PRE: tl.constexpr):
    """fp32 [BLOCK_R]: x_row . A[rows] of one adapter's module over d_in (rows at or past
    `rank` give 0), streaming CH aligned chunks of every row an iteration; with PRE, `a0` is
    the first iteration's A tile, loaded already (`a_chunks`)."""
    r3 = rows[:, None, None]
    c3 = tl.arange(0, CH)[None, :, None] * CK
    e3 = tl.arange(0, CK)[None, None, :]
    row_ok = r3 < rank
    row_v = off_a + r3 * stride  # [R, 1, 1] virtual row starts
    acc = tl.zeros((BLOCK_R, CH), tl.float32)
    k_first = 0
    if PRE:
        xmask = (c3 < d_in) if EVEN_K else (c3 + e3 < d_in)
        xv = tl.load(x_row + c3 + e3, mask=xmask, other=0.0)
        acc += tl.sum(a0.to(tl.float32) * xv.to(tl.float32), axis=2)
        k_first = CH * CK
    for k0 in range(k_first, d_in, CH * CK):
        kc = k0 + c3  # [1, CH, 1] chunk starts
        a = a_chunks(pool_ptr, pages_row, row_v, row_ok, kc, d_in, P, EVEN_K)
        xmask = (kc < d_in) if EVEN_K else (kc + e3 < d_in)
        xv = tl.load(x_row + kc + e3, mask=xmask, other=0.0)
        # Reduce each chunk at once (in-thread, then 3 warp shuffles): a small accumulator
        # keeps registers low, so more programs fit on an SM and more loads are in flight.
        acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32), axis=2)
    return tl.sum(acc, axis=1)


@triton.jit
def _out_tile(out_ptr, t, stride_out, col, n0, d_out, CHN: tl.constexpr, EVEN_N: tl.constexpr):
    """(pointers, mask, values) of token t's columns n0..n0+64*CHN-1 of a module whose columns
    start at `col` of out. Read first, so the latency overlaps the adapter reads that follow."""
    c2 = n0 + tl.arange(0, CHN)[:, None] * CK
    cols = c2 + tl.arange(0, CK)[None, :]
    ptrs = out_ptr + t.to(tl.int64) * stride_out + col + cols
    if EVEN_N:
        omask = c2 < d_out  # per chunk: keeps the out accesses 16-byte vectors
    else:
        omask = cols < d_out
    return ptrs, omask, tl.load(ptrs, mask=omask, other=0.0)


@triton.jit(do_not_specialize=["stride_pg"])
def _mbgmv_expand_kernel(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr,
    stride_out, P: tl.constexpr,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank,
    d0, d1, d2, d3, s0, s1, s2, s3,
    BLOCK_R: tl.constexpr, CHN: tl.constexpr, EVEN_N: tl.constexpr, PRE: tl.constexpr,
    PDL: tl.constexpr,
):
    # The token varies slowest (see mbgmv_expand): a token's programs start together
    t = tl.program_id(1)
    g = tl.program_id(0) % G
    n0 = (tl.program_id(0) // G) * (CHN * CK)
    # Before the wait, what no kernel of the step writes: the step's metadata and, with PRE,
    # this program's first BLOCK_R rows of B^T (adapter pages, written only by the copies
    # before the step; masked to nothing on base-only rows and column tiles past d_out). Every
    # program waits, returning early or not, so this kernel ends after the one before it.
    slot = tl.load(slot_ptr + t)
    d_out = select(g, d0, d1, d2, d3)
    # rank and offset loads issued together: one memory latency, not two in a row
    rank = tl.load(ranks_ptr + slot * stride_rk0 + g * stride_rk1, mask=slot >= 0, other=0)
    off_b = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1, mask=slot >= 0,
                    other=0).to(tl.int32)
    if PRE:  # (r3 and nc as below)
        b0 = b_rows(pool_ptr, pages_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pg, off_b,
                    tl.arange(0, BLOCK_R)[:, None, None], rank,
                    n0 + tl.arange(0, CHN)[None, :, None] * CK, d_out,
                    select(g, s0, s1, s2, s3), P, EVEN_N)
    pdl.wait(PDL)
    if (rank == 0) | (n0 >= d_out):  # (a base-only row has rank 0)
        return
    stride = select(g, s0, s1, s2, s3)
    col = select(g, 0, d0, d0 + d1, d0 + d1 + d2)

    ptrs, omask, o = _out_tile(out_ptr, t, stride_out, col, n0, d_out, CHN, EVEN_N)

    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    r3 = tl.arange(0, BLOCK_R)[:, None, None]
    nc = n0 + tl.arange(0, CHN)[None, :, None] * CK  # [1, CHN, 1] chunk starts
    xa_row = xa_ptr + (t * G + g) * max_rank
    acc = tl.zeros((BLOCK_R, CHN, CK), tl.float32)
    r_first = 0
    if PRE:  # (the first tile, loaded before the wait; without PRE the loop as before)
        acc += b0 * tl.load(xa_row + r3, mask=r3 < rank, other=0.0)
        r_first = BLOCK_R
    for rr in range(r_first, rank, BLOCK_R):
        rows = rr + r3
        # (the B tile's loads issued before xa's: the longer chain starts first)
        b = b_rows(pool_ptr, pages_row, off_b, rows, rank, nc, d_out, stride, P, EVEN_N)
        acc += b * tl.load(xa_row + rows, mask=rows < rank, other=0.0)
    delta = tl.sum(acc, axis=0)  # [CHN, CK]
    pdl.launch_next(PDL)
    tl.store(ptrs, add_rounded(o, delta), mask=omask)


# MBGMV loads each program's first adapter tile (A in the shrink, B^T in the expand) before
# its PDL wait while a launch reads at most this many (token x rank) adapter rows a module:
# small launches are latency-bound, and the early load overlaps the kernel before. Larger
# launches take the loop alone (PRE=False compiles the kernels without the early load).
PRE_WAIT_ROWS = 256


def _mbgmv_shrink_cfg(T: int, G: int, max_rank: int, d_in: int, device: torch.device) -> dict:
    """The shrink's tiles: table entry `mbgmv_shrink`, by `rank` (max_rank), `rows` (T x G)
    and `programs` (the grid the rule's tile gives: rows x rank tiles). The tile never exceeds
    the data: BLOCK_R at most the rank's power of two, CH at most d_in's chunks'."""
    return dict(_shrink_cfg(tuning.kind(device), T, G, max_rank, d_in))


@functools.lru_cache(maxsize=4096)
def _shrink_cfg(table: str, T: int, G: int, max_rank: int, d_in: int) -> dict:
    def fit(cfg):
        cfg["BLOCK_R"] = min(cfg["BLOCK_R"], pow2(max_rank))
        cfg["CH"] = min(cfg["CH"], pow2(triton.cdiv(d_in, CHUNK)))
        return cfg

    return tuning.choose(table, "mbgmv_shrink", fit, rank=max_rank, rows=T * G,
                         programs=lambda c: T * G * triton.cdiv(max_rank, c["BLOCK_R"]))


def _mbgmv_expand_cfg(T: int, G: int, max_rank: int, max_out: int, device: torch.device) -> dict:
    """The expand's tiles: table entry `mbgmv_expand`, by `rows` (T x G), `modules` (G) and
    `programs` (the grid the rule's tile gives: modules x column tiles x tokens). The tile
    never exceeds the data: BLOCK_R at most the rank's power of two, CHN at most the widest
    module's chunks'."""
    return dict(_expand_cfg(tuning.kind(device), T, G, max_rank, max_out))


@functools.lru_cache(maxsize=4096)
def _expand_cfg(table: str, T: int, G: int, max_rank: int, max_out: int) -> dict:
    def fit(cfg):
        cfg["BLOCK_R"] = min(cfg["BLOCK_R"], pow2(max_rank))
        cfg["CHN"] = min(cfg["CHN"], pow2(triton.cdiv(max_out, CHUNK)))
        return cfg

    return tuning.choose(table, "mbgmv_expand", fit, rows=T * G, modules=G,
                         programs=lambda c: G * triton.cdiv(max_out, c["CHN"] * CHUNK) * T)


def mbgmv_shrink(x: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_a: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                 stride: int, max_rank: int) -> torch.Tensor:
    """MBGMV shrink (decode): xa[t, g, :r] = x[t] @ A_g^T of token t's own adapter.

    x [T, d_in]; token_slot int32 [T] (-1 = base model). Returns xa [T, G, max_rank] float32,
    zero past each rank and on base-only rows. Twin: `reference.lora_shrink`.
    Grid: (token, module, rank tile); see the module docstring for the tiling.
    """
    check_meta(x, pool_l, pages, offsets_a, ranks)
    T, d_in = x.shape
    G = offsets_a.shape[1]
    assert stride % CHUNK == 0 and stride >= d_in
    xa = torch.empty(T, G, max_rank, dtype=torch.float32, device=x.device)
    if T == 0 or max_rank == 0:
        return xa.zero_()
    cfg = _mbgmv_shrink_cfg(T, G, max_rank, d_in, x.device)
    grid = (T, G, triton.cdiv(max_rank, cfg["BLOCK_R"]))
    _mbgmv_shrink_kernel[grid](
        x, pool_l, pages, offsets_a, ranks, token_slot, xa,
        x.stride(0), d_in, stride, pool_l.shape[1],
        pages.stride(0), offsets_a.stride(0), offsets_a.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, EVEN_K=d_in % CHUNK == 0, PRE=T * max_rank <= PRE_WAIT_ROWS,
        **pdl.options(x.device), **cfg)
    return xa


def mbgmv_expand(xa: torch.Tensor, out: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_b: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                 out_dims: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """MBGMV expand (decode), in place: out[t, cols_g] += xa[t, g, :r] @ B_g^T.

    out [T, sum(out_dims)], module g's columns start at sum(out_dims[:g]); strides[g] is the
    B^T row stride of module g in the virtual buffer. Base-only rows are not touched.
    Twin: `reference.lora_expand`. Grid: (module x 64*CHN output columns, token).

    A program's time grows with its row's rank (it walks the rank rows), and the GPU starts
    programs in grid order, the first axis fastest: with the token on the slow axis and the
    rows in order of rank, highest first (the scheduler orders decode rows so), the longest
    programs start first and short ones fill the end, as in longest-job-first scheduling.
    """
    check_meta(out, pool_l, pages, offsets_b, ranks)
    T, G, max_rank = xa.shape
    assert xa.dtype == torch.float32 and xa.is_contiguous()
    assert out.shape == (T, sum(out_dims)) and len(out_dims) == G
    if T == 0 or max_rank == 0:
        return
    d, s = dims4(out_dims, strides)
    cfg = _mbgmv_expand_cfg(T, G, max_rank, max(out_dims), out.device)
    assert T <= 65535, f"mbgmv_expand: {T} rows, past the grid's second axis (65,535)"
    grid = (G * triton.cdiv(max(out_dims), cfg["CHN"] * CHUNK), T)
    _mbgmv_expand_kernel[grid](
        xa, out, pool_l, pages, offsets_b, ranks, token_slot,
        out.stride(0), pool_l.shape[1],
        pages.stride(0), offsets_b.stride(0), offsets_b.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, *d, *s, EVEN_N=all(x % CHUNK == 0 for x in out_dims),
        PRE=T * max_rank <= PRE_WAIT_ROWS, **pdl.options(out.device), **cfg)


