"""Triton multi-LoRA kernels that read adapter weights straight from the paged pool.

Semantics: exactly `reference.lora_shrink` / `reference.lora_expand` (the torch twins).

    shrink:  xa[t, g, :r] = x[t] @ A_g^T            (fp32, zero past the rank and on base rows)
    expand:  out[t, cols_g] += xa[t, g, :r] @ B_g^T  (fp32 accumulation, added in out's dtype)

for the G modules of one group that share an input (q/k/v, or gate/up, or a single module).
Two batch shapes, two kernels each:

    MBGMV (decode):  token_slot[t] picks each token's adapter row (-1 = base model only).
    MBGMM (prefill): segments of consecutive tokens share a slot; seg_start int32 [S+1] holds
                     token offsets, seg_slot int32 [S] the slot of each (-1 = base-only segment).

Page layout (see reference.py). Adapter `a` owns pages `pages[a, :]`; its per-layer virtual
buffer is pool_l[pages[a, 0]] ++ pool_l[pages[a, 1]] ++ ..., so virtual element v sits at
pool_l[pages[a, v // P], v % P]. Module g's A row i starts at offsets_a[a, g] + i * stride,
its B^T row i at offsets_b[a, g] + i * strides[g]. Offsets, strides and P are multiples of
LORA_ALIGN = 64 elements, so every 64-element chunk that starts at a multiple of 64 inside a
row lies in one page.

Tiling, and why:
  * Every tile is built from such aligned 64-element chunks: the page id is looked up once per
    (row, chunk), never per element, and the 64 elements are contiguous in memory, so the loads
    become 16-byte vectors (the compiler is told the chunk base is a multiple of 64).
  * MBGMV is memory-bound: each token reads its own adapter's A (r x d_in) and B^T (r x d_out),
    once. Shrink programs own (token, module, rank tile) and stream the whole d_in, CH chunks
    per iteration ([BLOCK_R, CH, 64] tiles), reducing each chunk at once into a small fp32
    [BLOCK_R, CH] accumulator. Expand programs own (token, module, 64*CHN output columns),
    read their out tile first (its latency hides behind the adapter reads) and stream the rank
    rows ([BLOCK_R, CHN, 64] tiles). Small tiles, few registers: on the H200 occupancy (loads
    in flight per SM) decided speed more than tile size did; see the *_cfg functions for the
    measured choices.
  * MBGMM uses tl.dot on (BLOCK_M tokens x 64) by (64 x BLOCK_R ranks) tiles (shrink) and
    (BLOCK_M x BLOCK_R) by (BLOCK_R x 64 columns) tiles (expand); 64-wide K or N tiles keep one
    page per rank row. A shrink program loads each A row's (at most two) pages before its loop
    over its slice of d_in; an expand program covers every rank and a span of columns: it
    loads its xa tile once, and each B row's (at most two) pages before its loop over the span
    (session 19: the shrink's hoist made the MBGMM pair 4-11% faster on the H200).
    Dot tiles are at least 16 in every dimension on the GPU.
  * MBGMM's programs walk a host-built list of (segment, token tile) work items (`tiles.py`)
    holding only segments with an adapter: no program is launched for a tile without work.
  * Rows (MBGMV) with slot -1 return at their first instruction; ranks differ per adapter
    and per module and every load is masked to the row's own rank, so the grid is sized for
    `max_rank` but an adapter of rank r reads r rows, not max_rank.

Under the Triton interpreter (CPU tensors) dot operands are cast to fp32, because bf16 tl.dot
is silently wrong there (triton#11584); on the GPU fp32 dots run in IEEE precision, so the
fp32 path matches the twin rather than tf32.

Batch metadata: pages int32 [n_a, max_pages]; offsets_a / offsets_b int64 [n_a, G]; ranks
int32 [n_a, G] (this layer). Any strides are accepted for these three (so the runner can pass
slices of its [n_a, 7, 2] / [L, n_a, 7] tensors without copies). x, out: 2-D with unit column
stride; pool_l: [num_pages, P] contiguous.

The page-table width (`stride_pg`: the most pages of any adapter in the batch) changes from step
to step; Triton would compile a variant per value class (1, a multiple of 16, other), so a class
first met while serving cost a compile stall. It is exempt from that specialization, as is
MBGMM shrink's split count.

PDL (`pdl.py`): each kernel reads the step's metadata (slots, ranks, offsets, page ids, work
lists) before its wait and x, xa and out after it. MBGMM took it in session 18 (H200, a graphed
mixed step's grid, `notes/h200-2026-12-01-s18/scratch_mbgmm.py`): its pair 0.3-5% faster
(q/k/v, one 128-token prompt in a 512-token bucket: 32.0 -> 30.4 us), S2 unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .reference import LORA_ALIGN
from .tiles import as_tiles, tile_rows

CHUNK = LORA_ALIGN  # elements in one aligned chunk: one page lookup each
CK = tl.constexpr(CHUNK)  # the same, for use inside kernels
MAX_GROUP = 4  # modules per launch (q/k/v is the largest group a model has)


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _add_rounded(o, delta):
    """o + delta rounded to o's dtype first, as the twin adds (out += delta.to(out.dtype)).
    The sum itself runs in fp32: the interpreter gets bf16 arithmetic wrong."""
    return (o.to(tl.float32) + delta.to(o.dtype).to(tl.float32)).to(o.dtype)


@triton.jit
def _select(g, a0, a1, a2, a3):
    return tl.where(g == 0, a0, tl.where(g == 1, a1, tl.where(g == 2, a2, a3)))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _check_meta(x, pool_l, pages, offsets, ranks):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be 2-D with unit column stride"
    assert pool_l.dim() == 2 and pool_l.is_contiguous(), "pool_l must be a contiguous [pages, P]"
    assert pool_l.shape[1] % CHUNK == 0, f"page size must be a multiple of {CHUNK}"
    assert pages.dtype == torch.int32 and offsets.dtype == torch.int64
    assert ranks.dtype == torch.int32 and offsets.shape == ranks.shape
    assert offsets.shape[1] <= MAX_GROUP, f"at most {MAX_GROUP} modules per launch"


def _dims4(out_dims, strides):
    assert len(out_dims) == len(strides) <= MAX_GROUP
    assert all(s % CHUNK == 0 and s >= d for d, s in zip(out_dims, strides))
    d = list(out_dims) + [0] * (MAX_GROUP - len(out_dims))
    s = list(strides) + [0] * (MAX_GROUP - len(strides))
    return d, s


# ----------------------------------------------------------------------------- MBGMV

@triton.jit(do_not_specialize=["stride_pg"])
def _mbgmv_shrink_kernel(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr, xa_ptr,
    stride_x, d_in, stride, P,
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
        a0 = _a_chunks(pool_ptr, pages_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pg,
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
    the first iteration's A tile, loaded already (`_a_chunks`)."""
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
        a = _a_chunks(pool_ptr, pages_row, row_v, row_ok, kc, d_in, P, EVEN_K)
        xmask = (kc < d_in) if EVEN_K else (kc + e3 < d_in)
        xv = tl.load(x_row + kc + e3, mask=xmask, other=0.0)
        # Reduce each chunk at once (in-thread, then 3 warp shuffles): a small accumulator
        # keeps registers low, so more programs fit on an SM and more loads are in flight.
        acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32), axis=2)
    return tl.sum(acc, axis=1)


@triton.jit
def _a_chunks(pool_ptr, pages_row, row_v, row_ok, kc, d_in, P, EVEN_K: tl.constexpr):
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


@triton.jit
def _b_rows(pool_ptr, pages_row, off_b, rows, rank, nc, d_out, stride, P, EVEN_N: tl.constexpr):
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


@triton.jit(do_not_specialize=["stride_pg"])
def _mbgmv_expand_kernel(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr,
    stride_out, P,
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
    d_out = _select(g, d0, d1, d2, d3)
    # rank and offset loads issued together: one memory latency, not two in a row
    rank = tl.load(ranks_ptr + slot * stride_rk0 + g * stride_rk1, mask=slot >= 0, other=0)
    off_b = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1, mask=slot >= 0,
                    other=0).to(tl.int32)
    if PRE:  # (r3 and nc as below)
        b0 = _b_rows(pool_ptr, pages_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_pg, off_b,
                     tl.arange(0, BLOCK_R)[:, None, None], rank,
                     n0 + tl.arange(0, CHN)[None, :, None] * CK, d_out,
                     _select(g, s0, s1, s2, s3), P, EVEN_N)
    pdl.wait(PDL)
    if (rank == 0) | (n0 >= d_out):  # (a base-only row has rank 0)
        return
    stride = _select(g, s0, s1, s2, s3)
    col = _select(g, 0, d0, d0 + d1, d0 + d1 + d2)

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
        # (the B tile's loads issued before xa's, as measured on the H200)
        b = _b_rows(pool_ptr, pages_row, off_b, rows, rank, nc, d_out, stride, P, EVEN_N)
        acc += b * tl.load(xa_row + rows, mask=rows < rank, other=0.0)
    delta = tl.sum(acc, axis=0)  # [CHN, CK]
    pdl.launch_next(PDL)
    tl.store(ptrs, _add_rounded(o, delta), mask=omask)


# MBGMV loads each program's first adapter tile (A in the shrink, B^T in the expand) before
# its PDL wait while a launch reads at most this many (token x rank) adapter rows a module.
# On the H200 (session 12, call 2; q/k/v pairs back to back, every token its own adapter)
# loading before the wait took the small launches 9-11% faster (batch 1 rank 8 5.80 -> 5.16
# us, batch 16 rank 16 9.74 -> 8.84, batch 32 rank 8 9.75 -> 8.87) and decode steps with all
# seven modules 4.90 -> 4.78 ms at batch 1, 5.81 -> 5.66 at 16, while larger launches ran
# 1-5% slower than session 11's kernels (batch 64 rank 16 20.7 -> 21.5-21.9 us) in calls 2-4,
# with the early load or without it: that came from the loop's code, since written back as it
# was. Above this many rows the two kernels compile to session 11's PTX (debug lines aside).
PRE_WAIT_ROWS = 256


def _mbgmv_shrink_cfg(T: int, G: int, max_rank: int, d_in: int, device: torch.device) -> dict:
    """Tiles measured on the H200 (experiments/bench_kernels.py --tune, bf16, hidden 4096):
    [4 rank rows x 32 chunks] per iteration with 4 warps was best or within 3% of best at batch
    64 and 256, ranks 16-128. Fewer rank rows per program when that leaves < 512 programs
    (batch 16: 1 row x 32 chunks, 8 warps, -38% time), so enough loads are in flight."""
    if device.type != "cuda":  # interpreter: its cost grows with programs x loop trips
        return dict(BLOCK_R=min(16, _pow2(max_rank)), CH=min(8, _pow2(triton.cdiv(d_in, CHUNK))))
    block_r = 4
    while block_r > 1 and T * G * triton.cdiv(max_rank, block_r) < 512:
        block_r //= 2
    block_r = min(block_r, _pow2(max_rank))
    ch = min(32, _pow2(triton.cdiv(d_in, CHUNK)))
    return dict(BLOCK_R=block_r, CH=ch, num_warps=4 if block_r > 1 else 8)


EXPAND_WIDE_PROGRAMS = 4096  # MBGMV expand of one module: [2 x 8]-chunk tiles from this many on


def _mbgmv_expand_cfg(T: int, G: int, max_rank: int, max_out: int, device: torch.device) -> dict:
    """Measured on the H200 likewise: [2 rank rows x 8 chunks] tiles with 4 warps were best or
    within 2% of best at batch 64-256 of q/k/v, ranks 16-128: small tiles keep registers low
    (~32), so 16 programs fit per SM; 16-row tiles took 2-3.7x longer. [4 rank rows x 4
    chunks] (twice the programs, half the columns each) was best below 128 (token, module)
    rows: q/k/v at batch 16 and 32, rank 16: 7.68 -> 5.88 us, 8.95 -> 7.65 (session 6); and for
    one module (o, down) below EXPAND_WIDE_PROGRAMS programs of [2 x 8]: o (4096 columns) at
    128 and 256 rows, ranks 64/32/16/8 mixed as in S2, 26.40 -> 19.78 and 30.83 -> 25.02 us
    (session 17). Not for q/k/v at 64-128 rows: with ranks mixed it gained 5% at 128 rows
    (35.74 -> 34.02 us), with one rank (the q/k/v pair, every token its own adapter) it lost
    1.5-7% at 64 and 128 rows, ranks 8-64 (2% won at 128 rows rank 64)."""
    chn = min(8, _pow2(triton.cdiv(max_out, CHUNK)))
    if device.type != "cuda":  # interpreter: fewer, larger programs
        return dict(BLOCK_R=min(16, _pow2(max_rank)), CHN=min(4, chn))
    if T * G < 128 or (G == 1 and T * triton.cdiv(max_out, chn * CHUNK) < EXPAND_WIDE_PROGRAMS):
        return dict(BLOCK_R=min(4, _pow2(max_rank)), CHN=min(4, chn), num_warps=4)
    return dict(BLOCK_R=min(2, _pow2(max_rank)), CHN=chn, num_warps=4)


def mbgmv_shrink(x: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_a: torch.Tensor, ranks: torch.Tensor, token_slot: torch.Tensor,
                 stride: int, max_rank: int) -> torch.Tensor:
    """MBGMV shrink (decode): xa[t, g, :r] = x[t] @ A_g^T of token t's own adapter.

    x [T, d_in]; token_slot int32 [T] (-1 = base model). Returns xa [T, G, max_rank] float32,
    zero past each rank and on base-only rows. Twin: `reference.lora_shrink`.
    Grid: (token, module, rank tile); see the module docstring for the tiling.
    """
    _check_meta(x, pool_l, pages, offsets_a, ranks)
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
    On the H200 (session 14, q/k/v, ranks 64/32/16/8 in one launch) that took the expand from
    39.3 to 34.0 us at 136 rows (62.6 to 53.3 at 256), within 4% of the same rows' time at
    uniform ranks; the token on the fast axis, or the rows unsorted, gained nothing.
    """
    _check_meta(out, pool_l, pages, offsets_b, ranks)
    T, G, max_rank = xa.shape
    assert xa.dtype == torch.float32 and xa.is_contiguous()
    assert out.shape == (T, sum(out_dims)) and len(out_dims) == G
    if T == 0 or max_rank == 0:
        return
    d, s = _dims4(out_dims, strides)
    cfg = _mbgmv_expand_cfg(T, G, max_rank, max(out_dims), out.device)
    assert T <= 65535, f"mbgmv_expand: {T} rows, past the grid's second axis (65,535)"
    grid = (G * triton.cdiv(max(out_dims), cfg["CHN"] * CHUNK), T)
    _mbgmv_expand_kernel[grid](
        xa, out, pool_l, pages, offsets_b, ranks, token_slot,
        out.stride(0), pool_l.shape[1],
        pages.stride(0), offsets_b.stride(0), offsets_b.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, *d, *s, EVEN_N=all(x % CHUNK == 0 for x in out_dims),
        PRE=T * max_rank <= PRE_WAIT_ROWS, **pdl.options(out.device), **cfg)


# ----------------------------------------------------------------------------- MBGMM

@triton.jit
def _row_pages(pages_row, v0, span, ok, P, TWO_PAGES: tl.constexpr):
    """A row of `span` <= P elements starting at virtual `v0` lies in at most two pages: (index
    of the first, its page, the next page or 0), loaded once before a kernel's loop so that the
    loop's loads need no page lookup of their own (`_chunk_base`). Without TWO_PAGES: nothing
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
def _chunk_base(pages_row, v, ok, P, i0, p0, p1, TWO_PAGES: tl.constexpr):
    """Pool offsets (multiples of 64) of the aligned chunks starting at virtual `v` ([R] or
    [R, C, 1]): from the rows' two pages (`_row_pages`) or, for rows longer than a page, one
    lookup each. The alignment hint is set here, on the expression: set on a jit function's
    result it is dropped (session 18: the MBGMM expand's B tiles compiled to 2-byte loads)."""
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


# MBGMM sizes its work on the device, from the step's own tile count (`_split_count`,
# `_span_chunks`): a graph's launch covers its bucket's worst case, while most steps with
# prompts hold one or two short ones.
# Shrink: slices of d_in. A short prompt gives few (token tile, module, rank tile) items, each
# streaming all of d_in in turn: latency, not bandwidth. The slices' partial sums meet in xa by
# atomic adds. Measured on the H200 (session 8): the best split kept items x slices near
# 200-400 (16 slices for one 256-token prompt, 13.6 us against 17.2 at 8; 2 for 8 x 512
# tokens, 65 us against 126 at 8), with at least 4 chunks a slice.
SHRINK_PROGRAMS = tl.constexpr(384)
# Expand: columns a program, 64 doubled while token tiles x modules x column spans stay at
# least this many, up to 512. A program loads its metadata, xa tile and page lookups once for
# its whole span; one program per 64 columns spent most of its time in that chain. Best spans
# (session 13, q/k/v, rank 64): 128 for one 256-token prompt, 512 for 4 x 216 and 8 x 512.
EXPAND_PROGRAMS = tl.constexpr(256)
SPAN_CHUNKS = tl.constexpr(8)  # the widest span, in 64-column chunks (512 columns)


@triton.jit
def _split_count(work, d_in, fixed):
    """MBGMM shrink's slices of d_in for `work` (token tile, module, rank tile) items: `fixed`
    if not 0, else doubled from 1 while items x slices stay within SHRINK_PROGRAMS and every
    slice keeps at least 4 chunks, up to 16 (see mbgmm_shrink)."""
    split = fixed
    if fixed == 0:
        split = 1
        while (split < 16) & (work * split * 2 <= SHRINK_PROGRAMS) & (d_in >= 8 * CK * split):
            split *= 2
    return split


@triton.jit
def _span_chunks(work, d_out, fixed):
    """MBGMM expand's 64-column chunks a program: `fixed` if not 0, else doubled from 1 while
    `work` (token tiles x modules) x column spans stays at least EXPAND_PROGRAMS, up to
    SPAN_CHUNKS (see mbgmm_expand)."""
    chunks = fixed
    if fixed == 0:
        chunks = 1
        while ((chunks < SPAN_CHUNKS)
               & (work * tl.cdiv(d_out, 2 * CK * chunks) >= EXPAND_PROGRAMS)):
            chunks *= 2
    return chunks


@triton.jit(do_not_specialize=["stride_pg", "split_k"])
def _mbgmm_shrink_kernel(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr, tiles_ptr,
    xa_ptr,
    stride_x, d_in, stride, P,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank, n_rt, split_k,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, PDL: tl.constexpr,
):
    # The work: (token tile, module, rank tile, slice of d_in) items, the slices counted from
    # the step's own tiles (the list's length; a graph's grid is sized for its bucket)
    n_tiles = tl.load(tiles_ptr)  # (the step's metadata: before the wait)
    split = _split_count(n_tiles * G * n_rt, d_in, split_k)
    k_split = tl.cdiv(tl.cdiv(d_in, BLOCK_K), split) * BLOCK_K
    split = tl.cdiv(d_in, k_split)  # no empty slice
    per_tile = G * n_rt * split
    pdl.wait(PDL)
    for w in range(tl.program_id(0), n_tiles * per_tile, tl.num_programs(0)):
        i = w // per_tile
        g = w // (n_rt * split) % G
        r0 = (w // split % n_rt) * BLOCK_R
        k_lo = (w % split) * k_split  # this item's slice of d_in
        s = tl.load(tiles_ptr + 1 + 2 * i)
        slot = tl.load(seg_slot_ptr + s)
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rk0 + g * stride_rk1)
        if (slot >= 0) & (r0 < rank):
            m0 = tl.load(tiles_ptr + 2 + 2 * i)
            m_end = tl.minimum(m0 + BLOCK_M, tl.load(seg_start_ptr + s + 1))
            _mbgmm_shrink_tile(x_ptr, pool_ptr, pages_ptr, offs_ptr, xa_ptr, slot, g, rank, m0,
                               m_end, r0, k_lo, stride_x, d_in, stride, P, stride_pg,
                               stride_of0, stride_of1, G, max_rank, split, k_split,
                               BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, DOT_F32, TWO_PAGES)
    pdl.launch_next(PDL)


@triton.jit
def _mbgmm_shrink_tile(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, xa_ptr, slot, g, rank, m0, m_end, r0, k_lo,
    stride_x, d_in, stride, P, stride_pg, stride_of0, stride_of1, G, max_rank, split_k, k_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr,
):
    """Tokens m0..m_end-1 (one tile of a segment on adapter row `slot`), module g, ranks
    r0..r0+BLOCK_R-1, d_in slice k_lo..k_lo+k_split-1."""
    off_a = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1).to(tl.int32)
    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m_end
    r_ok = offs_r < rank
    row_v = off_a + offs_r * stride
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    # each row's slice lies in two pages at most: their ids once, not a lookup a trip
    i0, p0, p1 = _row_pages(pages_row, row_v + k_lo, tl.minimum(k_split, d_in - k_lo), r_ok, P,
                            TWO_PAGES)
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, d_in), BLOCK_K):
        # BLOCK_K is CHUNK, so each row's tile lies in one page
        base = _chunk_base(pages_row, row_v + k0, r_ok, P, i0, p0, p1, TWO_PAGES)
        if EVEN_K:
            amask = r_ok[:, None]
            xmask = m_ok[:, None]
        else:
            amask = r_ok[:, None] & (k0 + offs_k[None, :] < d_in)
            xmask = m_ok[:, None] & (k0 + offs_k[None, :] < d_in)
        a = tl.load(pool_ptr + base[:, None] + offs_k[None, :], mask=amask, other=0.0)
        xt = tl.load(x_rows + k0 + offs_k[None, :], mask=xmask, other=0.0)
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(a))
    ptrs = xa_ptr + (offs_m[:, None] * G + g) * max_rank + offs_r[None, :]
    if split_k == 1:  # a runtime branch: the split is no compile-time variant
        tl.store(ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])
    else:  # partial sums over d_in slices meet in the zeroed xa
        tl.atomic_add(ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["stride_pg", "n_chunks"])
def _mbgmm_expand_kernel(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr,
    tiles_ptr,
    stride_out, P,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank, max_out, n_chunks,
    d0, d1, d2, d3, s0, s1, s2, s3,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, PDL: tl.constexpr,
):
    # The work: (token tile, module, column span) items, the span sized from the step's own
    # tiles (the list's length; a graph's grid is sized for its bucket)
    n_tiles = tl.load(tiles_ptr)  # (the step's metadata: before the wait)
    chunks = _span_chunks(n_tiles * G, max_out, n_chunks)
    n_nt = tl.cdiv(max_out, chunks * BLOCK_N)
    pdl.wait(PDL)
    for w in range(tl.program_id(0), n_tiles * G * n_nt, tl.num_programs(0)):
        i = w // (G * n_nt)
        g = w // n_nt % G
        n_lo = (w % n_nt) * chunks * BLOCK_N
        d_out = _select(g, d0, d1, d2, d3)
        stride = _select(g, s0, s1, s2, s3)
        col = _select(g, 0, d0, d0 + d1, d0 + d1 + d2)
        s = tl.load(tiles_ptr + 1 + 2 * i)
        slot = tl.load(seg_slot_ptr + s)
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rk0 + g * stride_rk1)
        if (slot >= 0) & (rank > 0) & (n_lo < d_out):
            m0 = tl.load(tiles_ptr + 2 + 2 * i)
            m_end = tl.minimum(m0 + BLOCK_M, tl.load(seg_start_ptr + s + 1))
            n_hi = tl.minimum(n_lo + chunks * BLOCK_N, d_out)
            _mbgmm_expand_tile(xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, slot, g, rank,
                               m0, m_end, n_lo, n_hi, d_out, stride, col, stride_out, P,
                               stride_pg, stride_of0, stride_of1, G, max_rank,
                               BLOCK_M, BLOCK_R, BLOCK_N, EVEN_N, DOT_F32, TWO_PAGES)
    pdl.launch_next(PDL)


@triton.jit
def _mbgmm_expand_tile(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, slot, g, rank, m0, m_end, n_lo, n_hi, d_out,
    stride, col, stride_out, P, stride_pg, stride_of0, stride_of1, G, max_rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr,
):
    """Tokens m0..m_end-1 (one tile of a segment on adapter row `slot`), module g, output
    columns n_lo..n_hi-1 of the module's d_out (at column `col` of out), BLOCK_N at a time.
    BLOCK_R covers every rank, so xa's tile and each B row's pages load once, before the loop."""
    off_b = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1).to(tl.int32)
    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < m_end
    r_ok = offs_r < rank
    row_v = off_b + offs_r * stride
    i0, p0, p1 = _row_pages(pages_row, row_v, d_out, r_ok, P, TWO_PAGES)
    w = tl.load(xa_ptr + (offs_m[:, None] * G + g) * max_rank + offs_r[None, :],
                mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    if not DOT_F32:
        w = w.to(pool_ptr.dtype.element_ty)
    out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + col
    for c in range(0, tl.cdiv(n_hi - n_lo, BLOCK_N)):
        n0 = n_lo + c * BLOCK_N  # (a multiple of BLOCK_N the compiler sees: 16-byte accesses)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if EVEN_N:  # n0 < d_out and BLOCK_N = CK: the tile is whole, no column mask
            omask = m_ok[:, None]
            bmask = r_ok[:, None]
        else:
            omask = m_ok[:, None] & (offs_n < d_out)[None, :]
            bmask = r_ok[:, None] & (offs_n < d_out)[None, :]
        o = tl.load(out_rows + offs_n[None, :], mask=omask, other=0.0)  # first: its latency
        # hides behind B's. BLOCK_N divides CHUNK, so each rank row's tile lies in one page.
        base = _chunk_base(pages_row, row_v + n0, r_ok, P, i0, p0, p1, TWO_PAGES)
        b = tl.load(pool_ptr + base[:, None] + tl.arange(0, BLOCK_N)[None, :], mask=bmask,
                    other=0.0)
        if DOT_F32:
            acc = tl.dot(w, b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, b)
        tl.store(out_rows + offs_n[None, :], _add_rounded(o, acc), mask=omask)


def _dot_min(device: torch.device) -> int:
    # The GPU compiler needs every tl.dot dimension >= 16; the interpreter does not, and its
    # cost grows with tile size, so CPU runs use the smallest tiles that cover the data.
    return 16 if device.type == "cuda" else 1


def _mbgmm_cfg(max_rank: int, x: torch.Tensor, shrink: bool) -> dict:
    """Tiles for MBGMM: BLOCK_M tokens (`tile_rows`: the work list's tile) by BLOCK_R ranks,
    64-wide K (shrink) or N (expand). Shrink programs own up to 64 ranks; expand's BLOCK_R
    covers every rank, so each program loads its xa tile once and then walks its columns.
    Measured on the H200 (`bench_kernels.py --tune mbgmm`, q/k/v group, 1 x 256 to 8 x 512
    tokens):
      * shrink with 8 warps (and its d_in split, SHRINK_PROGRAMS) was best at every shape
        (session 8: 126 -> 65 us at 8 x 512 rank 64);
      * expand with 4 warps and 2 stages: its tile compiled to 139 / 224 / 122 registers at
        BLOCK_R 16 / 32 / 64, so ranks below 64 take a 64-rank tile (the padding is masked,
        and costs dot steps, not bytes). Session 13: q/k/v at 4 x 216 tokens rank 64 49.5 ->
        24 us, 8 x 512 185 -> 86 us against one program per 64 columns; rank 16 alone lost
        5-15% (20.8 -> 23.9 us), yet in a batch-128 step with 4 x 216-token prompts the
        expand went 1.31 -> 1.15 ms (rank 16), 1.69 -> 1.20 (32), 2.75 -> 1.30 (64)."""
    block_r = max(_dot_min(x.device), min(64, _pow2(max_rank)) if shrink else _pow2(max_rank))
    if x.device.type != "cuda":
        return dict(BLOCK_M=tile_rows(x.device, x.dtype), BLOCK_R=block_r, num_warps=4,
                    num_stages=1)
    if shrink:
        return dict(BLOCK_M=tile_rows(x.device, x.dtype), BLOCK_R=block_r, num_warps=8,
                    num_stages=3)
    # (the expand's item loop took it from 122 to 136 registers, 3 programs an SM instead of
    # 4; capped at 128 it compiles without spills: `experiments/compile_check.py`)
    return dict(BLOCK_M=tile_rows(x.device, x.dtype), BLOCK_R=max(64, block_r), num_warps=4,
                num_stages=2, maxnreg=128)


def _dot_f32(x: torch.Tensor, pool_l: torch.Tensor) -> bool:
    # Interpreter (CPU tensors): bf16 tl.dot is wrong there, so fp32 operands. GPU fp32: IEEE.
    return x.device.type != "cuda" or pool_l.dtype == torch.float32


def mbgmm_shrink(x: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_a: torch.Tensor, ranks: torch.Tensor, seg_start: torch.Tensor,
                 seg_slot: torch.Tensor, stride: int, max_rank: int,
                 tiles: torch.Tensor | None = None, programs: int | None = None,
                 split_k: int | None = None) -> torch.Tensor:
    """MBGMM shrink (prefill): xa[t, g, :r] = x[t] @ A_g^T for every token t of a segment.

    seg_start int32 [S+1] token offsets, seg_slot int32 [S] (-1 = base-only segment, skipped).
    Returns xa [T, G, max_rank] float32, zero past each rank and outside adapter segments.
    Twin: `reference.lora_shrink` with token_slot expanded from the segments.
    `tiles`: the work list of the adapter segments (`slora.kernels.tiles`, tiles of
    `tile_rows(x.device, x.dtype)` tokens); None builds it here, a host round trip.
    Work: (token tile, module, rank tile, slice of d_in) items. `programs` (default: the
    list's slots) bounds the tiles taken at once. `split_k` fixes the slices of d_in; 0 counts
    them on the device from the step's tiles (`_split_count`); None is 0 on a GPU, 1 on CPU. The
    slices' partial sums are added atomically into xa.
    """
    _check_meta(x, pool_l, pages, offsets_a, ranks)
    T, d_in = x.shape
    G = offsets_a.shape[1]
    S = seg_slot.shape[0]
    assert stride % CHUNK == 0 and stride >= d_in
    assert seg_start.dtype == torch.int32 and seg_start.shape[0] == S + 1
    xa = torch.zeros(T, G, max_rank, dtype=torch.float32, device=x.device)
    if T == 0 or S == 0 or max_rank == 0:
        return xa
    cfg = _mbgmm_cfg(max_rank, x, shrink=True)
    tiles = as_tiles(tiles, seg_start, cfg["BLOCK_M"], keep=seg_slot)
    programs = programs or (tiles.shape[0] - 1) // 2
    if programs == 0:
        return xa
    n_rt = triton.cdiv(max_rank, cfg["BLOCK_R"])
    if x.device.type != "cuda" and split_k is None:
        split_k = 1  # (the interpreter runs programs one by one: no idle ones)
    work = programs * G * n_rt  # items before any split
    # A fixed split: one program an item. Counted on the device: a split only while the items
    # stay within SHRINK_PROGRAMS, so that many programs (or one an unsplit item) cover them.
    grid = work * split_k if split_k else max(work, SHRINK_PROGRAMS.value)
    _mbgmm_shrink_kernel[(grid,)](
        x, pool_l, pages, offsets_a, ranks, seg_start, seg_slot, tiles, xa,
        x.stride(0), d_in, stride, pool_l.shape[1],
        pages.stride(0), offsets_a.stride(0), offsets_a.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, n_rt, split_k or 0, BLOCK_K=CHUNK, EVEN_K=d_in % CHUNK == 0,
        DOT_F32=_dot_f32(x, pool_l), TWO_PAGES=d_in <= pool_l.shape[1],
        **pdl.options(x.device), **cfg)
    return xa


def mbgmm_expand(xa: torch.Tensor, out: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_b: torch.Tensor, ranks: torch.Tensor, seg_start: torch.Tensor,
                 seg_slot: torch.Tensor, out_dims: tuple[int, ...], strides: tuple[int, ...],
                 tiles: torch.Tensor | None = None, programs: int | None = None,
                 n_span: int | None = None) -> None:
    """MBGMM expand (prefill), in place: out[t, cols_g] += xa[t, g, :r] @ B_g^T per segment.

    Same segment metadata and work list as `mbgmm_shrink`; same output layout as
    `mbgmv_expand`. On the GPU the dot runs in B's dtype (xa rounded to it) with fp32
    accumulation; fp32 runs in IEEE precision. Work: (token tile, module, column span) items,
    each span walked 64 columns at a time. `programs` (default: the list's slots) bounds the
    tiles taken at once. `n_span` fixes the span (a multiple of 64); 0 sizes it on the device
    from the step's tiles (`_span_chunks`); None is 0 on a GPU, 64 on CPU.
    """
    _check_meta(out, pool_l, pages, offsets_b, ranks)
    T, G, max_rank = xa.shape
    S = seg_slot.shape[0]
    assert xa.dtype == torch.float32 and xa.is_contiguous()
    assert out.shape == (T, sum(out_dims)) and len(out_dims) == G
    assert seg_start.dtype == torch.int32 and seg_start.shape[0] == S + 1
    if T == 0 or S == 0 or max_rank == 0:
        return
    d, s = _dims4(out_dims, strides)
    cfg = _mbgmm_cfg(max_rank, out, shrink=False)
    tiles = as_tiles(tiles, seg_start, cfg["BLOCK_M"], keep=seg_slot)
    programs = programs or (tiles.shape[0] - 1) // 2
    if programs == 0:
        return
    max_out = max(out_dims)
    if out.device.type != "cuda" and n_span is None:
        n_span = CHUNK  # (the interpreter runs programs one by one: no idle ones)
    assert n_span is None or n_span % CHUNK == 0
    # A fixed span: one program an item. Sized on the device: spans of 512 columns, or below
    # that fewer than 2 x EXPAND_PROGRAMS items, so that many programs cover them.
    grid = (programs * G * triton.cdiv(max_out, n_span) if n_span else
            max(programs * G * triton.cdiv(max_out, SPAN_CHUNKS.value * CHUNK),
                2 * EXPAND_PROGRAMS.value))
    _mbgmm_expand_kernel[(grid,)](
        xa, out, pool_l, pages, offsets_b, ranks, seg_start, seg_slot, tiles,
        out.stride(0), pool_l.shape[1],
        pages.stride(0), offsets_b.stride(0), offsets_b.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, max_out, (n_span or 0) // CHUNK, *d, *s, BLOCK_N=CHUNK,
        EVEN_N=all(x % CHUNK == 0 for x in out_dims), DOT_F32=_dot_f32(out, pool_l),
        TWO_PAGES=max_out <= pool_l.shape[1], **pdl.options(out.device), **cfg)
