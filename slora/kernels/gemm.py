"""A decode step's base-model GEMMs with few rows (Triton): out = x @ W^T (+ bias).

Twin: `torch.nn.functional.linear` (what `TorchBackend.linear` runs); for FP8 weights
(`slora.model.quant.Fp8Weight`: W = weight * scale[:, None]), `quant.linear`.

At decode batch sizes a base GEMM is a weight stream: each of W's bytes is read once and used
for a handful of rows, so its speed is the fraction of copy bandwidth it reaches. Each program
here owns BLOCK_N output features (rows of W) over one slice of K, with every row of x in the
tile: [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M] steps, W's side the wide one, x padded to 16
rows at least. Where N / BLOCK_N tiles leave SMs idle (o and down of a 7B: 64 tiles on 132
SMs) K is cut in slices; each slice writes its fp32 partial, and the last slice of a tile to
finish (an atomic count per tile) sums them in slice order and writes the output. One launch,
no separate reduce kernel (cuBLAS runs split-K as a GEMM and a reduce).

`linear` takes this path for at most `max_rows` rows (`EngineConfig.gemm_max_rows`) of a
16-bit x on CUDA and calls F.linear otherwise: up to that many rows the weight stream here
beats cuBLAS's tiles, past it cuBLAS wins.

FP8 weights (`skinny_linear(..., scale=...)`): the same kernel loads W's E4M3 tiles (half the
bytes), converts them in registers to x's dtype (exact: every E4M3 value is a bf16 and an fp16
value), accumulates in fp32 and multiplies each output feature by its scale once, after the K
sum: no dequantized copy of W exists in memory. With an FP8 x too (`x_scale=`: x quantized per
row, W8A8) neither tile is converted: both go to the FP8 tensor cores as loaded, and each row's
scale multiplies its sums beside the features'. `slora.kernels.fp8` dispatches to it (W8A8).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl, tuning
from .tuning import pow2


@triton.jit
def _unpack_fp8(q, WT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The E4M3 weights of the 32-bit words q [BLOCK_N, BLOCK_K // 4] (4 a word, little-endian)
    as a [BLOCK_N, BLOCK_K] tile in WT (bf16 or fp16), exact for every finite value, by bit
    operations instead of conversion instructions. Each E4M3 byte's sign goes to bit 15 and
    its exponent and mantissa bits just below it: the WT value of those bits is the weight
    times 2^-(WT's exponent bias - 7), for zeros, subnormals and normals alike, undone by one
    multiply. Bytes 0 and 2 of a word fill the two 16-bit halves of one word together (1 and 3
    another), so the tile's K order within each word is "pair order": bytes 0, 2, 1, 3
    (`_pair_order` puts x's K in the same order)."""
    MANT: tl.constexpr = 7 if WT == tl.bfloat16 else 10  # WT's mantissa bits (E4M3's: 3)
    BIAS: tl.constexpr = 2.0 ** 120 if WT == tl.bfloat16 else 2.0 ** 8
    e02 = ((q & 0x00800080) << 8) | ((q & 0x007F007F) << (MANT - 3))
    e13 = (q & 0x80008000) | ((q & 0x7F007F00) >> (11 - MANT))
    bias = tl.full((1, 1), BIAS, tl.float32).to(WT)  # (exact: a power of two)
    w0 = e02.to(tl.uint16).to(WT, bitcast=True) * bias
    w1 = e13.to(tl.uint16).to(WT, bitcast=True) * bias
    w2 = (e02 >> 16).to(tl.uint16).to(WT, bitcast=True) * bias
    w3 = (e13 >> 16).to(tl.uint16).to(WT, bitcast=True) * bias
    # [n, i, c, a] = byte c + 2a of word i: the halves of e02 (then e13) side by side
    return tl.reshape(tl.join(tl.join(w0, w1), tl.join(w2, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _pair_order(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] transposed to [BLOCK_K, BLOCK_M] with each four K positions in
    `_unpack_fp8`'s pair order (0, 2, 1, 3)."""
    x4 = tl.reshape(x, (BLOCK_M, BLOCK_K // 4, 2, 2))  # [m, i, a, c] = x[m, 4i + 2a + c]
    return tl.trans(tl.reshape(tl.permute(x4, (0, 1, 3, 2)), (BLOCK_M, BLOCK_K)))


@triton.jit
def _dot(acc, w, xt, DOT_F32: tl.constexpr):
    if DOT_F32:
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(w.to(xt.dtype), xt)


@triton.jit(do_not_specialize=["split"])
def _skinny_kernel(x_ptr, w_ptr, scale_ptr, x_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                   M, N, K,
                   k_split, split, stride_x, stride_w, stride_out, stride_part,
                   SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_F32: tl.constexpr, PDL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UNPACK: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    # An FP8 W (float8_e4m3fn) comes with its scales: W = w * scale[:, None]. The pointer's
    # type decides at compile time; scale_ptr is unused otherwise. UNPACK (FP8 W, K and
    # stride_w multiples of 4): W read as 32-bit words, in 16-byte loads, and unpacked by bit
    # operations (`_unpack_fp8`); otherwise its E4M3 tile is converted by cvt instructions.
    # An FP8 x (W8A8) comes with its row scales, x = x * x_scale[:, None], and meets the FP8
    # W tile in the FP8 tensor cores as it is: no conversion on either side.
    W_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    X_FP8: tl.constexpr = x_ptr.dtype.element_ty == tl.float8e4nv
    WORDS: tl.constexpr = W_FP8 and UNPACK and not X_FP8
    # the 16-bit type FP8 weights unpack to: x's, or fp16 (exact) under an fp32 x
    WT: tl.constexpr = x_ptr.dtype.element_ty if x_ptr.dtype.element_ty != tl.float32 \
        else tl.float16
    tile = tl.program_id(0)
    s = tl.program_id(1)  # which K slice
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_q = tl.arange(0, BLOCK_K // 4)  # (WORDS) 32-bit words of a W row's BLOCK_K bytes
    n_ok = offs_n < N
    m_ok = offs_m < M
    # The hint keeps the slices' loads 16-byte cp.async, pipelined: k_split is a multiple of
    # BLOCK_K, but the compiler cannot see a divisor of s * k_split, and without the hint it
    # emits neither vector loads nor the pipeline.
    k_lo = tl.multiple_of(s * k_split, BLOCK_K)
    if WORDS:
        w_ptrs = (w_ptr.to(tl.pointer_type(tl.uint32)) + offs_n.to(tl.int64)[:, None]
                  * (stride_w // 4) + (k_lo // 4 + offs_q)[None, :])
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + (k_lo + offs_k)[None, :]
    elif X_FP8:  # x's tile as [BLOCK_M, BLOCK_K], K-major, as the FP8 tensor cores take it
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + (k_lo + offs_k)[None, :]
    else:
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + (k_lo + offs_k)[:, None]  # x^T
    if PDL and PREFETCH > 0:  # this slice's first PREFETCH bytes a W row (rows past N: row 0's)
        nbytes = tl.minimum(k_split, K - k_lo) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        lines = tl.arange(0, PREFETCH // 128) * 128
        wrow = w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64) * stride_w + k_lo
        pdl.prefetch(wrow.to(tl.pointer_type(tl.uint8))[:, None]
                     + tl.where(lines < nbytes, lines, 0)[None, :], PDL)
    pdl.wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        if WORDS:
            if EVEN_K:
                q = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                q = tl.load(w_ptrs, mask=n_ok[:, None] & (k0 + 4 * offs_q < K)[None, :], other=0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            acc = _dot(acc, _unpack_fp8(q, WT, BLOCK_N, BLOCK_K),
                       _pair_order(x, BLOCK_M, BLOCK_K), DOT_F32)
            w_ptrs += BLOCK_K // 4
        elif X_FP8:
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                k_ok = k0 + offs_k < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(acc, w, tl.trans(x), DOT_F32)
            w_ptrs += BLOCK_K
        else:
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = k0 + offs_k < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            acc = _dot(acc, w, xt, DOT_F32)  # an FP8 tile converted to x's dtype in registers
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
    if W_FP8:  # each output feature's sum times its scale
        acc *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if X_FP8:  # and each row's by its own
        acc *= tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = acc.to(out_ptr.dtype.element_ty)
    ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
    tl.store(ptrs, out, mask=n_ok[:, None] & m_ok[None, :])


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


def skinny_cfg(M: int, N: int, K: int, device: torch.device, w_bytes: int = 2) -> dict:
    """The kernel's tiles: table entry `gemm`, by `split` (the K slices the rule's tile gives)
    and `w_bytes` (bytes of one element of W: 1 for FP8, so a table may give FP8 its own rule).
    BLOCK_M holds every row of x (a power of two, at least 16 on the GPU, where tl.dot needs
    it). K is cut so that output tiles x slices reach about the rule's `programs_per_sm` (1
    unless it says) programs per SM: SPLIT slices (`k_slices`), each a whole number of BLOCK_K
    steps. A rule's `PREFETCH` (bytes, a multiple of 128; 0 when it gives none) has each
    program ask L2 for that many bytes of each of its W rows before its PDL wait
    (`pdl.prefetch`), so the stream starts while the kernel before still runs. The
    interpreter's tiles shrink to the data (its cost grows with a tile's elements); a GPU's
    stay as the table gives them."""
    return dict(_skinny_cfg(tuning.kind(device), device.type == "cuda", tuning.sms(device), M, N,
                            K, w_bytes))


@functools.lru_cache(maxsize=4096)
def _skinny_cfg(table: str, cuda: bool, n_sm: int, M: int, N: int, K: int,
                w_bytes: int = 2) -> dict:
    def fit(cfg):
        if not cuda:
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], pow2(N))
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], pow2(K))
        return cfg

    def split(cfg):
        return k_slices(N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], n_sm * cfg.get("programs_per_sm", 1))

    cfg = tuning.choose(table, "gemm", fit, split=split, w_bytes=w_bytes)
    slices = split(cfg)
    cfg.pop("programs_per_sm", None)  # (the launch's grid, not a kernel argument)
    return dict(cfg, BLOCK_M=max(16 if cuda else 1, pow2(M)), SPLIT=slices)


def k_slices(N: int, K: int, block_n: int, block_k: int, programs: int) -> int:
    """The K slices that bring N / block_n output tiles to about `programs` programs: at least
    one, at most one BLOCK_K step each."""
    return max(1, min(programs // triton.cdiv(N, block_n), triton.cdiv(K, block_k)))


def words(w: torch.Tensor) -> bool:
    """Whether the kernel may read an FP8 w [N, K] as 32-bit words (`UNPACK`): K, its row
    stride and its address all multiples of 4 bytes."""
    return (w.dtype == torch.float8_e4m3fn and w.shape[1] % 4 == 0 and w.stride(0) % 4 == 0
            and w.data_ptr() % 4 == 0)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: dict | None = None, scale: torch.Tensor | None = None,
                  x_scale: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, by the
    Triton kernel whatever M (see `linear` for when the engine uses it). `cfg` overrides the
    tiles (the benchmark's sweep; its `UNPACK` holds only where `words(w)`). `scale` [N]
    float32: w is an FP8 weight (float8_e4m3fn) standing for w * scale[:, None], read as is.
    `x_scale` [M, 1] float32: x is FP8 too, standing for x * x_scale (`fp8.quantize_rows`),
    the product then in `out_dtype` (W8A8: both tiles straight into the FP8 tensor cores)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape == (N, K) and w.stride(1) == 1 and x.stride(1) == 1, \
        "x and w: unit column stride"
    assert (scale is None) == (w.dtype != torch.float8_e4m3fn), "an FP8 w comes with its scale"
    assert scale is None or (scale.shape == (N,) and scale.dtype == torch.float32
                             and scale.stride(0) == 1)
    assert (x_scale is None) == (x.dtype != torch.float8_e4m3fn), "an FP8 x comes with its scale"
    assert x_scale is None or (scale is not None and out_dtype is not None
                               and x_scale.dtype == torch.float32 and x_scale.numel() == M)
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = dict(cfg or skinny_cfg(M, N, K, x.device, w.element_size()))
    cfg["UNPACK"] = bool(cfg.get("UNPACK")) and words(w) and x_scale is None
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
    _skinny_kernel[(tiles, split)](
        x, w, scale if scale is not None else out, x_scale if x_scale is not None else out,
        bias if bias is not None else w, out, part,
        count, M, N, K, k_split, split,
        x.stride(0), w.stride(0), out.stride(0), tiles * cfg["BLOCK_N"] * cfg["BLOCK_M"],
        SPLIT_K=split > 1, HAS_BIAS=bias is not None, EVEN_K=K % cfg["BLOCK_K"] == 0,
        DOT_F32=dot_f32, **pdl.options(x.device), **cfg)
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
