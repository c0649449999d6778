"""MBGMM: the prompts' multi-LoRA shrink and expand (Triton), reading adapter weights straight
from the paged pool (`adapter_pages`).

Semantics: exactly `reference.lora_shrink` / `reference.lora_expand` (the torch twins) with
token_slot expanded from segments: seg_start int32 [S+1] holds token offsets, seg_slot int32
[S] the adapter row of each segment's consecutive tokens (-1 = base-only segment). With
`rows` (int32), segment position m stands for token rows[m]: the decode rows grouped by adapter
(`slora.kernels.segments`), so one program reads an adapter's tile once for up to BLOCK_M rows.

Tiling, and why:
  * tl.dot on (BLOCK_M tokens x 64) by (64 x BLOCK_R ranks) tiles (shrink) and (BLOCK_M x
    BLOCK_R) by (BLOCK_R x 64 columns) tiles (expand); 64-wide K or N tiles keep one page per
    rank row. A shrink program loads each A row's (at most two) pages before its loop over its
    slice of d_in; an expand program covers every rank and a span of columns: it loads its xa
    tile once, and each B row's (at most two) pages before its loop over the span. Dot tiles
    are at least 16 in every dimension on the GPU.
  * The programs walk a host-built list of (segment, token tile) work items (`tiles.py`)
    holding only segments with an adapter: no program is launched for a tile without work.
  * The work is sized on the device from the step's own tile count (`_split_count`,
    `_span_chunks`): a graph's launch covers its bucket's worst case, while most steps with
    prompts hold one or two short ones.
  * Under the Triton interpreter (CPU tensors) dot operands are cast to fp32, because bf16
    tl.dot is silently wrong there (triton#11584); on the GPU fp32 dots run in IEEE precision,
    so the fp32 path matches the twin rather than tf32.
  * The shrink's slices add into xa with relaxed atomics: ordered only by the kernel's end,
    they cost a store's time rather than a fence an element.
  * The page-table width (`stride_pg`) and the shrink's split count are exempt from Triton's
    integer specialization: values of a new class met while serving compile no new variant.
    The page size P, fixed for an engine's life, is a compile-time constant (its division and
    remainder become multiplies and shifts).

PDL (`pdl.py`): each kernel reads the step's metadata (slots, ranks, offsets, page ids, work
list) before its wait, and x, xa and out after it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import pdl, tuning
from .adapter_pages import (CHUNK, CK, add_rounded, check_meta, chunk_base, dims4, row_pages,
                            select)
from .tiles import as_tiles, tile_rows
from .tuning import pow2


# The work sized on the device (see the module docstring).
# Shrink: slices of d_in. A short prompt gives few (token tile, module, rank tile) items, each
# streaming all of d_in in turn: latency, not bandwidth. The slices' partial sums meet in xa by
# atomic adds. The split keeps items x slices within this many programs, with at least 4
# chunks a slice.
SHRINK_PROGRAMS = tl.constexpr(384)
# Expand: columns a program, 64 doubled while token tiles x modules x column spans stay at
# least this many, up to 512. A program loads its metadata, xa tile and page lookups once for
# its whole span, so wider spans spread that chain over more columns; the floor keeps enough
# programs to fill the GPU.
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


@triton.jit
def _tokens(rows_ptr, pos, ok, ROWS: tl.constexpr):
    """The token rows (of x, xa and out) at segment positions `pos`: rows[pos] with ROWS (the
    decode rows grouped by adapter, `slora.kernels.segments`), else the positions themselves
    (a prompt's tokens are consecutive)."""
    if ROWS:
        return tl.load(rows_ptr + pos, mask=ok, other=0)
    return pos


@triton.jit(do_not_specialize=["stride_pg", "split_k"])
def _mbgmm_shrink_kernel(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr, tiles_ptr,
    rows_ptr, xa_ptr,
    stride_x, d_in, stride, P: tl.constexpr,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank, n_rt, split_k,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
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
            _mbgmm_shrink_tile(x_ptr, pool_ptr, pages_ptr, offs_ptr, rows_ptr, xa_ptr, slot, g,
                               rank, m0, m_end, r0, k_lo, stride_x, d_in, stride, P, stride_pg,
                               stride_of0, stride_of1, G, max_rank, split, k_split,
                               BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, DOT_F32, TWO_PAGES, ROWS)
    pdl.launch_next(PDL)


@triton.jit
def _mbgmm_shrink_tile(
    x_ptr, pool_ptr, pages_ptr, offs_ptr, rows_ptr, xa_ptr, slot, g, rank, m0, m_end, r0, k_lo,
    stride_x, d_in, stride, P, stride_pg, stride_of0, stride_of1, G, max_rank, split_k, k_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, ROWS: tl.constexpr,
):
    """Segment positions m0..m_end-1 (one tile of a segment on adapter row `slot`), module
    g, ranks r0..r0+BLOCK_R-1, d_in slice k_lo..k_lo+k_split-1."""
    off_a = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1).to(tl.int32)
    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_end
    offs_m = _tokens(rows_ptr, offs_m, m_ok, ROWS)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = offs_r < rank
    row_v = off_a + offs_r * stride
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    # each row's slice lies in two pages at most: their ids once, not a lookup a trip
    i0, p0, p1 = row_pages(pages_row, row_v + k_lo, tl.minimum(k_split, d_in - k_lo), r_ok, P,
                           TWO_PAGES)
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, d_in), BLOCK_K):
        # BLOCK_K is CHUNK, so each row's tile lies in one page
        base = chunk_base(pages_row, row_v + k0, r_ok, P, i0, p0, p1, TWO_PAGES)
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
    else:  # partial sums over d_in slices meet in the zeroed xa. Relaxed: no program reads xa,
        # and the kernel's completion (or the next kernel's PDL wait) orders the sums before
        # any reader; the default acq_rel fences every element's add.
        tl.atomic_add(ptrs, acc, mask=m_ok[:, None] & r_ok[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["stride_pg", "n_chunks"])
def _mbgmm_expand_kernel(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, seg_start_ptr, seg_slot_ptr,
    tiles_ptr, rows_ptr,
    stride_out, P: tl.constexpr,
    stride_pg, stride_of0, stride_of1, stride_rk0, stride_rk1,
    G, max_rank, max_out, n_chunks,
    d0, d1, d2, d3, s0, s1, s2, s3,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
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
        d_out = select(g, d0, d1, d2, d3)
        stride = select(g, s0, s1, s2, s3)
        col = select(g, 0, d0, d0 + d1, d0 + d1 + d2)
        s = tl.load(tiles_ptr + 1 + 2 * i)
        slot = tl.load(seg_slot_ptr + s)
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rk0 + g * stride_rk1)
        if (slot >= 0) & (rank > 0) & (n_lo < d_out):
            m0 = tl.load(tiles_ptr + 2 + 2 * i)
            m_end = tl.minimum(m0 + BLOCK_M, tl.load(seg_start_ptr + s + 1))
            n_hi = tl.minimum(n_lo + chunks * BLOCK_N, d_out)
            _mbgmm_expand_tile(xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, rows_ptr, slot, g,
                               rank, m0, m_end, n_lo, n_hi, d_out, stride, col, stride_out, P,
                               stride_pg, stride_of0, stride_of1, G, max_rank,
                               BLOCK_M, BLOCK_R, BLOCK_N, EVEN_N, DOT_F32, TWO_PAGES, ROWS)
    pdl.launch_next(PDL)


@triton.jit
def _mbgmm_expand_tile(
    xa_ptr, out_ptr, pool_ptr, pages_ptr, offs_ptr, rows_ptr, slot, g, rank, m0, m_end, n_lo,
    n_hi, d_out, stride, col, stride_out, P, stride_pg, stride_of0, stride_of1, G, max_rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, TWO_PAGES: tl.constexpr, ROWS: tl.constexpr,
):
    """Segment positions m0..m_end-1 (one tile of a segment on adapter row `slot`), module g, output
    columns n_lo..n_hi-1 of the module's d_out (at column `col` of out), BLOCK_N at a time.
    BLOCK_R covers every rank, so xa's tile and each B row's pages load once, before the loop."""
    off_b = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1).to(tl.int32)
    pages_row = pages_ptr + slot.to(tl.int64) * stride_pg
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_end
    offs_m = _tokens(rows_ptr, offs_m, m_ok, ROWS)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    row_v = off_b + offs_r * stride
    i0, p0, p1 = row_pages(pages_row, row_v, d_out, r_ok, P, TWO_PAGES)
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
        base = chunk_base(pages_row, row_v + n0, r_ok, P, i0, p0, p1, TWO_PAGES)
        b = tl.load(pool_ptr + base[:, None] + tl.arange(0, BLOCK_N)[None, :], mask=bmask,
                    other=0.0)
        if DOT_F32:
            acc = tl.dot(w, b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, b)
        tl.store(out_rows + offs_n[None, :], add_rounded(o, acc), mask=omask)


def _dot_min(device: torch.device) -> int:
    # The GPU compiler needs every tl.dot dimension >= 16; the interpreter does not, and its
    # cost grows with tile size, so CPU runs use the smallest tiles that cover the data.
    return 16 if device.type == "cuda" else 1


def _mbgmm_cfg(max_rank: int, x: torch.Tensor, shrink: bool, block_m: int | None = None) -> dict:
    """Tiles for MBGMM: BLOCK_M tokens (`tile_rows`: the work list's tile) by BLOCK_R ranks,
    64-wide K (shrink) or N (expand); table entries `mbgmm_shrink` / `mbgmm_expand` (no
    quantities: one rule each). Shrink: BLOCK_R the rank's power of two, at most the table's
    BLOCK_R. Expand: BLOCK_R covers every rank (each program loads its xa tile once, then
    walks its columns), at least the table's BLOCK_R: where smaller rank tiles compile to more
    registers (fewer programs an SM), small ranks take the larger tile, whose padding is
    masked (it costs dot steps, not bytes). Both at least `_dot_min`. The expand's `maxnreg`
    caps its registers where the cap compiles without spills (`experiments/compile_check.py`).
    `block_m` replaces the work list's tile (the decode rows' segments have their own)."""
    return dict(_cfg(tuning.kind(x.device), _dot_min(x.device), max_rank,
                     block_m or tile_rows(x.device, x.dtype), shrink))


@functools.lru_cache(maxsize=1024)
def _cfg(table: str, dot_min: int, max_rank: int, block_m: int, shrink: bool) -> dict:
    cfg = tuning.choose(table, "mbgmm_shrink" if shrink else "mbgmm_expand")
    if shrink:
        block_r = max(dot_min, min(cfg["BLOCK_R"], pow2(max_rank)))
    else:
        block_r = max(dot_min, cfg["BLOCK_R"], pow2(max_rank))
    return dict(cfg, BLOCK_M=block_m, BLOCK_R=block_r)


def _dot_f32(x: torch.Tensor, pool_l: torch.Tensor) -> bool:
    # Interpreter (CPU tensors): bf16 tl.dot is wrong there, so fp32 operands. GPU fp32: IEEE.
    return x.device.type != "cuda" or pool_l.dtype == torch.float32


def mbgmm_shrink(x: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_a: torch.Tensor, ranks: torch.Tensor, seg_start: torch.Tensor,
                 seg_slot: torch.Tensor, stride: int, max_rank: int,
                 tiles: torch.Tensor | None = None, programs: int | None = None,
                 split_k: int | None = None, rows: torch.Tensor | None = None,
                 block_m: int | None = None, xa: torch.Tensor | None = None) -> torch.Tensor:
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
    `rows` int32: segment position m stands for token rows[m] (of x, xa and out alike), so
    segments need not be runs of consecutive tokens: the decode rows grouped by adapter
    (`slora.kernels.segments`), in tiles of `block_m` positions (default: `tile_rows`). The
    twin is then `reference.lora_shrink` with `reference.segments_token_slot`'s token_slot.
    `xa`: the [T, G, max_rank] fp32 buffer to fill (zero on the segments' rows; its other rows
    are kept, MBGMV's beside the decode rows' groups), instead of a new zeroed one.
    """
    check_meta(x, pool_l, pages, offsets_a, ranks)
    T, d_in = x.shape
    G = offsets_a.shape[1]
    S = seg_slot.shape[0]
    assert stride % CHUNK == 0 and stride >= d_in
    assert seg_start.dtype == torch.int32 and seg_start.shape[0] == S + 1
    if xa is None:
        xa = torch.zeros(T, G, max_rank, dtype=torch.float32, device=x.device)
    assert xa.shape == (T, G, max_rank) and xa.dtype == torch.float32 and xa.is_contiguous()
    if T == 0 or S == 0 or max_rank == 0:
        return xa
    cfg = _mbgmm_cfg(max_rank, x, shrink=True, block_m=block_m)
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
        x, pool_l, pages, offsets_a, ranks, seg_start, seg_slot, tiles,
        seg_start if rows is None else rows, xa,
        x.stride(0), d_in, stride, pool_l.shape[1],
        pages.stride(0), offsets_a.stride(0), offsets_a.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, n_rt, split_k or 0, BLOCK_K=CHUNK, EVEN_K=d_in % CHUNK == 0,
        DOT_F32=_dot_f32(x, pool_l), TWO_PAGES=d_in <= pool_l.shape[1], ROWS=rows is not None,
        **pdl.options(x.device), **cfg)
    return xa


def mbgmm_expand(xa: torch.Tensor, out: torch.Tensor, pool_l: torch.Tensor, pages: torch.Tensor,
                 offsets_b: torch.Tensor, ranks: torch.Tensor, seg_start: torch.Tensor,
                 seg_slot: torch.Tensor, out_dims: tuple[int, ...], strides: tuple[int, ...],
                 tiles: torch.Tensor | None = None, programs: int | None = None,
                 n_span: int | None = None, rows: torch.Tensor | None = None,
                 block_m: int | None = None) -> None:
    """MBGMM expand (prefill), in place: out[t, cols_g] += xa[t, g, :r] @ B_g^T per segment.

    Same segment metadata and work list as `mbgmm_shrink`; same output layout as
    `mbgmv_expand`. On the GPU the dot runs in B's dtype (xa rounded to it) with fp32
    accumulation; fp32 runs in IEEE precision. Work: (token tile, module, column span) items,
    each span walked 64 columns at a time. `programs` (default: the list's slots) bounds the
    tiles taken at once. `n_span` fixes the span (a multiple of 64); 0 sizes it on the device
    from the step's tiles (`_span_chunks`); None is 0 on a GPU, 64 on CPU. `rows`, `block_m`:
    as in `mbgmm_shrink`.
    """
    check_meta(out, pool_l, pages, offsets_b, ranks)
    T, G, max_rank = xa.shape
    S = seg_slot.shape[0]
    assert xa.dtype == torch.float32 and xa.is_contiguous()
    assert out.shape == (T, sum(out_dims)) and len(out_dims) == G
    assert seg_start.dtype == torch.int32 and seg_start.shape[0] == S + 1
    if T == 0 or S == 0 or max_rank == 0:
        return
    d, s = dims4(out_dims, strides)
    cfg = _mbgmm_cfg(max_rank, out, shrink=False, block_m=block_m)
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
        seg_start if rows is None else rows, out.stride(0), pool_l.shape[1],
        pages.stride(0), offsets_b.stride(0), offsets_b.stride(1), ranks.stride(0), ranks.stride(1),
        G, max_rank, max_out, (n_span or 0) // CHUNK, *d, *s, BLOCK_N=CHUNK,
        EVEN_N=all(x % CHUNK == 0 for x in out_dims), DOT_F32=_dot_f32(out, pool_l),
        TWO_PAGES=max_out <= pool_l.shape[1], ROWS=rows is not None, **pdl.options(out.device),
        **cfg)
