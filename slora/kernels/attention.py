"""Triton paged attention over the pool's KV pages: decode (split-K) and prefill.

Semantics: exactly `reference.paged_decode_attention` (decode) and `reference.paged_attention`
(prefill / mixed), the torch twins. K and V are the strided views `kv_views(pool_l, ...)`
returns, [num_pages, block_size, kv_heads, head_dim] with a page stride of 2 * block_size *
kv_heads * head_dim elements (K and V of a page are interleaved in one pool page): the kernels
address them through their strides and never copy.

Decode tiling, and why:
  * One program per (sequence, KV head, split): it loads q for all H / KVH query heads of that
    KV head's group as one [BLOCK_H, D] tile, so each K/V row is read from memory once for the
    whole group (GQA) and the scores are one tl.dot (the group is padded to 16 rows on the GPU,
    where tl.dot needs it; decode is memory-bound, so the padding costs nothing).
  * Tokens are walked BLOCK_N at a time; token n's page is block_tables[b, n // block_size],
    looked up once per token (not per element), and its D elements are contiguous.
  * Online softmax in fp32 (running max and sum, exp2 with log2(e) folded into the scale).
  * Split-K (flash-decoding): when batch x KV heads is too small to fill the GPU, each
    sequence's context is cut into `num_splits` equal parts (sized in the kernel from the
    sequence's own length, so short sequences don't leave empty programs holding long ones),
    each part writes an unnormalised partial (acc, max, sum) and a second small kernel merges
    them. With one split the kernel writes the normalised output directly.
  * head_dim may be any size: the D axis is padded to a power of two and masked.
  * `rope_paged_decode_attention` folds the rotary + K/V store (`fused.rope_write_kv`) into
    the same launch for decode-only steps while the programs fit one wave (`fold_rope`): each
    program rotates its q rows from the token's [q | k | v] row, and the program whose split
    holds the new position rotates and stores the new K and V before it reads keys. A
    family's per-head q and k norms under one shared weight (Qwen3's) fold in the same way,
    before the rotary (`norm`).

Prefill (`paged_prefill_attention`, flash-attention style): programs per (query tile, query
head), the tiles taken from a host-built work list (`tiles.py`); keys walked BLOCK_N at a time
through the page table up to the tile's last causal position, online softmax in fp32. It
handles whole prompts, chunked prefill over a cached prefix and decode rows in one launch.

Attention sinks (`sinks`, gpt-oss; compile-time switch SINKS): query head h's softmax takes
one more logit, sinks[h], with no value. Both kernels fold it in as the online softmax's
starting state (`_sink_state`: max sinks[h] * log2(e), sum 1, acc 0), before any key; in a
split-K decode only split 0 starts so, the others start empty (max -inf, sum 0), so the merge
counts the sink exactly once, whichever splits hold keys.

The KV layout (the six K/V strides, block_size and head_dim) is a compile-time constant of
both kernels: one model has one layout, so it compiles once, and constant strides let the
compiler fold each key's address arithmetic (a 7B's decode kernel: 96 registers against 126
with them as arguments, five programs an SM instead of four). The block-table width
(`stride_bt`) changes from step to step; it is exempt from Triton's integer specialization so
a width of a new class (1, a multiple of 16, other) met while serving does not compile a new
variant.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import pdl, tuning
from .fused import qk_norm, rope_write_kv, tanh, with_lora
from .tiles import as_tiles, tile_rows
from .tuning import pow2

LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, k_ptr, v_ptr, bt_row, lo, hi, qpos, offs_d, d_ok, kvh, qk_scale, window,
            cap_scale, m_i, l_i, acc, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, block_size, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            DOT_F32: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    """Keys lo..hi-1 of one KV head, read through the block table row BLOCK_N at a time,
    folded into the online softmax state (m_i, l_i, acc) of the q rows; returns the state.
    CAUSAL (prefill): row i sees keys at positions <= qpos[i], so a row may have no valid key
    yet (its max stays -inf) and the exponentials are taken against 0 there; with SLIDING
    also only keys at positions > qpos[i] - window. Scores: q.k * qk_scale (log2 domain), or
    with SOFTCAP tanh(q.k * qk_scale) * cap_scale (the caller folds 1 / softcap into qk_scale
    and softcap * log2(e) into cap_scale)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        page = tl.load(bt_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % block_size
        kmask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=kmask, other=0.0)
        if DOT_F32:
            sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        if CAUSAL:
            ok = n_ok[None, :] & (offs_n[None, :] <= qpos[:, None])
            if SLIDING:
                ok = ok & (offs_n[None, :] > qpos[:, None] - window)
        else:
            ok = n_ok[None, :]
        if SOFTCAP:
            sc = tanh(sc * qk_scale) * cap_scale
        else:
            sc = sc * qk_scale
        sc = tl.where(ok, sc, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        if CAUSAL:
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        else:
            m_ref = m_new
        p = tl.exp2(sc - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sink_state(sink_ptr, heads, mask):
    """The online softmax's starting (max, sum) of rows of query heads `heads`: each head's
    sink folded in as a key of logit sinks[h] (log2 domain: times log2(e)) and value 0, so
    (sinks[h] * log2(e), 1) with acc 0; rows off `mask` start empty, (-inf, 0)."""
    m = tl.load(sink_ptr + heads, mask=mask, other=float("-inf")).to(tl.float32)
    m = m * 1.4426950408889634
    return m, tl.where(m > float("-inf"), 1.0, 0.0)


@triton.jit
def _rotary(ptr, offs_d, mask, half, c, s, l_ptr, LORA: tl.constexpr, w_ptr, eps,
            NORM: tl.constexpr, AXIS: tl.constexpr):
    """HF's rotary (x * cos + rotate_half(x) * sin) of the rows at ptr (columns offs_d), in
    fp32 and rounded to ptr's dtype, as `fused.rope_write_kv` computes it; with LORA the rows
    at l_ptr added first (`fused.with_lora`); with NORM each row (a head, along AXIS) first
    RMS-normalised under the weight at w_ptr as `fused.qk_norm` does it."""
    first = offs_d < half
    other = tl.where(first, offs_d + half, offs_d - half)
    x = tl.load(ptr + offs_d, mask=mask, other=0.0)
    y = tl.load(ptr + other, mask=mask, other=0.0)
    if LORA:
        x = with_lora(x, l_ptr + offs_d, mask)
        y = with_lora(y, l_ptr + other, mask)
    if NORM:  # y holds x's elements in another order: one statistic for both
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=AXIS, keep_dims=True) / (2 * half) + eps)
        x = _normed(x, r, w_ptr + offs_d, offs_d < 2 * half)
        y = _normed(y, r, w_ptr + other, offs_d < 2 * half)
    x = x.to(tl.float32)
    y = y.to(tl.float32)
    return (x * c + tl.where(first, -y, y) * s).to(ptr.dtype.element_ty)


@triton.jit
def _normed(v, r, w_ptrs, w_mask):
    """v times its row's 1 / rms r, rounded to v's dtype, then times the weight at w_ptrs,
    rounded again (`reference.rms_norm`'s rounding points)."""
    n = (v.to(tl.float32) * r).to(v.dtype)
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    return (w.to(tl.float32) * n.to(tl.float32)).to(v.dtype)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_ptr, ml_ptr,
    pos_ptr, inv_ptr, slot_ptr, l_ptr, sink_ptr, qw_ptr, kw_ptr,
    qk_scale, window, cap_scale, norm_eps,
    stride_qb, stride_qh, stride_lb,
    stride_kp: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vp: tl.constexpr, stride_vs: tl.constexpr, stride_vh: tl.constexpr,
    stride_bt, block_size: tl.constexpr,
    stride_ob, stride_oh,
    D: tl.constexpr, num_splits,
    QH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    LORA: tl.constexpr = False, NORM: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # (the step's metadata, which no kernel writes, is read before the wait: the context
    # length, and with ROPE the position's cos / sin)
    ctx = tl.load(ctx_ptr + b)
    # The keys the new token sees: all of them, or with SLIDING the last `window`.
    start = 0
    if SLIDING:
        start = tl.maximum(ctx - window, 0)
    # This split's share of them, in whole BLOCK_N tiles.
    per_split = tl.cdiv(tl.cdiv(ctx - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + sp * per_split
    hi = tl.minimum(lo + per_split, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < QH
    d_ok = offs_d < D
    heads = kvh * QH + offs_h
    q_row = q_ptr + b.to(tl.int64) * stride_qb
    qmask = h_ok[:, None] & d_ok[None, :]
    if ROPE:
        half = D // 2
        f = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_ptr + offs_d % half, mask=d_ok,
                                                         other=0.0)
        dt = q_ptr.dtype.element_ty
        c = tl.cos(f).to(dt).to(tl.float32)
        s = tl.sin(f).to(dt).to(tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    ELEM: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
    if PDL and PREFETCH > 0 and BLOCK_D * ELEM >= 128:
        # the K and V rows of this head for the split's first PREFETCH keys on their way to
        # L2 (the block table is step metadata; a line the kernel before writes, the new
        # token's, is read as written: `pdl.prefetch`)
        pf_n = lo + tl.arange(0, PREFETCH)
        pf_ok = (pf_n < hi)[:, None]
        pf_page = tl.load(bt_row + pf_n // block_size, mask=pf_n < hi, other=0).to(tl.int64)
        pf_slot = pf_n % block_size
        pf_cols = tl.arange(0, BLOCK_D * ELEM // 128) * (128 // ELEM)
        pf_cols = tl.where(pf_cols < D, pf_cols, 0)[None, :]
        pf_k = k_ptr + (pf_page * stride_kp + pf_slot * stride_ks + kvh * stride_kh)[:, None]
        pf_v = v_ptr + (pf_page * stride_vp + pf_slot * stride_vs + kvh * stride_vh)[:, None]
        pdl.prefetch(tl.where(pf_ok, pf_k + pf_cols, k_ptr), PDL)
        pdl.prefetch(tl.where(pf_ok, pf_v + pf_cols, v_ptr), PDL)
    pdl.wait(PDL)
    if ROPE:
        # q_row is the token's [q | k | v] row, unrotated: rotate q (every split) and the new
        # key, and store the new key and value at the token's slot (the split holding its
        # position), before the keys are read; the barrier makes the stores visible to the
        # program's other threads. With LORA, l_ptr holds the row's LoRA rows (same layout),
        # added to q, k and v as they are read.
        l_row = l_ptr + b.to(tl.int64) * stride_lb
        q = _rotary(q_row + heads[:, None] * stride_qh, offs_d[None, :], qmask, half,
                    c[None, :], s[None, :], l_row + heads[:, None] * stride_qh, LORA, qw_ptr,
                    norm_eps, NORM, 1)
        if (lo < ctx) & (ctx <= hi):
            k_col = (QH * tl.num_programs(1) + kvh) * stride_qh  # past the H q heads
            v_col = k_col + tl.num_programs(1) * stride_qh  # past the KV k heads
            slot = tl.load(slot_ptr + b).to(tl.int64)
            page, r = slot // block_size, slot % block_size
            tl.store(k_ptr + page * stride_kp + r * stride_ks + kvh * stride_kh + offs_d,
                     _rotary(q_row + k_col, offs_d, d_ok, half, c, s, l_row + k_col, LORA,
                             kw_ptr, norm_eps, NORM, 0),
                     mask=d_ok)
            v = tl.load(q_row + v_col + offs_d, mask=d_ok)
            if LORA:
                v = with_lora(v, l_row + v_col + offs_d, d_ok)
            tl.store(v_ptr + page * stride_vp + r * stride_vs + kvh * stride_vh + offs_d, v,
                     mask=d_ok)
        tl.debug_barrier()
    else:
        q = tl.load(q_row + heads[:, None] * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    if SINKS:  # the sinks enter split 0's state alone: once in the merge
        m_i, l_i = _sink_state(sink_ptr, heads, h_ok & (sp == 0))
    else:
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_row, lo, hi, None, offs_d, d_ok, kvh, qk_scale,
                            window, cap_scale, m_i, l_i, acc, stride_kp, stride_ks, stride_kh,
                            stride_vp, stride_vs, stride_vh, block_size, BLOCK_N, False,
                            DOT_F32, False, SOFTCAP)
    pdl.launch_next(PDL)

    omask = qmask
    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: part [B, H, num_splits, D] fp32, ml [B, H, num_splits, 2] fp32 (max, sum)
        row = (b * (tl.num_programs(1) * QH) + heads) * num_splits + sp
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m_i, mask=h_ok)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, H, D, num_splits,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_next(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    row = (b * H + h) * num_splits + offs_s
    m = tl.load(ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    part = tl.load(part_ptr + row[:, None] * D + offs_d[None, :],
                   mask=(w > 0)[:, None] & (offs_d < D)[None, :], other=0.0)
    denom = tl.sum(w * l, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def _default_splits(B: int, kvh: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Split-K only when (sequence, KV head) programs can't fill the GPU and the context is
    long: table entry `decode_attention_splits` (one rule) gives the programs an SM to aim at,
    the fewest key tiles a split keeps and the most splits."""
    c = tuning.choose(tuning.kind(device), "decode_attention_splits")
    want = triton.cdiv(c["programs_per_sm"] * tuning.sms(device), B * kvh)
    return int(max(1, min(want, max_ctx // (c["min_key_tiles"] * block_n), c["max_splits"])))


def decode_config(D: int, device: torch.device) -> dict:
    """The decode kernel's tiles: BLOCK_N keys a step, num_warps, num_stages (scores and P.V
    are tl.dot on a q tile of the head group padded to 16 rows), and PREFETCH (0 when the
    rule gives none): keys, a power of two, whose K and V each program asks of L2 before its
    PDL wait (`pdl.prefetch`); table entry `decode_attention`, by `head_dim`."""
    return dict(_decode_config(tuning.kind(device), D))


@functools.lru_cache(maxsize=None)
def _decode_config(table: str, D: int) -> dict:
    return tuning.choose(table, "decode_attention", head_dim=D)


def prefill_config(D: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The prefill kernel's BLOCK_N keys a step, num_warps and num_stages: table entry
    `prefill_attention`, by `itemsize` (element bytes: fp32's IEEE dots spill registers at
    the 16-bit key tile) and `head_dim`."""
    return dict(_prefill_config(tuning.kind(device), D, dtype.itemsize))


@functools.lru_cache(maxsize=None)
def _prefill_config(table: str, D: int, itemsize: int) -> dict:
    return tuning.choose(table, "prefill_attention", head_dim=D, itemsize=itemsize)


def _scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) of `_attend`: the log2-domain score is q.k * scale * log2(e), or
    with a softcap tanh(q.k * scale / softcap) * softcap * log2(e)."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, cfg: dict | None = None,
                           window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: one new token per sequence over its paged KV (twin:
    `reference.paged_decode_attention`).

    q [B, H, D]; k_cache / v_cache [num_pages, block_size, KVH, D] strided pool views (unit
    stride over D); block_tables int32 [B, max_blocks]; ctx_lens int32 [B] on q's device, each
    >= 1, the new token's K/V already written. Query head h reads KV head h // (H / KVH).
    Returns [B, H, D] in q's dtype. `num_splits` (optional) overrides the split-K heuristic;
    the heuristic bounds the context by block_tables' width, so it needs no device sync.
    `cfg` (optional, for benchmarks' sweeps) overrides `decode_config`'s keys. `window` > 0:
    the token sees only the last `window` keys (a sliding-window layer); `softcap` > 0: scores
    soft-capped to softcap * tanh(score / softcap); `sinks` (float32 [H] on q's device):
    query head h's softmax takes the logit sinks[h] too, with no value (the twin's rule). All
    three are compile-time switches of the kernel, so a layer without them runs the plain
    kernel.
    """
    return _decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, num_splits, cfg,
                   window=window, softcap=softcap, sinks=sinks)


def rope_paged_decode_attention(qkv: torch.Tensor, positions: torch.Tensor,
                                inv_freq: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                                num_heads: int, num_kv_heads: int,
                                num_splits: int | None = None, cfg: dict | None = None,
                                fold: bool | None = None, window: int = 0,
                                softcap: float = 0.0,
                                lora: torch.Tensor | None = None,
                                sinks: torch.Tensor | None = None,
                                norm=None) -> torch.Tensor:
    """`fused.rope_write_kv` and `paged_decode_attention`, in one launch where that is faster
    (twin: `reference.rope_write_kv`, then `reference.paged_decode_attention`): qkv [B, (H + 2
    KVH) * D] is each sequence's new token, unrotated; its K and V are stored at slot_mapping,
    the position ctx_lens - 1 of its sequence. Returns [B, H, D]; qkv's q heads may be left
    rotated (in two launches `rope_write_kv` rotates them in place). `fold` (optional, for
    tests and benchmarks) overrides `fold_rope`'s choice of one launch or two. `window`,
    `softcap`, `sinks`: as `paged_decode_attention`'s. `lora`: qkv's LoRA rows, not yet added,
    as `fused.rope_write_kv` takes them. `norm` (a `reference.QkNorm`): q and k normed before
    rotary (twin `reference.qk_norm` first), in the same launch where the heads share one
    weight, else in `fused.qk_norm`'s first."""
    B = qkv.shape[0]
    D = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * D
    assert k_cache.shape[2] == num_kv_heads and D % 2 == 0 and inv_freq.dtype == torch.float32
    q = qkv[:, : num_heads * D].view(B, num_heads, D)
    return _decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, num_splits, cfg,
                   rope=(qkv, positions, inv_freq, slot_mapping, lora, norm), fold=fold,
                   window=window, softcap=softcap, sinks=sinks)


def fold_rope(programs: int, device: torch.device) -> bool:
    """Whether the decode kernel takes the rotary + K/V store in (one launch) at this many
    programs. Folding saves a launch but puts the rotary's latency at the start of every
    program, which a launch of many waves pays in each: table entry
    `decode_attention_fold_rope` gives the most programs an SM at which folding pays (null:
    always fold; on sm_90 with the compiled-in KV layout it is faster at every batch measured,
    1-128 rows; the tests cover both forms through `fold`)."""
    most = tuning.choose(tuning.kind(device), "decode_attention_fold_rope")["max_programs_per_sm"]
    return most is None or programs <= most * tuning.sms(device)


def _decode(q, k_cache, v_cache, block_tables, ctx_lens, scale, num_splits, cfg, rope=None,
            fold=None, window=0, softcap=0.0, sinks=None):
    B, H, D = q.shape
    _, block_size, kvh, Dk = k_cache.shape
    assert Dk == D and H % kvh == 0 and q.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and v_cache.shape == k_cache.shape
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    qh = H // kvh
    cfg = {**decode_config(D, q.device), **(cfg or {})}
    block_h = max(16 if q.device.type == "cuda" else 1, pow2(qh))
    block_d = pow2(D)
    if num_splits is None:
        max_ctx = block_tables.shape[1] * block_size
        num_splits = _default_splits(B, kvh, min(max_ctx, window) if window > 0 else max_ctx,
                                     cfg["BLOCK_N"], q.device)
    if rope is not None and fold is None:
        fold = fold_rope(B * kvh * num_splits, q.device)
    if rope is not None:
        qkv, positions, inv_freq, slot_mapping, lora, norm = rope
        if norm is not None and not (fold and norm.shared and not norm.center):
            # norms the kernel does not take (a weight of each head's own, or over all heads),
            # or two launches: their own launch first (in place, so q's view sees it)
            qkv, lora, norm = qk_norm(qkv, H * D, kvh * D, norm, lora=lora), None, None
        rope = (qkv, positions, inv_freq, slot_mapping, lora, norm)
        if not fold:  # rotate and store, then attend
            q, rope = rope_write_kv(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, H,
                                    kvh, lora=lora), None
    dot_f32 = q.device.type != "cuda" or q.dtype == torch.float32
    if num_splits > 1:
        part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, H, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    # (without ROPE the kernel reads none of these: any int tensor stands in)
    _, positions, inv_freq, slot_mapping, lora, norm = rope or (None, ctx_lens, ctx_lens,
                                                                ctx_lens, None, None)
    if lora is not None:
        assert lora.shape == rope[0].shape and lora.dtype == q.dtype and lora.stride(1) == 1
    assert sinks is None or (sinks.shape == (H,) and sinks.stride(0) == 1)
    qk_scale, cap_scale = _scales(scale, softcap)
    _decode_kernel[(B, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, part, ml,
        positions, inv_freq, slot_mapping, lora if lora is not None else q,
        sinks if sinks is not None else q,
        *((norm.q_weight, norm.k_weight) if norm is not None else (q, q)),
        qk_scale, window, cap_scale, norm.eps if norm is not None else 0.0,
        q.stride(0), q.stride(1), lora.stride(0) if lora is not None else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_size,
        out.stride(0), out.stride(1),
        D, num_splits,
        QH=qh, BLOCK_H=block_h, BLOCK_D=block_d, SPLIT=num_splits > 1, DOT_F32=dot_f32,
        ROPE=rope is not None, SLIDING=window > 0, SOFTCAP=softcap > 0,
        SINKS=sinks is not None, LORA=lora is not None, NORM=norm is not None,
        **pdl.options(q.device), **cfg)
    if num_splits > 1:
        _merge_kernel[(B, H)](part, ml, out, out.stride(0), out.stride(1), H, D, num_splits,
                              BLOCK_S=pow2(num_splits), BLOCK_D=block_d,
                              **pdl.options(q.device))
    return out


# ----------------------------------------------------------------------------- prefill

@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, q_start_ptr, ctx_ptr, tiles_ptr, out_ptr, sink_ptr,
    qk_scale, window, cap_scale,
    stride_qt, stride_qh,
    stride_kp: tl.constexpr, stride_ks: tl.constexpr, stride_kh: tl.constexpr,
    stride_vp: tl.constexpr, stride_vs: tl.constexpr, stride_vh: tl.constexpr,
    stride_bt, block_size: tl.constexpr,
    stride_ot, stride_oh,
    D: tl.constexpr,
    QH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    h = tl.program_id(1)
    for i in range(tl.program_id(0), tl.load(tiles_ptr), tl.num_programs(0)):
        s = tl.load(tiles_ptr + 1 + 2 * i)
        m0 = tl.load(tiles_ptr + 2 + 2 * i)
        # query tile m0..m0+BLOCK_M-1 of sequence s (clipped to its tokens), query head h
        q_lo = tl.load(q_start_ptr + s)
        q_hi = tl.load(q_start_ptr + s + 1)
        ctx = tl.load(ctx_ptr + s)
        kvh = h // QH
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_hi
        d_ok = offs_d < D
        qpos = ctx - (q_hi - q_lo) + (offs_m - q_lo)  # cache position of each new token
        q = tl.load(q_ptr + offs_m.to(tl.int64)[:, None] * stride_qt + h * stride_qh
                    + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        if SINKS:
            m_i, l_i = _sink_state(sink_ptr, tl.zeros((BLOCK_M,), tl.int32) + h, m_ok)
        else:
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        bt_row = bt_ptr + s.to(tl.int64) * stride_bt
        # Causal: this tile's last token sees positions <= its own, so keys stop there; with
        # SLIDING its first token (row m0) sees none before its position - window + 1.
        hi = tl.minimum(ctx, tl.max(tl.where(m_ok, qpos, 0), axis=0) + 1)
        lo = 0
        if SLIDING:
            lo = tl.maximum(ctx - (q_hi - q_lo) + (m0 - q_lo) - window + 1, 0)
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_row, lo, hi, qpos, offs_d, d_ok, kvh,
                                qk_scale, window, cap_scale, m_i, l_i, acc, stride_kp,
                                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                block_size, BLOCK_N, True, DOT_F32, SLIDING, SOFTCAP)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + h * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, q_start: torch.Tensor,
                            ctx_lens: torch.Tensor, scale: float,
                            tiles: torch.Tensor | None = None, programs: int | None = None,
                            out: torch.Tensor | None = None, window: int = 0,
                            softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new tokens over paged KV: prefill, chunked prefill with a cached
    prefix, decode rows, or a mix (twin: `reference.paged_attention`).

    Unlike the twin, q_start (int32 [S+1]) and ctx_lens (int32 [S]) are tensors on q's device,
    so the call needs no host sync. New token i of sequence s sits at cache position
    ctx_lens[s] - n_new + i and attends to positions <= its own. `tiles`: the work list
    (`slora.kernels.tiles`, tiles of `tile_rows(q.device, q.dtype)` tokens); None builds it
    here from q_start, a host round trip. Only the tiles' rows of `out` (optional, like q)
    are written. Grid: (`programs`, default one per tile slot, query head); each program
    walks the list with stride `programs`, KV read through the page table per token.
    `window`, `softcap`, `sinks`: as `paged_decode_attention`'s (a tile's keys start at its
    first token's window).
    """
    T, H, D = q.shape
    _, block_size, kvh, Dk = k_cache.shape
    assert Dk == D and H % kvh == 0 and q.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    assert sinks is None or (sinks.shape == (H,) and sinks.stride(0) == 1)
    S = ctx_lens.shape[0]
    if T == 0 or S == 0:
        return out
    cuda = q.device.type == "cuda"
    block_m = tile_rows(q.device, q.dtype)
    cfg = prefill_config(D, q.dtype, q.device)
    tiles = as_tiles(tiles, q_start, block_m)
    programs = programs or (tiles.shape[0] - 1) // 2
    if programs == 0:
        return out
    qk_scale, cap_scale = _scales(scale, softcap)
    _prefill_kernel[(programs, H)](
        q, k_cache, v_cache, block_tables, q_start, ctx_lens, tiles, out,
        sinks if sinks is not None else q,
        qk_scale, window, cap_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_size,
        out.stride(0), out.stride(1),
        D,
        QH=H // kvh, BLOCK_M=block_m, BLOCK_D=pow2(D),
        DOT_F32=not cuda or q.dtype == torch.float32, SLIDING=window > 0, SOFTCAP=softcap > 0,
        SINKS=sinks is not None, **cfg)
    return out
