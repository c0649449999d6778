"""A decode step's base-model GEMMs with few rows (Triton): out = x @ W^T (+ bias).

Twin: `torch.nn.functional.linear` (what `TorchBackend.linear` runs).

At decode batch sizes a base GEMM is a weight stream: each of W's bytes is read once and used
for a handful of rows, so its speed is the fraction of copy bandwidth it reaches. Each program
here owns BLOCK_N output features (rows of W) over one slice of K, with every row of x in the
tile: [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M] steps, W's side the wide one, x padded to 16
rows at least. Where N / BLOCK_N tiles leave SMs idle (o and down of a 7B: 64 tiles on 132
SMs) K is cut in slices; each slice writes its fp32 partial, and the last slice of a tile to
finish (an atomic count per tile) sums them in slice order and writes the output. One launch,
no separate reduce kernel (cuBLAS runs split-K as a GEMM and a reduce).

With a `LoraExpand`, the epilogue also adds each row's LoRA delta (its own adapter's B over
the tile's 64 columns, read from the pool pages as `lora.mbgmv_expand` reads them, rounded and
added as it adds them): the expand's launch folded into the GEMM's. The engine takes it at
`LORA_MIN_ROWS` rows or more with `EngineConfig.lora_in_gemm` (off by default since session 14;
`bench_kernels.py --gemm-lora` times both forms).

`linear` takes this path for at most `max_rows` rows (`EngineConfig.gemm_max_rows`) of a
16-bit x on CUDA and calls F.linear otherwise. H200, Llama-2-7B shapes, 32 rows, per layer
(session 9, call 4): q/k/v 30.3 us against cuBLAS's 31.5, o 13.9 / 15.0, gate/up 49.5 / 53.1,
down 30.0 / 30.4; at 64 rows cuBLAS won.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl
from .lora import _b_rows, _dims4, _select


@triton.jit
def _lora_rows(n0, offs_m, m_ok, offs_ptr, ranks_ptr, slot_ptr, stride_of0, stride_of1,
               stride_rk0, stride_rk1, d0, d1, d2):
    """The module g whose columns hold the tile's 64 from n0 (each module a multiple of 64
    wide), and each row's adapter slot, rank and B offset in g: loaded before the K loop, so
    the epilogue's chain starts at the page ids."""
    g = (n0 >= d0).to(tl.int32) + (n0 >= d0 + d1).to(tl.int32) + (n0 >= d0 + d1 + d2).to(tl.int32)
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1)
    has = slot >= 0
    rank = tl.load(ranks_ptr + slot * stride_rk0 + g * stride_rk1, mask=has, other=0)
    off_b = tl.load(offs_ptr + slot * stride_of0 + g * stride_of1, mask=has, other=0).to(tl.int32)
    return g, slot, rank, off_b


@triton.jit
def _lora_delta(n0, g, slot, rank, off_b, offs_m, xa_ptr, pool_ptr, pages_ptr, P, stride_pg,
                G, max_rank, d0, d1, d2, s0, s1, s2, s3, BLOCK_M: tl.constexpr,
                R: tl.constexpr):
    """fp32 [BLOCK_M, 64]: each row's LoRA delta xa[m, g, :r] @ B_g^T[:, cols] (its own
    adapter's B, `lora.mbgmv_expand`'s product and loads: `lora._b_rows` with a row per token)
    for the 64 output columns from n0; rows without an adapter give 0."""
    nc = n0 - _select(g, 0, d0, d0 + d1, d0 + d1 + d2)  # the tile's first column in module g
    stride = _select(g, s0, s1, s2, s3)
    pages_row = (pages_ptr + slot.to(tl.int64) * stride_pg)[:, None, None]
    delta = tl.zeros((BLOCK_M, 64), tl.float32)
    for r0 in range(0, max_rank, R):
        rows = r0 + tl.arange(0, R)
        # [M, R, 64]; the tile lies inside module g, so d_out = nc + 64 masks no column
        b = _b_rows(pool_ptr, pages_row, off_b[:, None, None], rows[None, :, None],
                    rank[:, None, None], nc, nc + 64, stride, P, True)
        a = tl.load(xa_ptr + (offs_m[:, None] * G + g) * max_rank + rows[None, :],
                    mask=rows[None, :] < rank[:, None], other=0.0)
        delta += tl.sum(b * a[:, :, None], axis=1)
    return delta


@triton.jit(do_not_specialize=["split"])
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_split,
                   split, stride_x, stride_w, stride_out, stride_part,
                   xa_ptr, pool_ptr, pages_ptr, offs_ptr, ranks_ptr, slot_ptr, P, stride_pg,
                   stride_of0, stride_of1, stride_rk0, stride_rk1, G, max_rank,
                   d0, d1, d2, s0, s1, s2, s3,
                   SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_F32: tl.constexpr, LORA: tl.constexpr, LORA_R: tl.constexpr,
                   PDL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    s = tl.program_id(1)  # which K slice
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    # The hint keeps the slices' loads 16-byte cp.async, pipelined: without it (k_split is a
    # multiple of BLOCK_K, but s * k_split has no known divisor) the PTX had neither, and
    # every tile ran 1.3-2x slower on the H200 (session 9, call 3).
    k_lo = tl.multiple_of(s * k_split, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + (k_lo + offs_k)[:, None]  # x^T
    if LORA:  # (the step's metadata, which no kernel writes, before the wait)
        g, slot, rank, off_b = _lora_rows(tile * BLOCK_N, offs_m, m_ok, offs_ptr, ranks_ptr,
                                          slot_ptr, stride_of0, stride_of1, stride_rk0,
                                          stride_rk1, d0, d1, d2)
    pdl.wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl.launch_next(PDL)
    if SPLIT_K:
        # Each slice leaves its partial tile in `part`; the last to finish adds them up in
        # slice order (the same sum whichever finishes last) and resets the tile's counter
        # for the next launch (or graph replay).
        cell = offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(part_ptr + s * stride_part + cell, acc)
        tl.debug_barrier()  # every thread's partial written before the count is
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done != split - 1:
            return
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i in range(split):
            acc += tl.load(part_ptr + i * stride_part + cell, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = acc.to(out_ptr.dtype.element_ty)
    if LORA:  # + the LoRA delta, rounded and added as lora.mbgmv_expand adds it to this out
        delta = _lora_delta(tile * BLOCK_N, g, slot, rank, off_b, offs_m, xa_ptr, pool_ptr,
                            pages_ptr, P, stride_pg, G, max_rank, d0, d1, d2, s0, s1, s2, s3,
                            BLOCK_M, LORA_R)
        out = (out.to(tl.float32) + tl.trans(delta.to(out.dtype)).to(tl.float32)).to(out.dtype)
    ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
    tl.store(ptrs, out, mask=n_ok[:, None] & m_ok[None, :])


# The fewest rows at which `EngineConfig.lora_in_gemm` takes the epilogue: on the H200 (session
# 11, call 1; GEMM + rank-16 expand, two launches against one) it won at 32 rows for every
# 7B shape (q/k/v 37.5 -> 36.2 us, o 19.2 -> 18.6, gate/up 61.3 -> 56.9, down 35.5 -> 34.6),
# tied at 1 row (within 0.4 us) and was mixed at 16 (o +0.9, gate/up -0.6); a decode step at
# batch 16 with q/k/v/o went 5.55 -> 5.59 ms with it, at batch 32 with all seven 7.19 -> 7.01.
LORA_MIN_ROWS = 17
MAX_TILES = 4096  # output tiles a split launch may count (a 7B's widest: 32,000 / 64 = 500)
_COUNTS: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device) -> torch.Tensor:
    """The split launches' tile counters on `device`, allocated on first call (zeros; each
    launch leaves them zero). Call before capturing a CUDA graph: an allocation inside a
    capture would be the graph's own memory. `make_backend` calls it. One set per device, so
    split launches must not overlap (the engine runs its GEMMs on one stream)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("slora.kernels.gemm: call prepare(device) before capturing a "
                               "CUDA graph (its tile counters must outlive the graph)")
        _COUNTS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTS[device]


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def skinny_cfg(M: int, N: int, K: int, device: torch.device) -> dict:
    """Tiles measured on the H200 (`bench_kernels.py --tune gemm`, session 9 call 4: a 7B's
    four decode GEMMs at 1, 16, 32 and 64 rows over 48 tile settings): 64 rows of W by 128
    columns a step with 4 warps was best or within 2% of best at 1-32 rows for every shape,
    with K cut so that tiles x slices reach about one program per SM (o and down: 64 tiles, 2
    slices), 3 stages without a split (gate_up: 48.3 against 50.8 us with 4) and 4 with one."""
    pow2 = triton.next_power_of_2
    if device.type != "cuda":  # interpreter: few, large programs
        return dict(BLOCK_M=pow2(M), BLOCK_N=min(64, pow2(N)), BLOCK_K=min(128, pow2(K)), SPLIT=1)
    block_n, block_k = 64, 128
    index = device.index if device.index is not None else torch.cuda.current_device()
    split = max(1, min(_sms(index) // triton.cdiv(N, block_n), triton.cdiv(K, block_k)))
    return dict(BLOCK_M=max(16, pow2(M)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                num_warps=4, num_stages=3 if split == 1 else 4)


@dataclass(frozen=True)
class LoraExpand:
    """`lora.mbgmv_expand`'s arguments but `out`, for `skinny_linear` to add each row's LoRA
    delta in its epilogue (one launch for the base GEMM and the expand; twin: F.linear, then
    `reference.lora_expand`). Every module's out_dim must be a multiple of 64 (one module a
    64-column tile)."""

    xa: torch.Tensor  # fp32 [M, G, max_rank], the shrink's output
    pool_l: torch.Tensor
    pages: torch.Tensor
    offsets_b: torch.Tensor
    ranks: torch.Tensor
    token_slot: torch.Tensor
    out_dims: tuple[int, ...]
    strides: tuple[int, ...]


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: dict | None = None, lora: LoraExpand | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, by the
    Triton kernel whatever M (see `linear` for when the engine uses it). `cfg` overrides the
    tiles (the benchmark's sweep). `lora` (optional) adds each row's LoRA delta in the same
    launch, as `lora.mbgmv_expand` would after it (`EngineConfig.lora_in_gemm`)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape == (N, K) and w.stride(1) == 1 and x.stride(1) == 1, \
        "x and w: unit column stride"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = dict(cfg or skinny_cfg(M, N, K, x.device))
    if cfg["BLOCK_M"] < M:
        raise ValueError(f"skinny_linear: {M} rows do not fit BLOCK_M={cfg['BLOCK_M']}")
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    # K slices of whole BLOCK_K steps; `split` is the number of them that hold any K
    split = cfg.pop("SPLIT")
    k_split = triton.cdiv(triton.cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(K, k_split)
    part = count = out
    if split > 1:
        if tiles > MAX_TILES:
            raise ValueError(f"skinny_linear: {tiles} output tiles, more than "
                             f"MAX_TILES={MAX_TILES}")
        count = prepare(x.device)
        part = torch.empty(split, tiles * cfg["BLOCK_N"], cfg["BLOCK_M"], dtype=torch.float32,
                           device=x.device)
    dot_f32 = x.device.type != "cuda" or x.dtype == torch.float32
    if lora is not None:
        lo = lora
        G, max_rank = lo.xa.shape[1], lo.xa.shape[2]
        assert lo.xa.shape[0] == M and lo.xa.dtype == torch.float32 and lo.xa.is_contiguous()
        assert sum(lo.out_dims) == N and cfg["BLOCK_N"] == 64
        assert all(d % 64 == 0 for d in lo.out_dims)  # (a 64-column tile in one module)
        dims, strides = _dims4(lo.out_dims, lo.strides)
        lora_args = (lo.xa, lo.pool_l, lo.pages, lo.offsets_b, lo.ranks, lo.token_slot,
                     lo.pool_l.shape[1], lo.pages.stride(0), lo.offsets_b.stride(0),
                     lo.offsets_b.stride(1), lo.ranks.stride(0), lo.ranks.stride(1), G, max_rank,
                     *dims[:3], *strides)
        lora_r = min(4, triton.next_power_of_2(max(1, max_rank)))
    else:
        lora_args = (out,) * 6 + (0,) * 15
        lora_r = 1
    _skinny_kernel[(tiles, split)](
        x, w, bias if bias is not None else w, out, part, count, M, N, K, k_split, split,
        x.stride(0), w.stride(0), out.stride(0), tiles * cfg["BLOCK_N"] * cfg["BLOCK_M"],
        *lora_args,
        SPLIT_K=split > 1, HAS_BIAS=bias is not None, EVEN_K=K % cfg["BLOCK_K"] == 0,
        DOT_F32=dot_f32, LORA=lora is not None, LORA_R=lora_r,
        **pdl.options(x.device), **cfg)
    return out


def uses_kernel(x: torch.Tensor, w: torch.Tensor, max_rows: int) -> bool:
    """Whether `linear` runs x @ w^T through the Triton kernel: at most `max_rows` rows of a
    16-bit x on CUDA (`EngineConfig.gemm_max_rows`, whose note says why 32)."""
    return (x.is_cuda and 0 < x.shape[0] <= max_rows
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and w.stride(-1) == 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           max_rows: int) -> torch.Tensor:
    """F.linear, through the Triton kernel for a decode step's few rows (`uses_kernel`)."""
    if uses_kernel(x, w, max_rows):
        return skinny_linear(x, w, bias)
    return F.linear(x, w, bias)
