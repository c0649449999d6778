"""Kernel backends behind one small interface.

`TorchBackend` runs the twins in `reference.py` (the CPU path, and the specification) and
F.linear for the base GEMMs (`quant.linear`: over an FP8 weight, dequantized first).
`TritonBackend` runs the Triton kernels: MBGMV for decode rows, MBGMM for prefill segments,
paged decode and prefill attention, the fused elementwise kernels, and the base GEMMs of a
decode step's few rows (`gemm.linear`; cuBLAS past them; over FP8 weights `fp8.linear`: the
few-rows kernel reading E4M3 weights, `torch._scaled_mm` past them). Both take the same
`Batch` / `LoraMeta` built by the runner; `make_backend` picks one by name. A base weight is a
tensor or an `Fp8Weight` wherever `linear` or `linear_lora` takes one; LoRA reads the pool's
pages in the pool's dtype either way.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slora.kernels import reference as ref
from slora.model import quant


@dataclass
class GroupMeta:
    """One LoRA module group (modules sharing an input) for the adapters of this batch."""

    offsets_a: torch.Tensor  # int64 [n_a, G]
    offsets_b: torch.Tensor  # int64 [n_a, G]
    ranks: torch.Tensor  # int32 [L, n_a, G]
    max_rank: int
    stride_in: int
    strides_out: tuple[int, ...]
    out_dims: tuple[int, ...]
    # int64 [n_a, G]: each module's DoRA row (-1: none); None when no adapter of the batch
    # has DoRA in this group (then no rescale runs)
    offsets_d: torch.Tensor | None = None


@dataclass
class DecodeSegments:
    """A step's decode rows grouped by adapter (`slora.kernels.segments`): the Triton backend
    then runs their LoRA through MBGMM, each adapter's tile read once for up to `tile` rows,
    rather than through MBGMV; the rows in no segment through MBGMV by `rest`, if given."""

    rows: torch.Tensor  # int32 [n]: the decode rows with an adapter, grouped by adapter row
    seg_start: torch.Tensor  # int32 [S+1]: segment i is rows[seg_start[i]:seg_start[i+1]]
    seg_slot: torch.Tensor  # int32 [S]: its adapter row
    tiles: torch.Tensor  # int32: the segments' work list (slora.kernels.tiles), tiles of `tile`
    tile: int
    programs: int | None = None  # programs walking `tiles` (None: one per tile)
    # int32 [n]: every decode row's adapter row for MBGMV, -1 on the segments' rows (None: the
    # rows outside the segments are base-only)
    rest: torch.Tensor | None = None


@dataclass
class LoraMeta:
    """Per-step LoRA batch metadata, shared by every layer (see reference.py's docstring).

    Tokens 0..num_decode-1 are decode rows, one token each; the rest are prefill rows. Two views
    of the same assignment: token_slot gives each token's adapter row (the torch twin and MBGMV
    read it), and, in steps with prefill rows, the segments seg_start[i]:seg_start[i+1], one
    per sequence (decode rows too), share adapter row seg_slot[i]; MBGMM walks `tiles`, the
    work list of the prompts' segments with an adapter (slora.kernels.tiles).
    """

    pages: torch.Tensor  # int32 [n_a, max_pages]
    token_slot: torch.Tensor  # int32 [T]
    num_decode: int
    groups: dict[str, GroupMeta]
    seg_start: torch.Tensor | None = None  # int32 [S+1], absolute token indices (Batch.q_start_tensor)
    seg_slot: torch.Tensor | None = None  # int32 [S]
    tiles: torch.Tensor | None = None  # int32 [1 + 2 * capacity]: the prompts' (adapter) tiles
    tile_programs: int | None = None  # programs walking `tiles` (None: one per tile)
    # A step with prompts and decode rows: the adapter rows of its first n tokens, for MBGMV
    # (the decode rows; a graph's bucket pads it with -1 over the prompt tokens).
    dec_slot: torch.Tensor | None = None  # int32 [n]
    # The decode rows grouped by adapter, when their LoRA runs so (None: MBGMV, a row at a
    # time), in decode-only steps and steps with prompts alike
    dec_segments: DecodeSegments | None = None
    # A step with prompt log-prob rows: the adapter row of each logits row (Batch.logits_index)
    head_slot: torch.Tensor | None = None  # int32 [R]


class Pending(NamedTuple):
    """A linear layer's output whose LoRA rows are still being added on the side stream of a
    decode step (`TritonBackend.linear_lora` with `defer`): `out`, the base GEMM's output,
    and `lora`, the rows the expand added into zeros (zero on rows without an adapter). Only
    the kernels its layer's output goes to take it (`rope_attention`, `add_rms_norm`, the
    GLUs): they wait for the side stream and add `lora` as the expand would have added it
    into `out`."""

    out: torch.Tensor
    lora: torch.Tensor


def _ignoring_feeds(f):
    """`f` taking (and ignoring) the keyword argument `feeds`."""
    @functools.wraps(f)
    def call(*args, feeds=None, **kw):
        return f(*args, **kw)
    return staticmethod(call)


class TorchBackend:
    name = "torch"
    # Tensor parallelism (slora.distributed.TensorParallel, None on one device): each rank's
    # shrink reads its slice of the input (`_lora_x`), the ranks sum the partial products,
    # and row-parallel groups expand into the rank's hidden columns.
    tp = None

    linear = staticmethod(quant.linear)

    def fused_experts_rows(self, experts: int, k: int) -> int:
        """The most rows of a step `experts` takes a layer of `experts` experts, k picked a
        row, for: none here (no kernels of its own; the model runs the twins)."""
        return 0
    # The norms and GLUs take `feeds`, the weight of the GEMM their output goes to, where the
    # GPU backends fold that GEMM's rounding of its input into them (fused.py); this backend's
    # `linear` rounds no input, and they ignore it.
    rms_norm = _ignoring_feeds(ref.rms_norm)
    add_rms_norm = _ignoring_feeds(ref.add_rms_norm)
    rope_write_kv = staticmethod(ref.rope_write_kv)
    qk_norm = staticmethod(ref.qk_norm)
    silu_mul = _ignoring_feeds(ref.silu_mul)
    gelu_tanh_mul = _ignoring_feeds(ref.gelu_tanh_mul)

    def attention(self, q, k_cache, v_cache, b, scale, window=0, softcap=0.0, sinks=None):
        """Paged attention of the batch's new tokens; `window` > 0: a sliding-window layer's,
        `softcap` > 0: scores soft-capped, `sinks` (float32 [H]): each query head's sink logit
        (reference.paged_attention)."""
        return ref.paged_attention(q, k_cache, v_cache, b.block_tables, b.q_start_list,
                                   b.ctx_lens_list, scale, window, softcap, sinks)

    def rope_attention(self, qkv, inv_freq, k_cache, v_cache, b, scale, num_heads,
                       num_kv_heads, window=0, softcap=0.0, sinks=None, qk_norm=None):
        """Rotary on q and k of the fused qkv output, K/V stored at the tokens' slots, then
        attention: [T, H, D]. `qk_norm` (a `reference.QkNorm`): q and k normed first."""
        if qk_norm is not None:
            D = k_cache.shape[-1]
            qkv = self.qk_norm(qkv, num_heads * D, num_kv_heads * D, qk_norm)
        q = self.rope_write_kv(qkv, b.positions, inv_freq, k_cache, v_cache, b.slot_mapping,
                               num_heads, num_kv_heads)
        return self.attention(q, k_cache, v_cache, b, scale, window, softcap, sinks)

    def linear_lora(self, x, w, bias, pool_l, meta: LoraMeta | None, layer: int, group: str,
                    defer: bool = False):
        """A base linear layer of module group `group` with its batch's LoRA deltas added:
        x @ w^T (+ bias) + each row's own adapter's (x @ A^T) @ B^T, then rescaled per output
        channel on the rows of DoRA adapters (`dora`). x may carry its FP8 rounding
        (`quant.Fp8Rows`): the base GEMM takes it, LoRA its 16-bit rows. `defer`: the output
        goes only to this backend's `rope_attention`, `add_rms_norm` or GLU, which may then be
        given a `Pending` (this backend adds the rows here, always)."""
        out = self.linear(x, w, bias)
        if meta is not None:
            self.lora(out, quant.rows(x), pool_l, meta, layer, group)
            self.dora(out, bias, pool_l, meta, group)
        return out

    def dora(self, out, bias, pool_l, meta: LoraMeta, group: str) -> None:
        """DoRA's rescale of the group's output rows whose adapter has DoRA rows there
        (reference.dora_scale); nothing when none of the batch's adapters has."""
        g = meta.groups.get(group)
        if g is not None and g.offsets_d is not None:
            self._dora_scale(out, bias, pool_l, meta.pages, g.offsets_d, meta.token_slot,
                             g.out_dims, g.strides_out)

    _dora_scale = staticmethod(ref.dora_scale)

    def _lora_x(self, x: torch.Tensor, group: str) -> torch.Tensor:
        """The shrink's input: x, or under tensor parallelism this rank's slice of it."""
        return x if self.tp is None else self.tp.lora_input(group, x)

    def lora(self, out, x, pool_l, meta: LoraMeta, layer: int, group: str) -> None:
        g = meta.groups.get(group)
        if g is None:
            return
        ranks = g.ranks[layer]
        xa = ref.lora_shrink(self._lora_x(x, group), pool_l, meta.pages, g.offsets_a, ranks,
                             meta.token_slot, g.stride_in, g.max_rank)
        if self.tp is not None:
            xa, out = self.tp.lora_partials(group, xa, out)
        ref.lora_expand(xa, out, pool_l, meta.pages, g.offsets_b, ranks, meta.token_slot,
                        g.out_dims, g.strides_out)

    # -- the vocabulary modules and added tokens: each a GroupMeta of one module whose ranks
    # are [1, n_a, 1] (one layer's slot holds it, AdapterLayout), run through four hooks the
    # Triton backend overrides: _embedding_shrink, _token_expand (each token its adapter's
    # row), _row_shrink, _row_expand (each logits row its sequence's)

    def embed_lora(self, out, ids, pool_l, meta: LoraMeta | None) -> None:
        """Add each token's adapter's embedding LoRA to its embedding `out` [T, hidden], in
        place: A's column ids[t] (a gather), then B^T. `pool_l`: layer 0's slot."""
        g = meta.groups.get("embed") if meta is not None else None
        if g is not None:
            self._token_expand(self._embedding_shrink(ids, pool_l, meta, g), out, pool_l, meta, g)

    def added_embed(self, out, ids, pool_l, meta: LoraMeta | None, vocab: int) -> None:
        """Add to `out` [T, hidden] each added token's (ids[t] >= vocab) row of its adapter's
        added embedding rows (B^T of group "added"), in place: an expand of the one-hot
        `reference.added_one_hot`. The runner leaves those tokens' base rows zero, so the row
        replaces it. `pool_l`: layer 0's slot."""
        g = meta.groups.get("added") if meta is not None else None
        if g is not None:
            xa = ref.added_one_hot(ids, vocab, g.max_rank)
            self._token_expand(xa, out, pool_l, meta, g)

    def head_lora(self, out, x, pool_l, meta: LoraMeta | None) -> None:
        """Add each row's adapter's lm_head LoRA to its logits row `out` [R, vocab] (x [R,
        hidden]: the normed hidden states of the rows the head picks), in place. `pool_l`:
        the last layer's."""
        g = meta.groups.get("lm_head") if meta is not None else None
        if g is not None:
            slot = _row_slot(meta)
            self._row_expand(self._row_shrink(x, pool_l, meta, g, slot), out, pool_l, meta, g,
                             slot)

    def added_logits(self, x, pool_l, meta: LoraMeta | None, width: int) -> torch.Tensor:
        """[S, width] float32: the logits of each row's adapter's added tokens, x [S, hidden]
        times its added lm_head rows (A of group "added"), -inf past its own count (every
        column of a row whose adapter adds none). `pool_l`: the last layer's slot."""
        g = meta.groups.get("added") if meta is not None else None
        out = torch.full((x.shape[0], width), float("-inf"), device=x.device)
        if g is None:
            return out
        assert g.max_rank == width, "group 'added' is sized EngineConfig.max_added_tokens"
        slot = _row_slot(meta)
        xa = self._row_shrink(x, pool_l, meta, g, slot)[:, 0]
        count = torch.where(slot >= 0, g.ranks[0][slot.clamp(min=0).long(), 0], 0)
        cols = torch.arange(width, device=x.device)
        return torch.where(cols[None, :] < count[:, None], xa, out)

    def _embedding_shrink(self, ids, pool_l, meta: LoraMeta, g: GroupMeta):
        return ref.embedding_shrink(ids, pool_l, meta.pages, g.offsets_a, g.ranks[0],
                                    meta.token_slot, g.stride_in, g.max_rank)

    def _token_expand(self, xa, out, pool_l, meta: LoraMeta, g: GroupMeta) -> None:
        ref.lora_expand(xa, out, pool_l, meta.pages, g.offsets_b, g.ranks[0], meta.token_slot,
                        g.out_dims, g.strides_out)

    def _row_shrink(self, x, pool_l, meta: LoraMeta, g: GroupMeta, slot):
        return ref.lora_shrink(x, pool_l, meta.pages, g.offsets_a, g.ranks[0], slot,
                               g.stride_in, g.max_rank)

    def _row_expand(self, xa, out, pool_l, meta: LoraMeta, g: GroupMeta, slot) -> None:
        ref.lora_expand(xa, out, pool_l, meta.pages, g.offsets_b, g.ranks[0], slot, g.out_dims,
                        g.strides_out)


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, gemm_max_rows: int) -> None:
        # triton imported only for this backend
        from slora.kernels import attention, dora, experts, fp8, fused, mbgmm, mbgmv, vocab

        self._attn, self._mbgmv, self._mbgmm = attention, mbgmv, mbgmm
        self._experts = experts
        self._dora_scale = dora.dora_scale
        self._vocab_mbgmv, self._vocab = mbgmv, vocab  # (vocab-wide rows: the Triton MBGMV)
        self._side: dict[torch.device, torch.cuda.Stream] = {}  # (linear_lora)
        self.linear = functools.partial(fp8.linear, max_rows=gemm_max_rows)
        self._fused = fused
        self.rms_norm = fused.rms_norm
        self.rope_write_kv = fused.rope_write_kv
        self.qk_norm = fused.qk_norm

    def add_rms_norm(self, x, delta, weight, eps, feeds=None, center=False):
        delta, lora = self._ready(delta)
        return self._fused.add_rms_norm(x, delta, weight, eps, feeds, lora=lora, center=center)

    def silu_mul(self, gate_up, feeds=None):
        gate_up, lora = self._ready(gate_up)
        return self._fused.silu_mul(gate_up, feeds, lora=lora)

    def gelu_tanh_mul(self, gate_up, feeds=None):
        gate_up, lora = self._ready(gate_up)
        return self._fused.gelu_tanh_mul(gate_up, feeds, lora=lora)

    def fused_experts_rows(self, experts: int, k: int) -> int:
        return self._experts.few_rows(experts, k)

    def experts(self, h, ex, k: int, renormalise: bool, act: ref.Glu) -> torch.Tensor:
        """A layer of experts (`llama.Experts`) over a step's few rows: the router's GEMM as
        any base GEMM, then the routing and the picked experts' GLUs (`act`) in the kernels of
        slora.kernels.experts (twins: `reference.route`, `reference.experts_grouped`)."""
        weights, pick = self._experts.route(self.linear(h, ex.router, ex.router_bias), k,
                                            renormalise)
        return self._experts.experts(h, ex.gate_up, ex.down, weights, pick, act,
                                     ex.gate_up_bias, ex.down_bias)

    def _ready(self, t):
        """(output, its LoRA rows or None) of a tensor or a `Pending`, whose rows the current
        stream then waits for."""
        if not isinstance(t, Pending):
            return t, None
        if t.out.device.type == "cuda":
            torch.cuda.current_stream(t.out.device).wait_stream(self._side_stream(t.out.device))
        return t.out, t.lora

    def rope_attention(self, qkv, inv_freq, k_cache, v_cache, b, scale, num_heads,
                       num_kv_heads, window=0, softcap=0.0, sinks=None, qk_norm=None):
        if b.num_decode == len(b.q_start_list) - 1:
            # decode only: the q and k norms, rotary and K/V store folded in where they fold
            qkv, lora = self._ready(qkv)
            return self._attn.rope_paged_decode_attention(
                qkv, b.positions, inv_freq, k_cache, v_cache, b.slot_mapping, b.block_tables,
                b.ctx_lens, scale, num_heads, num_kv_heads, window=window, softcap=softcap,
                lora=lora, sinks=sinks, norm=qk_norm)
        # (a `Pending` comes from decode-only steps alone)
        assert not isinstance(qkv, Pending)
        return super().rope_attention(qkv, inv_freq, k_cache, v_cache, b, scale, num_heads,
                                      num_kv_heads, window, softcap, sinks, qk_norm)

    def attention(self, q, k_cache, v_cache, b, scale, window=0, softcap=0.0, sinks=None):
        layer = dict(window=window, softcap=softcap, sinks=sinks)  # (every path takes them)
        if b.num_decode == len(b.q_start_list) - 1:  # decode only: the split-K decode kernel
            return self._attn.paged_decode_attention(q, k_cache, v_cache, b.block_tables,
                                                     b.ctx_lens, scale, **layer)
        out = torch.empty_like(q)
        if b.dec_ctx_lens is not None:  # the decode rows: the decode kernel
            n = b.dec_ctx_lens.shape[0]
            out[:n] = self._attn.paged_decode_attention(q[:n], k_cache, v_cache,
                                                        b.block_tables[:n], b.dec_ctx_lens, scale,
                                                        **layer)
        # the prompts (whole, or chunks over a cached prefix): the flash-style prefill kernel
        # over their work tiles, writing only their rows of `out`
        return self._attn.paged_prefill_attention(q, k_cache, v_cache, b.block_tables,
                                                  b.q_start_tensor, b.ctx_lens, scale, b.tiles,
                                                  b.tile_programs, out=out, **layer)

    def linear_lora(self, x, w, bias, pool_l, meta: LoraMeta | None, layer: int, group: str,
                    defer: bool = False):
        """A decode-only step runs the shrink on a side stream beside the base GEMM (the shrink
        reads only x and adapter pages) and the expand after both: a decode step's GEMM leaves
        SMs idle (its few output tiles do not fill the GPU), and the shrink fills them. With
        `defer`, where every decode row runs MBGMV (no rows grouped by adapter; no tensor
        parallelism or DoRA on the group), the expand runs on the side stream too, into zeros,
        and the output is a `Pending`: the kernel it goes to adds the rows, so the expand's
        launch, a few microseconds that would wait for the GEMM, runs beside it (MBGMM's
        expand beside the GEMM slows it more than that saves: docs/performance.md). Other
        steps run the GEMM, then `lora`, on one stream: their GEMMs fill the GPU. Every use
        of the side stream starts by waiting for the main one, so what was allocated on the
        side is reused there only after its last reader on the main one. On CPU (the
        interpreter) the same order runs on one stream."""
        g = meta.groups.get(group) if meta is not None else None
        if g is None:
            return self.linear(x, w, bias)
        x16 = quant.rows(x)
        if x16.shape[0] != meta.num_decode:
            return super().linear_lora(x, w, bias, pool_l, meta, layer, group)
        defer = (defer and meta.dec_segments is None and self.tp is None
                 and g.offsets_d is None)
        lora = None
        with self._on_side(x16.device):
            xa = self._shrink(self._lora_x(x16, group), pool_l, meta, g, layer)
            if defer:
                lora = x16.new_zeros(x16.shape[0], sum(g.out_dims))
                self._expand(xa, lora, pool_l, meta, g, layer)
        out = self.linear(x, w, bias)
        if lora is not None:
            return Pending(out, lora)
        if x16.device.type == "cuda":
            torch.cuda.current_stream(x16.device).wait_stream(self._side_stream(x16.device))
        xa, cols = (xa, out) if self.tp is None else self.tp.lora_partials(group, xa, out)
        self._expand(xa, cols, pool_l, meta, g, layer)
        self.dora(out, bias, pool_l, meta, group)
        return out

    @contextlib.contextmanager
    def _on_side(self, device: torch.device):
        """The side stream, after the main one's work so far (on CPU: nothing changes)."""
        if device.type != "cuda":
            yield
            return
        side = self._side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def lora(self, out, x, pool_l, meta: LoraMeta, layer: int, group: str) -> None:
        """Decode rows: MBGMV, one adapter row per token, or (`LoraMeta.dec_segments`) MBGMM
        over the rows grouped by adapter, beside MBGMV over the rest where the step splits
        them. Prompts: MBGMM over their segments' work tiles. A step with both runs both: its
        decode rows are no prompt segments, as one-token segments would each fill a whole
        token tile alone."""
        g = meta.groups.get(group)
        if g is not None:
            xa = self._shrink(self._lora_x(x, group), pool_l, meta, g, layer)
            if self.tp is not None:
                xa, out = self.tp.lora_partials(group, xa, out)
            self._expand(xa, out, pool_l, meta, g, layer)

    def _shrink(self, x, pool_l, meta: LoraMeta, g: GroupMeta, layer: int):
        """(xa of the decode rows, xa of the prompts), None where the step has none. The
        decode rows are x's first rows, as many as their adapter rows (`_decode_slot`)."""
        ranks = g.ranks[layer]
        slot = _decode_slot(meta, x.shape[0])
        seg = meta.dec_segments
        xa_dec = xa_pre = None
        if slot is not None:
            x_dec, rest = x[:slot.shape[0]], slot if seg is None else seg.rest
            if rest is not None:  # MBGMV: every row, or the rows in no segment
                xa_dec = self._mbgmv.mbgmv_shrink(x_dec, pool_l, meta.pages, g.offsets_a, ranks,
                                                 rest, g.stride_in, g.max_rank)
            if seg is not None:  # by adapter: MBGMM over the segments, into MBGMV's xa
                xa_dec = self._mbgmm.mbgmm_shrink(x_dec, pool_l, meta.pages, g.offsets_a, ranks,
                                                 seg.seg_start, seg.seg_slot, g.stride_in,
                                                 g.max_rank, seg.tiles, seg.programs,
                                                 rows=seg.rows, block_m=seg.tile, xa=xa_dec)
        if x.shape[0] != meta.num_decode:
            xa_pre = self._mbgmm.mbgmm_shrink(x, pool_l, meta.pages, g.offsets_a, ranks,
                                             meta.seg_start, meta.seg_slot, g.stride_in,
                                             g.max_rank, meta.tiles, meta.tile_programs)
        return xa_dec, xa_pre

    def _expand(self, xa, out, pool_l, meta: LoraMeta, g: GroupMeta, layer: int) -> None:
        ranks = g.ranks[layer]
        xa_dec, xa_pre = xa
        if xa_dec is not None:
            seg = meta.dec_segments
            out_dec = out[:xa_dec.shape[0]]
            rest = _decode_slot(meta, out.shape[0]) if seg is None else seg.rest
            if rest is not None:
                self._mbgmv.mbgmv_expand(xa_dec, out_dec, pool_l, meta.pages, g.offsets_b,
                                        ranks, rest, g.out_dims, g.strides_out)
            if seg is not None:
                self._mbgmm.mbgmm_expand(xa_dec, out_dec, pool_l, meta.pages, g.offsets_b,
                                        ranks, seg.seg_start, seg.seg_slot, g.out_dims,
                                        g.strides_out, seg.tiles, seg.programs, rows=seg.rows,
                                        block_m=seg.tile)
        if xa_pre is not None:
            self._mbgmm.mbgmm_expand(xa_pre, out, pool_l, meta.pages, g.offsets_b, ranks,
                                    meta.seg_start, meta.seg_slot, g.out_dims, g.strides_out,
                                    meta.tiles, meta.tile_programs)

    def _embedding_shrink(self, ids, pool_l, meta: LoraMeta, g: GroupMeta):
        return self._vocab.embedding_shrink(ids, pool_l, meta.pages, g.offsets_a, g.ranks[0],
                                            meta.token_slot, g.stride_in, g.max_rank)

    def _token_expand(self, xa, out, pool_l, meta: LoraMeta, g: GroupMeta) -> None:
        """As `lora` expands: MBGMV or MBGMM by adapter over the decode rows, MBGMM over the
        prompts' tiles."""
        slot = _decode_slot(meta, out.shape[0])
        xa_dec = xa[:slot.shape[0]] if slot is not None else None
        self._expand((xa_dec, xa if out.shape[0] != meta.num_decode else None), out, pool_l,
                     meta, g, 0)

    def _row_shrink(self, x, pool_l, meta: LoraMeta, g: GroupMeta, slot):
        return self._vocab_mbgmv.mbgmv_shrink(x, pool_l, meta.pages, g.offsets_a, g.ranks[0],
                                              slot, g.stride_in, g.max_rank)

    def _row_expand(self, xa, out, pool_l, meta: LoraMeta, g: GroupMeta, slot) -> None:
        self._vocab_mbgmv.mbgmv_expand(xa, out, pool_l, meta.pages, g.offsets_b, g.ranks[0],
                                       slot, g.out_dims, g.strides_out)


def _row_slot(meta: LoraMeta) -> torch.Tensor:
    """The adapter row of each logits row: `head_slot` where prompt log-prob rows follow the
    sequences', else each sequence's: the segments' in a step with prompts, else the decode
    rows' own."""
    if meta.head_slot is not None:
        return meta.head_slot
    return meta.seg_slot if meta.seg_slot is not None else meta.token_slot


def _decode_slot(meta: LoraMeta, rows: int) -> torch.Tensor | None:
    """The adapter rows of a step's decode rows, for MBGMV (None: the step has none): every
    token's in a decode-only step of `rows` tokens, else `dec_slot`."""
    return meta.token_slot if rows == meta.num_decode else meta.dec_slot


class CudaBackend(TritonBackend):
    """Decode LoRA through the csrc CUDA MBGMV (`slora.kernels.cuda`, compiled at run time by
    cupy); prefill (MBGMM), attention and the fused elementwise kernels as in the Triton
    backend."""

    name = "cuda"

    def __init__(self, gemm_max_rows: int) -> None:
        super().__init__(gemm_max_rows)
        from slora.kernels import cuda  # (imports nothing optional until its first launch)

        self._mbgmv = cuda


def make_backend(name: str, device: torch.device, gemm_max_rows: int):
    """The backend `name` ("auto", "torch", "triton" or "cuda") for `device`; the GPU backends
    run base GEMMs of at most `gemm_max_rows` rows (`EngineConfig.gemm_max_rows`) through
    `gemm.linear`."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name in ("triton", "cuda") and device.type == "cuda":
        from slora.kernels import gemm

        gemm.prepare(device)  # the GEMMs' tile counters, before any graph capture
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("EngineConfig.backend='triton' runs Triton kernels, which need a "
                             "CUDA device (or Triton's interpreter, TRITON_INTERPRET=1, set "
                             "before triton is imported); use backend='torch' or 'auto' on CPU")
        return TritonBackend(gemm_max_rows)
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError("EngineConfig.backend='cuda' runs the csrc CUDA kernels and needs a "
                             "CUDA device; use backend='torch' (or 'auto') on CPU")
        return CudaBackend(gemm_max_rows)
    raise ValueError(f"unknown backend {name!r}")
