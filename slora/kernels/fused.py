"""Fused elementwise kernels (Triton): a decode step is hundreds of tiny launches, and each
costs a few microseconds however little it does; these fold the chains into one launch each.

- `add_rms_norm`: residual add + RMSNorm (7 launches -> 1), twin `reference.add_rms_norm`.
- `rms_norm`: the same without the add, twin `reference.rms_norm`.
- `qk_norm`: the RMSNorms of q and k inside the fused qkv output, in place (a chain of small
  torch ops -> 1 launch), twin `reference.qk_norm`. A decode step whose heads share one
  weight norms them inside decode attention instead (`attention.rope_paged_decode_attention`).
- `rope_write_kv`: rotary on q and k of the fused qkv output (cos/sin computed in the kernel
  from positions) + K/V store into their pool pages (about 16 launches -> 1), twin
  `reference.rope_write_kv`. q is rotated in place inside qkv and returned as a view.
- `silu_mul`: SwiGLU over [gate | up] (2 launches -> 1), twin `reference.silu_mul`;
  `gelu_tanh_mul`: GeGLU with gelu's tanh approximation (Gemma), twin `reference.gelu_tanh_mul`.

`add_rms_norm` and the GLUs take `lora`, their input's LoRA rows not yet added (a decode step
expands them beside the base GEMM, on a side stream: `backend.Pending`): they add them as the
expand would have, so the result is the same as from a finished input.

The norms and the GLUs take `feeds`, the weight of the GEMM their output goes to: where that
GEMM rounds its input to E4M3 per row (an FP8 weight, `fp8.quantizes`), they write the rounding
too and return a `quant.Fp8Rows`, so the GEMM needs no quantization launch (twin: the output,
then `fp8.quantize_rows_ref`).

Numerics follow the twins: statistics in float32, results rounded to the input dtype where
HF rounds (the residual sum, the normalised value before the weight, cos/sin).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from slora.model.quant import Fp8Rows

from . import fp8, pdl, tuning
from .tuning import pow2


@triton.jit
def with_lora(v, lora_ptrs, mask):
    """v (a linear layer's output) plus its LoRA rows at `lora_ptrs`, which an expand added
    into zeros, each element rounded to v's dtype: the sum, rounded, is what the expand would
    have stored into v itself (`adapter_pages.add_rounded`)."""
    lora = tl.load(lora_ptrs, mask=mask, other=0.0)
    return (v.to(tl.float32) + lora.to(tl.float32)).to(v.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, l_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, s_ptr, N, eps,
                     stride_x, stride_d, stride_l, HAS_DELTA: tl.constexpr,
                     HAS_LORA: tl.constexpr, CENTER: tl.constexpr, QUANT: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + offs, mask=m, other=0.0)
        if HAS_LORA:  # delta's own LoRA rows, added as the expand adds them (`with_lora`)
            d = with_lora(d, l_ptr + row * stride_l + offs, m)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + offs, x, mask=m)
    xf = x.to(tl.float32)
    if CENTER:  # a LayerNorm without bias: the row's mean off first (padding stays 0)
        xf = tl.where(m, xf - tl.sum(xf, axis=0) / N, 0.0)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(x_ptr.dtype.element_ty)  # w may be fp32
    tl.store(out_ptr + row * N + offs, out, mask=m)
    if QUANT:  # the row's E4M3 rounding as `fp8.quantize_rows` gives it (padding is 0)
        v = out.to(tl.float32)
        scale = fp8.row_scale(tl.max(tl.abs(v), axis=0), FP8_MAX, MIN_AMAX)
        tl.store(s_ptr + row, scale)
        q = fp8.to_e4m3(v, scale, FP8_MAX)
        tl.store(q_ptr + row * N + offs, q.to(q_ptr.dtype.element_ty), mask=m)


def _norm(x, delta, weight, eps, feeds, lora=None, center=False):
    T, N = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    quant = feeds is not None and fp8.quantizes(x, feeds)
    q, scale = fp8.empty_rows(T, N, x.device) if quant else (out, out)
    assert lora is None or (delta is not None and lora.shape == delta.shape
                            and lora.dtype == delta.dtype and lora.stride(1) == 1)
    if T:
        d = delta if delta is not None else x
        _rms_norm_kernel[(T,)](x, d, lora if lora is not None else d, weight, total, out, q,
                               scale, N, eps, x.stride(0), d.stride(0) if delta is not None else 0,
                               lora.stride(0) if lora is not None else 0,
                               HAS_DELTA=delta is not None, HAS_LORA=lora is not None,
                               CENTER=center, QUANT=quant, BLOCK=pow2(N), num_warps=4, **fp8.ROUNDING,
                               **pdl.options(x.device))
    return total, Fp8Rows(out, q, scale) if quant else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, feeds=None,
             center: bool = False):
    """RMSNorm of each row; `feeds`: the weight of the GEMM the result goes to, which makes
    it a `quant.Fp8Rows` where that GEMM rounds its input to E4M3 (`fp8.quantizes`).
    `center`: a LayerNorm without bias (each row's mean taken off first)."""
    return _norm(x, None, weight, eps, feeds, center=center)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 feeds=None, lora: torch.Tensor | None = None, center: bool = False):
    """(x + delta, its RMSNorm); `feeds` and `center` as `rms_norm`'s. `lora`: delta's LoRA
    rows, not yet added (`with_lora`): delta + lora takes delta's place."""
    return _norm(x, delta, weight, eps, feeds, lora, center)


@triton.jit
def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, l_ptr, stride_t, stride_l, eps, Q_SIZE, KV_SIZE,
                    QG, KG, N_QG, N_KG, OWN: tl.constexpr, CENTER: tl.constexpr,
                    LORA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, group): one of the token's N_QG q groups of QG elements (a head, or
    the whole q) or of its N_KG k groups of KG, normalised in place under its weight (OWN:
    the group's own slice of the weight, else the one weight all groups share). With LORA,
    qkv's LoRA rows at l_ptr added first (`with_lora`), and the programs past the k groups
    write v's groups of KG with theirs."""
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    if g < N_QG:
        n = QG
        j = g
        col = j * QG
        w_ptr = qw_ptr
    elif g < N_QG + N_KG:
        n = KG
        j = g - N_QG
        col = Q_SIZE + j * KG
        w_ptr = kw_ptr
    else:  # (LORA only) a v group: its rows added, no norm
        n = KG
        j = g - N_QG - N_KG
        col = Q_SIZE + KV_SIZE + j * KG
        w_ptr = kw_ptr
    m = offs < n
    ptrs = qkv_ptr + t * stride_t + col + offs
    x = tl.load(ptrs, mask=m, other=0.0)
    if LORA:
        x = with_lora(x, l_ptr + t * stride_l + col + offs, m)
    if g < N_QG + N_KG:
        xf = x.to(tl.float32)
        if CENTER:  # a LayerNorm without bias (padding stays 0)
            xf = tl.where(m, xf - tl.sum(xf, axis=0) / n, 0.0)
        var = tl.sum(xf * xf, axis=0) / n
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + (j * n if OWN else 0) + offs, mask=m, other=0.0)
        x = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
    tl.store(ptrs, x, mask=m)


def qk_norm(qkv: torch.Tensor, q_size: int, kv_size: int, norm,
            lora: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.qk_norm` in one launch, in place: q and k inside qkv take their norms
    (`norm`, a `reference.QkNorm`); returns qkv. A program a head of a token (or a token's
    whole q or k, head_dim None). `lora`: qkv's LoRA rows, not yet added (as
    `add_rms_norm`'s): q, k and v are qkv + lora."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == q_size + 2 * kv_size
    assert norm.q_weight.dtype == norm.k_weight.dtype
    assert lora is None or (lora.shape == qkv.shape and lora.dtype == qkv.dtype
                            and lora.stride(1) == 1)
    qg, kg = (norm.head_dim,) * 2 if norm.head_dim else (q_size, kv_size)
    if T:
        block = pow2(max(qg, kg))
        groups = q_size // qg + kv_size // kg * (2 if lora is not None else 1)
        _qk_norm_kernel[(T, groups)](
            qkv, norm.q_weight, norm.k_weight, lora if lora is not None else qkv,
            qkv.stride(0), lora.stride(0) if lora is not None else 0, norm.eps, q_size,
            kv_size, qg, kg, q_size // qg, kv_size // kg, OWN=not norm.shared,
            CENTER=norm.center, LORA=lora is not None, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), **pdl.options(qkv.device))
    return qkv


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, inv_ptr, kc_ptr, vc_ptr, slot_ptr, l_ptr, stride_t,
                    stride_l, kc_page, kc_row, kc_head, vc_page, vc_row, vc_head, block_size,
                    T, H, KVH, HALF, BLOCK: tl.constexpr, TB: tl.constexpr,
                    LORA: tl.constexpr, PDL: tl.constexpr):
    """Program (token block, head): TB tokens' head h, as [TB, BLOCK] tiles of each half;
    with LORA, qkv's LoRA rows at l_ptr added as they are read (`with_lora`)."""
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    t = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)[:, None]  # [TB, 1]
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    t_ok = t < T
    m = t_ok & (offs < HALF)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)
    f = pos * tl.load(inv_ptr + offs, mask=offs < HALF, other=0.0)
    dt = qkv_ptr.dtype.element_ty
    c = tl.cos(f).to(dt).to(tl.float32)
    s = tl.sin(f).to(dt).to(tl.float32)
    D = 2 * HALF
    row = qkv_ptr + t * stride_t
    l_row = l_ptr + t * stride_l
    if h < H:  # a query head: rotate in place
        col = h * D
        x1 = _read(row + col + offs, l_row + col + offs, m, LORA).to(tl.float32)
        x2 = _read(row + col + HALF + offs, l_row + col + HALF + offs, m, LORA).to(tl.float32)
        tl.store(row + col + offs, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(row + col + HALF + offs, (x2 * c + x1 * s).to(dt), mask=m)
    else:  # a KV head: rotate K, store K and V at the token's slot
        kh = h - H
        slot = tl.load(slot_ptr + t, mask=t_ok, other=0)
        page = slot // block_size
        r = slot % block_size
        col = (H + kh) * D
        x1 = _read(row + col + offs, l_row + col + offs, m, LORA).to(tl.float32)
        x2 = _read(row + col + HALF + offs, l_row + col + HALF + offs, m, LORA).to(tl.float32)
        kdst = kc_ptr + page * kc_page + r * kc_row + kh * kc_head
        tl.store(kdst + offs, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(kdst + HALF + offs, (x2 * c + x1 * s).to(dt), mask=m)
        col = (H + KVH + kh) * D
        vdst = vc_ptr + page * vc_page + r * vc_row + kh * vc_head
        tl.store(vdst + offs, _read(row + col + offs, l_row + col + offs, m, LORA), mask=m)
        tl.store(vdst + HALF + offs,
                 _read(row + col + HALF + offs, l_row + col + HALF + offs, m, LORA), mask=m)


@triton.jit
def _read(ptrs, l_ptrs, mask, LORA: tl.constexpr):
    """The values at ptrs, with LORA their LoRA rows at l_ptrs added (`with_lora`)."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    if LORA:
        v = with_lora(v, l_ptrs, mask)
    return v


def rope_config(T: int, device: torch.device) -> dict:
    """`rope_write_kv`'s TB (tokens a program) and num_warps: table entry `rope_write_kv`, by
    `tokens`. Decode-sized batches take one head of one token a program (one warp); long
    prefills take blocks of tokens, as one-warp programs a token would be so many that their
    launches, not their bytes, would set the time."""
    return dict(_rope_config(tuning.kind(device), T))


@functools.lru_cache(maxsize=4096)
def _rope_config(table: str, T: int) -> dict:
    return tuning.choose(table, "rope_write_kv", tokens=T)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int,
                  lora: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary on q and k of the fused qkv output (q in place), K and V stored at the tokens'
    slots; returns q [T, H, D]. Twin: `reference.rope_write_kv`. A program takes TB tokens
    of one head (`rope_config`). `lora`: qkv's LoRA rows, not yet added (as `add_rms_norm`'s):
    q, k and v are qkv + lora (q's heads in qkv take the sum, rotated)."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert D % 2 == 0 and inv_freq.dtype == torch.float32
    assert lora is None or (lora.shape == qkv.shape and lora.dtype == qkv.dtype
                            and lora.stride(1) == 1)
    if T:
        cfg = rope_config(T, qkv.device)
        _rope_kv_kernel[(triton.cdiv(T, cfg["TB"]), num_heads + num_kv_heads)](
            qkv, positions, inv_freq, k_cache, v_cache, slot_mapping,
            lora if lora is not None else qkv, qkv.stride(0),
            lora.stride(0) if lora is not None else 0,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[1],
            T, num_heads, num_kv_heads, D // 2, BLOCK=pow2(D // 2), LORA=lora is not None,
            **pdl.options(qkv.device), **cfg)
    return qkv[:, : num_heads * D].view(T, num_heads, D)


@triton.jit
def tanh(x):
    """tanh through exp2 (the interpreter has no libdevice.tanh): 1 - 2 / (e^2x + 1), which
    saturates to +-1 where e^2x overflows or vanishes."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _act_mul_tile(gu_ptr, l_ptr, row, offs, m, N, stride_gu, stride_l, GELU: tl.constexpr,
                  HAS_LORA: tl.constexpr):
    """act(gate) * up of one row's columns `offs` (masked by m), in the row's dtype."""
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + N + offs, mask=m, other=0.0)
    if HAS_LORA:  # gate_up's LoRA rows, not yet added
        g = with_lora(g, l_ptr + row * stride_l + offs, m)
        u = with_lora(u, l_ptr + row * stride_l + N + offs, m)
    return glu(g, u, GELU)


@triton.jit
def glu(g, u, GELU: tl.constexpr):
    """act(g) * u of two tiles in their dtype (SiLU, or GELU's tanh form), each product
    rounded as torch's F.silu / F.gelu then the multiply round them."""
    gf = g.to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        act = (0.5 * gf * (1.0 + tanh(0.7978845608028654 * (gf + 0.044715 * gf * gf * gf))))
        act = act.to(g.dtype)
    else:
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def swiglu_oai(g, u, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """gpt-oss's clamped SwiGLU of two tiles in their dtype: (clamp(u, -LIMIT, LIMIT) + 1) *
    (m sigmoid(ALPHA m)) with m = min(g, LIMIT), each op rounded as torch's eager ops round
    them (`reference.swiglu_oai_mul`)."""
    dt = g.dtype
    m = tl.minimum(g.to(tl.float32), LIMIT)
    t = (m * ALPHA).to(dt).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-t))).to(dt).to(tl.float32)
    act = (m * sig).to(dt).to(tl.float32)
    up = (tl.minimum(tl.maximum(u.to(tl.float32), -LIMIT), LIMIT) + 1.0).to(dt)
    return (up.to(tl.float32) * act).to(dt)


@triton.jit
def _act_mul_kernel(gu_ptr, l_ptr, out_ptr, q_ptr, s_ptr, N, stride_gu, stride_l,
                    BLOCK: tl.constexpr, GELU: tl.constexpr, HAS_LORA: tl.constexpr,
                    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (row, j): the row's column blocks j, j + programs, ...; with QUANT one program
    takes the whole row as one tile (BLOCK >= N) and rounds it to E4M3 over its largest
    magnitude from registers: one pass over the row."""
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    if QUANT:
        offs = tl.arange(0, BLOCK)
        m = offs < N
        out = _act_mul_tile(gu_ptr, l_ptr, row, offs, m, N, stride_gu, stride_l, GELU, HAS_LORA)
        tl.store(out_ptr + row * N + offs, out, mask=m)
        v = out.to(tl.float32)  # (0 past N: the padding does not raise the row's largest)
        scale = fp8.row_scale(tl.max(tl.abs(v), axis=0), FP8_MAX, MIN_AMAX)
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * N + offs,
                 fp8.to_e4m3(v, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=m)
    else:
        for c0 in range(tl.program_id(1) * BLOCK, N, tl.num_programs(1) * BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m = offs < N
            out = _act_mul_tile(gu_ptr, l_ptr, row, offs, m, N, stride_gu, stride_l, GELU,
                                HAS_LORA)
            tl.store(out_ptr + row * N + offs, out, mask=m)


def silu_mul(gate_up: torch.Tensor, feeds=None, lora: torch.Tensor | None = None):
    """SwiGLU; `feeds` as `rms_norm`'s, `lora` as `add_rms_norm`'s (gate_up's LoRA rows)."""
    return _act_mul(gate_up, gelu=False, feeds=feeds, lora=lora)


def gelu_tanh_mul(gate_up: torch.Tensor, feeds=None, lora: torch.Tensor | None = None):
    """GeGLU; `feeds` as `rms_norm`'s, `lora` as `add_rms_norm`'s (gate_up's LoRA rows)."""
    return _act_mul(gate_up, gelu=True, feeds=feeds, lora=lora)


def _act_mul(gate_up: torch.Tensor, gelu: bool, feeds, lora=None):
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    quant = feeds is not None and fp8.quantizes(out, feeds)
    q, scale = fp8.empty_rows(T, N, out.device) if quant else (out, out)
    assert lora is None or (lora.shape == gate_up.shape and lora.dtype == gate_up.dtype
                            and lora.stride(1) == 1)
    if T:
        # with the rounding, a program a row holds the whole row (64 registers, none spilled,
        # for 7B's 11,008 columns at 16 warps); without, a program a 1,024-column block
        block, warps = fp8.row_tile(N) if quant else (min(1024, pow2(N)), 4)
        _act_mul_kernel[(T, 1 if quant else triton.cdiv(N, block))](
            gate_up, lora if lora is not None else gate_up, out, q, scale, N, gate_up.stride(0),
            lora.stride(0) if lora is not None else 0, BLOCK=block, GELU=gelu,
            HAS_LORA=lora is not None, QUANT=quant, num_warps=warps, **fp8.ROUNDING,
            **pdl.options(gate_up.device))
    return Fp8Rows(out, q, scale) if quant else out
