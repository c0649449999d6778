"""What each rank of a tensor-parallel group holds: its slices of the weights and of every
adapter page (Megatron's partitioning, S-LoRA's for LoRA); its view of the model's shapes is
`shapes.ShardConfig`.

Rank k of N holds:
- attention: query heads [k H/N, (k+1) H/N) and their KV heads: KV heads [k KVH/N, ...) when
  N divides KVH, else (N a multiple of KVH: fewer KV heads than ranks) the one KV head its
  query heads read, `KVH / N`-fold replicated across ranks. q|k|v column-parallel (rows of
  the fused weight and bias), o row-parallel (its columns); o's bias on rank 0 alone; the
  sinks of the rank's query heads.
- MLP: intermediate rows [k I/N, (k+1) I/N) of gate and of up (column-parallel), the same
  columns of down (row-parallel). A mixture of experts: each expert's likewise (its own
  intermediate size split, with its gate|up bias; its down bias on rank 0 alone), the router
  (and its bias) and a shared expert's gate whole: every rank routes alike and sums its slice
  of each picked expert, and the MLP's all-reduce sums the ranks'.
- vocabulary: rows [k V', (k+1) V') of the embedding and of lm_head, V' = ceil(V / N), the
  last shard padded with zero rows (`VocabShard`).
- norms (and Qwen3's q/k norms) whole.

LoRA on rank k, for each module (`module_slices`): A's input columns of this rank's slice of
the module's input, B's rows of this rank's slice of its output, so the rank holds 1/N of A
and of B. x_k A_k^T is a partial [T, r] product; the ranks sum it (an all-reduce of r floats
a token per module, `TensorParallel.lora_partials`), then B_k expands the sum into the
rank's output columns:
- column-parallel (q, k, v, gate, up): the input is the hidden state, whole on every rank;
  rank k's slice is its hidden columns [k h/N, (k+1) h/N) (`TensorParallel.lora_input`),
  its output columns the rank's heads or intermediate rows, as the base layer's.
- row-parallel (o, down): the input is already the rank's own (its heads' attention, its
  intermediate rows); the output is split on the hidden columns [k h/N, (k+1) h/N): the
  delta goes into those columns of the rank's partial output, which the base layer's
  all-reduce then sums, so each column gets its delta exactly once.

So a rank's adapter rows are the rows `AdapterLayout.build(local_config, ranks)` lays out,
with `local_config` the rank's `ShardConfig` (its module_dims are the per-rank shapes): the
LoRA kernels, the batch metadata and the page accounting run unchanged on every rank. Every
rank's shapes are the same, so one page id means the same page on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slora.config import LORA_MODULES, ModelConfig
from slora.core.adapters import AdapterLayout
from slora.distributed.shapes import ShardConfig
from slora.model.llama import Experts, Weights
from slora.model.loader import strides
from slora.model.quant import Fp8Weight

def _span(start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size)


def _heads(heads: list[int], d: int) -> torch.Tensor:
    return torch.cat([_span(h * d, d) for h in heads])


def module_slices(full: ModelConfig, local: ShardConfig) -> dict[str, tuple]:
    """module -> (A's columns, B's rows: indices into the full module's d_in and d_out) of
    this rank's slice, for every module of LORA_MODULES."""
    k, d = local.tp_rank, full.head_dim
    q = _span(k * local.q_size, local.q_size)
    kv = _heads(local.kv_heads(full), d)
    mlp = _span(k * local.intermediate_size, local.intermediate_size)
    hidden = _span(k * (full.hidden_size // local.tp_size), full.hidden_size // local.tp_size)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
            "down_proj": (mlp, hidden)}


# ----------------------------------------------------------------------------- weights

def _rows(w, idx: torch.Tensor):
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[idx.to(w.device)].contiguous(), w.scale[idx.to(w.device)])
    return w[idx.to(w.device)].contiguous()


def _cols(w, idx: torch.Tensor):
    if isinstance(w, Fp8Weight):  # one scale per output row: the rows stay whole
        return Fp8Weight(w.weight[:, idx.to(w.device)].contiguous(), w.scale)
    return w[:, idx.to(w.device)].contiguous()


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + size) of the vocabulary, held by this rank; `vocab` the full
    vocabulary (the last rank's rows past it are zeros)."""

    start: int
    size: int
    vocab: int


def shard_weights(w: Weights, full: ModelConfig, local: ShardConfig) -> Weights:
    """This rank's slices of the model's weights (see the module docstring)."""
    sl = module_slices(full, local)
    qkv = torch.cat([sl["q_proj"][1], full.q_size + sl["k_proj"][1],
                     full.q_size + full.kv_size + sl["v_proj"][1]])
    gate_up = torch.cat([sl["gate_proj"][1], full.intermediate_size + sl["up_proj"][1]])
    mid = _span(local.tp_rank * local.expert_intermediate_size, local.expert_intermediate_size)
    expert_gate_up = torch.cat([mid, full.expert_intermediate_size + mid])

    def experts(ex):
        if ex is None:
            return None
        gu = expert_gate_up.to(ex.gate_up.device)
        biased = ex.gate_up_bias is not None
        return Experts(ex.router, ex.gate_up[:, gu].contiguous(),
                       ex.down[:, :, mid.to(ex.down.device)].contiguous(),
                       router_bias=ex.router_bias,
                       gate_up_bias=ex.gate_up_bias[:, gu].contiguous() if biased else None,
                       down_bias=(ex.down_bias if local.tp_rank == 0 or not biased
                                  else torch.zeros_like(ex.down_bias)))
    q_heads = sl["q_proj"][1].view(-1, full.head_dim)[:, 0] // full.head_dim
    # (the fields not named here, norms and a shared expert's gate, stay whole on every rank)
    layers = [dataclasses.replace(
        lw, qkv=_rows(lw.qkv, qkv),
        qkv_bias=None if lw.qkv_bias is None else _rows(lw.qkv_bias, qkv),
        o=_cols(lw.o, sl["o_proj"][0]),
        o_bias=lw.o_bias if local.tp_rank == 0 else None,  # added once, before the sum
        gate_up=lw.gate_up if lw.gate_up is None else _rows(lw.gate_up, gate_up),
        down=lw.down if lw.down is None else _cols(lw.down, sl["down_proj"][0]),
        experts=experts(lw.experts),
        sinks=None if lw.sinks is None else lw.sinks[q_heads.to(lw.sinks.device)])
        for lw in w.layers]
    embed = vocab_rows(w.embed, local)
    lm_head = embed if w.lm_head is w.embed else vocab_rows(w.lm_head, local)
    return dataclasses.replace(w, embed=embed, layers=layers, lm_head=lm_head)


def vocab_rows(table: torch.Tensor, local: ShardConfig) -> torch.Tensor:
    """This rank's rows of an embedding-shaped table, zero rows past the vocabulary."""
    s = vocab_shard(local)
    out = table.new_zeros(s.size, table.shape[1])
    end = min(s.start + s.size, s.vocab)
    if end > s.start:
        out[:end - s.start] = table[s.start:end]
    return out


def vocab_shard(local: ShardConfig) -> VocabShard:
    return VocabShard(local.tp_rank * local.vocab_size, local.vocab_size, local.full_vocab_size)


# ----------------------------------------------------------------------------- adapters

def shard_packed(packed: torch.Tensor, full: ModelConfig, layout: AdapterLayout,
                 local: ShardConfig, page_size: int) -> torch.Tensor:
    """One rank's pages of an adapter: `packed` is the adapter laid out for the full model
    (`layout`, [layers, elems >= layout.elems]); the result holds the rank's slices (see
    `module_slices`) laid out for `local` ([layers, pages * page_size] of the local layout).
    Rows past a layer's own rank are zeros in `packed` and stay zeros."""
    mine = AdapterLayout.build(local, [list(r) for r in layout.ranks])
    L = packed.shape[0]
    out = packed.new_zeros(L, mine.num_pages(page_size) * page_size)
    sl = module_slices(full, local)
    for m, name in enumerate(LORA_MODULES):
        r = max(layer[m] for layer in layout.ranks)
        if r == 0:
            continue
        cols_a, cols_b = sl[name]
        (s_in, s_out), (l_in, l_out) = strides(full, name), strides(local, name)
        d_in, d_out = full.module_dims(name)
        (fa, fb), (ma, mb) = layout.offsets[m], mine.offsets[m]
        a = packed[:, fa:fa + r * s_in].view(L, r, s_in)[:, :, :d_in]
        b = packed[:, fb:fb + r * s_out].view(L, r, s_out)[:, :, :d_out]
        a, b = a[:, :, cols_a], b[:, :, cols_b]
        out[:, ma:ma + r * l_in].view(L, r, l_in)[:, :, :a.shape[2]] = a
        out[:, mb:mb + r * l_out].view(L, r, l_out)[:, :, :b.shape[2]] = b
    return out
