"""Kernel backends behind one small interface.

`TorchBackend` runs the twins in `reference.py` (the CPU path, and the specification).
`TritonBackend` runs the Triton kernels: MBGMV for decode rows, MBGMM for prefill segments,
paged decode attention. Both take the same `Batch` / `LoraMeta` built by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slora.kernels import reference as ref


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


@dataclass
class LoraMeta:
    """Per-step LoRA batch metadata, shared by every layer (see reference.py's docstring).

    Tokens 0..num_decode-1 are decode rows, one token each; the rest are prefill rows. Two views
    of the same assignment: token_slot gives each token's adapter row (the torch twin and MBGMV
    read it), and, in steps with prefill rows, the segments seg_start[i]:seg_start[i+1], one
    per sequence (decode rows too), share adapter row seg_slot[i]; MBGMM walks `tiles`, the
    work list of the segments with an adapter (slora.kernels.tiles).
    """

    pages: torch.Tensor  # int32 [n_a, max_pages]
    token_slot: torch.Tensor  # int32 [T]
    num_decode: int
    groups: dict[str, GroupMeta]
    seg_start: torch.Tensor | None = None  # int32 [S+1], absolute token indices (Batch.q_start)
    seg_slot: torch.Tensor | None = None  # int32 [S]
    tiles: torch.Tensor | None = None  # int32 [1 + 2 * capacity]
    tile_programs: int | None = None  # programs walking `tiles` (None: one per tile)
    # A graphed mixed step's split (slora.graphs): the decode rows' adapter row per token, -1 on
    # prompt tokens. With it MBGMV serves the decode rows and MBGMM only the prompts (`tiles`
    # holds the prompts' alone): in a graph the extra launches cost nothing, and on the H200 a
    # batch-128 mixed step spent 6.9 ms in MBGMM where the same rows' decode step spent 2.0 ms
    # in MBGMV.
    dec_slot: torch.Tensor | None = None


class TorchBackend:
    name = "torch"

    rms_norm = staticmethod(ref.rms_norm)
    add_rms_norm = staticmethod(ref.add_rms_norm)
    rope_write_kv = staticmethod(ref.rope_write_kv)
    silu_mul = staticmethod(ref.silu_mul)

    def attention(self, q, k_cache, v_cache, b, scale):
        return ref.paged_attention(q, k_cache, v_cache, b.block_tables, b.q_start,
                                   b.ctx_lens_list, scale)

    def lora(self, out, x, pool_l, meta: LoraMeta, layer: int, group: str) -> None:
        g = meta.groups.get(group)
        if g is None:
            return
        ranks = g.ranks[layer]
        xa = ref.lora_shrink(x, pool_l, meta.pages, g.offsets_a, ranks, meta.token_slot,
                             g.stride_in, g.max_rank)
        ref.lora_expand(xa, out, pool_l, meta.pages, g.offsets_b, ranks, meta.token_slot,
                        g.out_dims, g.strides_out)


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self) -> None:
        from slora.kernels import attention, fused, lora  # triton imported only for this backend

        self._attn, self._lora = attention, lora
        self.rms_norm = fused.rms_norm
        self.add_rms_norm = fused.add_rms_norm
        self.rope_write_kv = fused.rope_write_kv
        self.silu_mul = fused.silu_mul

    def attention(self, q, k_cache, v_cache, b, scale):
        if b.num_decode == len(b.q_start) - 1:  # decode only: the split-K decode kernel
            return self._attn.paged_decode_attention(q, k_cache, v_cache, b.block_tables,
                                                     b.ctx_lens, scale)
        out = None
        if b.dec_ctx_lens is not None:  # a graphed mixed step: decode rows by the decode kernel
            S = b.ctx_lens.shape[0]
            out = torch.empty_like(q)
            out[:S] = self._attn.paged_decode_attention(q[:S], k_cache, v_cache, b.block_tables,
                                                        b.dec_ctx_lens, scale)
        # prefill, or prefill mixed with decode rows: one flash-style launch for all of them
        # (for the prompts only when the decode rows' tiles are left out, as above)
        return self._attn.paged_prefill_attention(q, k_cache, v_cache, b.block_tables,
                                                  b.q_start_t, b.ctx_lens, scale, b.tiles,
                                                  b.tile_programs, out=out)

    def lora(self, out, x, pool_l, meta: LoraMeta, layer: int, group: str) -> None:
        """Decode-only batches: MBGMV, one adapter row per token. Eager batches with prefill
        rows: MBGMM over every sequence's segment, decode rows included as one-token segments.
        One pair of launches rather than an MBGMV pair and an MBGMM pair: these steps run
        eagerly, and the H200 showed each Triton launch costs the host tens of microseconds,
        64 of them per layer pair adding ~12 ms to a 7B mixed step. A graphed mixed step
        (`meta.dec_slot` set) pays no launch cost, so it takes both pairs: MBGMV for the
        decode rows, MBGMM for the prompts (the decode rows' segments are empty there)."""
        g = meta.groups.get(group)
        if g is None:
            return
        ranks = g.ranks[layer]
        decode_only = x.shape[0] == meta.num_decode
        if decode_only or meta.dec_slot is not None:
            slot = meta.token_slot if decode_only else meta.dec_slot
            xa = self._lora.mbgmv_shrink(x, pool_l, meta.pages, g.offsets_a, ranks, slot,
                                         g.stride_in, g.max_rank)
            self._lora.mbgmv_expand(xa, out, pool_l, meta.pages, g.offsets_b, ranks, slot,
                                    g.out_dims, g.strides_out)
            if decode_only:
                return
        xa = self._lora.mbgmm_shrink(x, pool_l, meta.pages, g.offsets_a, ranks, meta.seg_start,
                                     meta.seg_slot, g.stride_in, g.max_rank, meta.tiles,
                                     meta.tile_programs)
        self._lora.mbgmm_expand(xa, out, pool_l, meta.pages, g.offsets_b, ranks, meta.seg_start,
                                meta.seg_slot, g.out_dims, g.strides_out, meta.tiles,
                                meta.tile_programs)


def make_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return TritonBackend()
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError("EngineConfig.backend='cuda' runs the csrc CUDA kernels and needs a "
                             "CUDA device; use backend='torch' (or 'auto') on CPU")
        from slora.kernels.cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown backend {name!r}")
