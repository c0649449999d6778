"""One parameterised model for the Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 1, 2 and 3 (text), Granite, SmolLM3, OLMo 2 and 3, Helium, Ernie 4.5, GLM, GLM-4,
EXAONE 4, Seed-OSS, Cohere 1 and 2, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE.

They differ only by configuration (`ModelConfig`):
- GQA/MQA head counts, head_dim, q/k/v (and o) biases, tied embeddings;
- rope theta and scaling (linear, llama3, yarn, longrope); rotary over part of each head
  (Phi-4-mini, GLM) or over interleaved pairs (Helium, Ernie 4.5, GLM, Cohere), both served by
  permuting q's and k's rows at load (`ModelConfig.rotary_permutation`); layers without rotary
  (SmolLM3, EXAONE 4, Cohere 2);
- an RMSNorm on q and k (`qk_norm`: per head in Qwen3, Gemma 3 and EXAONE 4, over the whole of
  q and of k in OLMo 2 and 3 and OLMoE);
- sliding-window layers (Mistral, Qwen, Phi-3, Gemma 2/3, OLMo 3, EXAONE 4), with a rope of
  their own, unscaled, in Gemma 3 and OLMo 3;
- where the norms sit: before attention and the MLP (most), also after each (`sandwich_norms`:
  Gemma 2/3, GLM-4), or after each alone (`pre_norms` False: OLMo 2/3, EXAONE 4); one before
  attention and the MLP side by side (`parallel_block`: Cohere, whose norms are LayerNorms);
- Gemma's scaled embeddings and GeGLU, query_pre_attn_scalar as the attention scale and
  soft-capped attention scores and logits (Gemma 2); Granite's multipliers;
- a mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE:
  `num_experts`, `LlamaModel._experts`), in some layers or all, beside a gated shared expert
  (Qwen2-MoE);
- the checkpoint's names: Phi-3 stores q|k|v and gate|up fused, GLM gate|up (see the loader).

The model runs on a flat batch of tokens from many sequences (decode rows first, then prefill
segments), reads and writes KV in the shared page pool, and adds each token's LoRA delta
through the backend's MBGMV/MBGMM kernels. Weights of modules that share an input are fused
(q|k|v, gate|up) so each is one GEMM; the LoRA groups follow the same fusion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from slora.config import LORA_MODULES, ConfigError, ModelConfig
from slora.kernels import reference as ref
from slora.model.quant import Fp8Weight

# LoRA module groups: modules that share an input, as indices into LORA_MODULES.
GROUPS = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}
# The vocabulary modules' groups, one module each: group name -> its VOCAB_MODULES name. Their
# GroupMeta ranks are [1, n_a, 1]: one layer's slot holds each (AdapterLayout.vocab_layers).
VOCAB_GROUPS = {"embed": "embed_tokens", "lm_head": "lm_head"}
# Adapter-added tokens: a group of rank = the adapter's count of added tokens, its lm_head
# rows as A (last layer's slot) and its embedding rows as B^T (layer 0's), ranks [1, n_a, 1]
ADDED_GROUP = "added"


def groups_of(modules) -> tuple[str, ...]:
    """The groups (in GROUPS order, then VOCAB_GROUPS') holding any of `modules` (names from
    LORA_MODULES or VOCAB_MODULES)."""
    idx = {LORA_MODULES.index(m) for m in modules if m in LORA_MODULES}
    return (tuple(g for g, mods in GROUPS.items() if idx.intersection(mods))
            + tuple(g for g, m in VOCAB_GROUPS.items() if m in modules))


def modules_of(groups) -> list[str]:
    """The module names (LORA_MODULES', then VOCAB_MODULES') of the groups `groups`."""
    return ([LORA_MODULES[i] for g in groups if g in GROUPS for i in GROUPS[g]]
            + [VOCAB_GROUPS[g] for g in groups if g in VOCAB_GROUPS])


@dataclass
class Experts:
    """A layer's mixture of experts (ModelConfig.num_experts): the router [experts, hidden];
    every expert's gate|up [experts, 2 expert_intermediate, hidden] and down [experts, hidden,
    expert_intermediate], stacked, in the model dtype; with ModelConfig.experts_bias the
    router's bias [experts] and each expert's gate|up and down biases [experts, 2
    expert_intermediate] and [experts, hidden]."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class LayerWeights:
    """One decoder layer's weights. The linear weights (qkv, o, gate_up, down: [out, in]) are
    tensors in the model dtype or `Fp8Weight`s (EngineConfig.quantization="fp8", or a
    pre-quantized checkpoint); the backend's `linear` takes either. Biases are in the model
    dtype; norms too, or in float32 (Gemma's folded 1 + w, see the loader)."""

    ln1: torch.Tensor | None  # None without input norms (ModelConfig.pre_norms False)
    qkv: torch.Tensor | Fp8Weight  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | Fp8Weight
    o_bias: torch.Tensor | None
    ln2: torch.Tensor | None
    # The dense MLP (ModelConfig.dense_mlp; in a layer of experts Qwen2-MoE's shared expert),
    # which adapters may target; None in a layer of experts alone
    gate_up: torch.Tensor | Fp8Weight | None  # [2 intermediate, hidden]
    down: torch.Tensor | Fp8Weight | None
    q_norm: torch.Tensor | None = None  # ModelConfig.qk_norm only: [head_dim] or [q_size]
    k_norm: torch.Tensor | None = None  # [head_dim] or [kv_size]
    # ModelConfig.sandwich_norms, or pre_norms False: the norms of the attention output and of
    # the MLP output, before each is added to the residual stream (with sandwich norms ln2 is
    # then the MLP's input norm).
    post_attn: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None
    # A layer of experts (ModelConfig.experts_in); with a shared expert, its gate [1, hidden]
    experts: Experts | None = None
    shared_gate: torch.Tensor | None = None
    # ModelConfig.attention_sinks: each query head's sink logit, float32 [num_heads]
    sinks: torch.Tensor | None = None


@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied


class Hidden(NamedTuple):
    """The residual stream between layers. `down` is the last layer's MLP output, not yet
    added to `x`: the next layer's fused add + norm adds it (None before layer 0)."""

    x: torch.Tensor  # [T, hidden]
    down: torch.Tensor | None


@dataclass
class Batch:
    """One step's flat token batch, built by the runner.

    Sequence s owns tokens q_start_list[s]:q_start_list[s+1]; the first `num_decode`
    sequences are decode rows (one token each). ctx_lens[s] counts its cached tokens including
    the new ones. `logits_index` picks each sequence's last token, then the prompt positions
    whose logits give prompt log-probs (`prompt_rows`). Fields named `_list` are
    host lists for the code that loops or sizes grids on the host; their tensor twins are what
    kernels read.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] page * block_size + row
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    ctx_lens: torch.Tensor  # int32 [S]
    ctx_lens_list: list[int]
    q_start_list: list[int]  # [S+1]
    q_start_tensor: torch.Tensor  # int32 [S+1], q_start_list as a tensor (the prefill kernels)
    num_decode: int
    logits_index: torch.Tensor  # [S + sum of prompt_rows' counts]
    lora: object | None  # kernels.LoraMeta, None when no row has an adapter
    # Steps with prompts: the prefill attention kernel's work list, the prompts' tiles
    # (slora.kernels.tiles), and how many programs walk it (None: one per tile).
    tiles: torch.Tensor | None = None  # int32 [1 + 2 * capacity]
    tile_programs: int | None = None
    # Steps with prompts and decode rows: the context lengths of the first n sequences, for
    # the decode attention kernel (the decode rows; a graph's bucket pads it with 1s).
    dec_ctx_lens: torch.Tensor | None = None  # int32 [n]
    # Prompt log-probs: (sequence, first position, count) of the logits rows after the S
    # sequences' own, in order: that sequence's positions first.. first+count-1 (host only).
    prompt_rows: tuple[tuple[int, int, int], ...] = ()

    def to(self, device: torch.device) -> "Batch":
        """The same batch with every tensor on `device` (host-side lists stay)."""
        return _to(self, device)


def _h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A host tensor goes to a GPU through pinned memory without blocking: a
    pageable copy synchronises the stream, so an eager step launched while the step before it
    runs (async scheduling) would wait for it."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _to(obj, device, moved: dict | None = None):
    """Copy of a dataclass with its tensors (and nested dataclasses') moved to `device`; a
    tensor two fields share (LoraMeta.seg_start is Batch.q_start_tensor) moves once."""
    moved = {} if moved is None else moved
    changes = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            if id(value) not in moved:
                moved[id(value)] = _h2d(value, device)
            changes[name] = moved[id(value)]
        elif hasattr(value, "__dataclass_fields__"):
            changes[name] = _to(value, device, moved)
        elif isinstance(value, dict):
            changes[name] = {k: _to(v, device, moved) if hasattr(v, "__dataclass_fields__") else v
                             for k, v in value.items()}
    return replace(obj, **changes)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequencies of each served head's rotated pairs: `hf_inv_freq` of the
    rotary_dim elements HF turns, then zeros (cos 1, sin 0) for the pairs of elements it
    leaves alone (`ModelConfig.rotary_permutation`)."""
    inv = hf_inv_freq(cfg)
    return torch.cat((inv, inv.new_zeros(cfg.head_dim // 2 - inv.shape[0])))


def hf_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with linear, llama3, YaRN or LongRoPE (its short factors)
    scaling, as HF computes them. (YaRN's and LongRoPE's attention factor is in
    `cfg.attn_scale`.)"""
    d = cfg.rotary
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if cfg.rope_kind == "longrope":  # the short factors (ModelConfig.context_window)
        shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        return 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32)
                      * cfg.rope_theta ** shape)
    factor = s["factor"]
    if cfg.rope_kind == "linear":
        return inv / factor
    if cfg.rope_kind == "yarn":
        # Dimensions that turn fewer than beta_slow times over the pretraining length are
        # interpolated (divided by `factor`), those that turn more than beta_fast times are
        # kept, with a linear ramp between (the YaRN paper's NTK-by-parts).
        def dim_of(turns):  # the dimension that turns `turns` times over that length
            return d * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi)) \
                / (2 * math.log(cfg.rope_theta))
        lo, hi = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
        if s["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo if hi != lo else 0.001)
                ).clamp(0, 1)
        pos = cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)  # 1 / inv
        keep = 1 - ramp
        return 1.0 / (factor * pos) * (1 - keep) + inv * keep
    # llama3: long wavelengths scaled by `factor`, short ones kept, a smooth ramp between.
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def grouped_gemm(like: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (`torch._grouped_mm`) serves tensors like `like` without a
    host sync: on the CPU, and on CUDA in bfloat16 from compute capability 9.0 (its CUTLASS
    kernels); elsewhere it loops over the groups on the host."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if like.device.type == "cpu":
        return True
    return (like.device.type == "cuda" and like.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(like.device) >= (9, 0))


class LlamaModel:
    """The decoder as three steps a caller can run piece by piece:

        h = model.embed(b, pool)                        the residual stream entering layer 0
        h = model.layers(b, pool, h, start, end)        layers start..end-1
        logits = model.head(b, h, pool)

    `forward` runs them over every layer. An eager step waits for each piece's adapter copies
    between `layers` calls; a CUDA graph captures each piece as one `layers` call. Any cut
    into pieces runs the same kernels in the same order as `forward`.

    Under tensor parallelism (`tp`, a slora.distributed.TensorParallel) `cfg` is this rank's
    view and `weights` its shard: the embedding lookup and the logits are gathered over the
    vocabulary's shards, and o's and down's partial outputs are summed over the ranks.
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, backend, block_size: int,
                 tp=None, max_added: int = 0, experts: str = "auto") -> None:
        self.cfg = cfg
        self.tp = tp
        # EngineConfig.max_added_tokens: logits are [S, vocab + max_added], the columns past
        # the vocabulary a row's adapter's added tokens (-inf past its own)
        self.max_added = max_added
        self.w = weights
        self.backend = backend
        self.block_size = block_size
        # Each layer's (rotary inverse frequencies, attention scale): the model's; on sliding
        # layers with a rope of their own (Gemma 3, OLMo 3) that rope's, unscaled, and the
        # scale without its attention factor; on layers without rotary (SmolLM3, EXAONE 4,
        # Cohere 2) frequencies of zero (cos 1, sin 0 leave q and k as they are).
        full = rope_inv_freq(cfg).to(weights.embed.device)
        local = full if cfg.rope_local_theta is None else rope_inv_freq(
            replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)).to(full.device)
        none = torch.zeros_like(full)
        self.rope = [(none if layer in cfg.nope_layers else local if cfg.window(layer) else full,
                      cfg.attn_scale_local if cfg.window(layer) else cfg.attn_scale)
                     for layer in range(cfg.num_layers)]
        # Gemma's scale rounded to the dtype, as HF multiplies by a tensor of it; Granite's
        # multiplier as it is, as HF multiplies by the float
        self.embed_scale = cfg.embed_multiplier if cfg.embed_scale is None else float(
            torch.tensor(cfg.embed_scale, dtype=weights.embed.dtype))
        self.act_mul = backend.gelu_tanh_mul if cfg.hidden_act == "gelu_pytorch_tanh" \
            else backend.silu_mul
        # the experts' GLU: the backend's where it has one (SwiGLU, GeGLU), else the twin
        # (gpt-oss's clamped SwiGLU, whose model has no dense MLP), past the fused kernels' rows
        self.glu = ref.Glu(cfg.hidden_act, cfg.swiglu_limit, cfg.swiglu_alpha)
        self.experts_act = self.glu if cfg.hidden_act == "swiglu_oai" else self.act_mul
        # EngineConfig.moe_experts: a mixture of experts' picked experts in the backend's
        # few-rows kernels (`backend.experts`) for steps of up to `fused_experts_rows` rows,
        # past them as grouped GEMMs (`ref.experts_grouped`) or every expert on every token
        # (`ref.experts_dense`)
        served = grouped_gemm(weights.embed)
        if cfg.num_experts and experts == "grouped" and not served:
            raise ConfigError(f"EngineConfig.moe_experts='grouped': torch's grouped GEMM needs a "
                              f"host sync in {weights.embed.dtype} on {weights.embed.device} "
                              "(served: the CPU, or bfloat16 on CUDA from compute capability "
                              "9.0); use 'dense' or 'auto'")
        few = backend.fused_experts_rows(cfg.num_experts, cfg.experts_per_token) \
            if cfg.num_experts else 0
        if cfg.num_experts and experts == "fused" and not few:
            raise ConfigError(f"EngineConfig.moe_experts='fused': the fused experts are Triton "
                              f"kernels, and the backend is '{backend.name}'; use a Triton "
                              "backend ('triton', 'cuda') or moe_experts 'grouped', 'dense' or "
                              "'auto'")
        self.grouped_experts = bool(cfg.num_experts) and (
            experts == "grouped" or experts in ("auto", "fused") and served)
        self.fused_experts_rows = {"auto": few, "fused": 1 << 62 if few else 0}.get(experts, 0)

    @property
    def num_layers(self) -> int:
        return len(self.w.layers)

    @property
    def logits_width(self) -> int:
        """The columns of `head`'s logits: the whole vocabulary (every rank's shard under
        tensor parallelism) and `max_added`."""
        return (getattr(self.cfg, "full_vocab_size", 0) or self.cfg.vocab_size) + self.max_added

    @torch.inference_mode()
    def forward(self, b: Batch, pool: torch.Tensor) -> torch.Tensor:
        """Logits in float32 of each sequence's last token (and the prompt log-prob rows)."""
        return self.head(b, self.layers(b, pool, self.embed(b, pool), 0, self.num_layers), pool)

    @torch.inference_mode()
    def embed(self, b: Batch, pool: torch.Tensor) -> Hidden:
        """The token embeddings (Gemma: times embed_scale rounded to their dtype, as HF
        does; Granite: times its embedding multiplier), with each token's adapter's embedding
        LoRA (its rows in layer 0's slot of the adapter's pages, not scaled, as PEFT adds it):
        the residual stream before layer 0. A
        token past the base vocabulary (an adapter-added one; the engine admits it only with
        its adapter) takes its adapter's added embedding row, scaled like the others."""
        ids, vocab = b.input_ids, self.cfg.vocab_size
        if self.tp is not None:
            x = self.tp.embed(self.w.embed, ids)
        elif not self.max_added:
            x = self.w.embed[ids]
        else:
            known = (ids < vocab)[:, None]
            x = torch.where(known, self.w.embed[torch.where(ids < vocab, ids, 0)], 0)
            self.backend.added_embed(x, ids, pool[0], b.lora, vocab)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        self.backend.embed_lora(x, ids, pool[0], b.lora)
        return Hidden(x, None)

    @torch.inference_mode()
    def layers(self, b: Batch, pool: torch.Tensor, hidden: Hidden, start: int, end: int) -> Hidden:
        """The residual stream after layers start..end-1, given `hidden` entering layer `start`."""
        cfg, be = self.cfg, self.backend
        x, down = hidden
        for layer in range(start, end):
            lw = self.w.layers[layer]
            kc, vc = ref.kv_views(pool[layer], self.block_size, cfg.num_kv_heads, cfg.head_dim)
            x, h = self._add_norm(x, down, lw.ln1, lw.qkv)
            # qkv, o, gate_up and down may come back `Pending` (their LoRA rows added by the
            # kernel they go to) where that kernel is attention (the q/k norm first, where the
            # family has one), the residual add or the GLU, as here; down's goes to the next
            # layer's residual add, so not from the last layer of this call (a graph piece
            # hands on a tensor)
            qkv = be.linear_lora(h, lw.qkv, lw.qkv_bias, pool[layer], b.lora, layer, "qkv",
                                 defer=True)
            inv_freq, scale = self.rope[layer]
            attn = be.rope_attention(qkv, inv_freq, kc, vc, b, scale, cfg.num_heads,
                                     cfg.num_kv_heads, window=cfg.window(layer),
                                     softcap=cfg.attn_softcap or 0.0, sinks=lw.sinks,
                                     qk_norm=self._qk_norm(lw))
            o = be.linear_lora(attn.reshape(-1, cfg.q_size), lw.o, lw.o_bias, pool[layer],
                               b.lora, layer, "o",
                               defer=lw.post_attn is None and not cfg.parallel_block)
            if self.tp is not None:
                self.tp.all_reduce(o)
            if lw.post_attn is not None:
                o = be.rms_norm(o, lw.post_attn, cfg.rms_norm_eps, center=cfg.layer_norm)
            if not cfg.parallel_block:  # (else the MLP reads attention's input, h)
                x, h = self._add_norm(x, o, lw.ln2, lw.gate_up)
            if lw.experts is None:
                down = self._mlp(h, lw, b, pool, layer,
                                 defer=(lw.post_mlp is None and layer < end - 1
                                        and not cfg.parallel_block))
            else:
                down = self._experts(h, lw.experts)
                if lw.gate_up is not None:  # the shared expert, gated per token
                    gate = torch.sigmoid(torch.nn.functional.linear(h, lw.shared_gate))
                    down = down + gate * self._mlp(h, lw, b, pool, layer, defer=False)
            if self.tp is not None:
                self.tp.all_reduce(down)
            if lw.post_mlp is not None:
                down = be.rms_norm(down, lw.post_mlp, cfg.rms_norm_eps, center=cfg.layer_norm)
            if cfg.parallel_block:  # both branches join the residual stream at the next add
                down = o + down
        return Hidden(x, down)

    def _add_norm(self, x: torch.Tensor, delta, weight: torch.Tensor | None, feeds):
        """(the residual stream x + delta, its RMSNorm under `weight`: the input of the GEMM
        whose weight is `feeds`). delta None: x as it is (layer 0). weight None (OLMo 2, whose
        layers norm their outputs, not their inputs): the sum is the GEMM's input, and
        `delta` is a tensor (its producer does not defer to this add)."""
        be, eps, center = self.backend, self.cfg.rms_norm_eps, self.cfg.layer_norm
        if weight is None:
            x = x if delta is None else x + delta
            return x, x
        if delta is None:
            return x, be.rms_norm(x, weight, eps, feeds=feeds, center=center)
        return be.add_rms_norm(x, delta, weight, eps, feeds=feeds, center=center)

    def _mlp(self, h: torch.Tensor, lw: LayerWeights, b: Batch, pool: torch.Tensor, layer: int,
             defer: bool):
        """The dense MLP with each row's LoRA: down(act(gate) * up). `defer`: down's LoRA rows
        may come back `Pending`, for the next residual add to add."""
        be = self.backend
        gate_up = be.linear_lora(h, lw.gate_up, None, pool[layer], b.lora, layer, "gate_up",
                                 defer=True)
        act = self.act_mul(gate_up, feeds=lw.down)
        return be.linear_lora(act, lw.down, None, pool[layer], b.lora, layer, "down", defer=defer)

    def _experts(self, h: torch.Tensor, ex: Experts) -> torch.Tensor:
        """A mixture-of-experts MLP: the router's top experts_per_token (`ref.route`), each
        picked expert's GLU times its weight, summed. Up to `fused_experts_rows` rows: the
        backend's few-rows kernels (slora.kernels.experts); past them, `grouped_experts`: the
        picked experts alone, as grouped GEMMs (`ref.experts_grouped`); else every expert on
        every token (`ref.experts_dense`). Each keeps a step's shapes independent of the
        routing, so a CUDA graph captures it like any other (grouped where `grouped_gemm`
        holds)."""
        cfg = self.cfg
        if h.shape[0] <= self.fused_experts_rows:
            return self.backend.experts(h, ex, cfg.experts_per_token, cfg.norm_topk_prob,
                                        self.glu)
        weights, pick = ref.route(h, ex.router, cfg.experts_per_token, cfg.norm_topk_prob,
                                  ex.router_bias)
        run = ref.experts_grouped if self.grouped_experts else ref.experts_dense
        return run(h, ex.gate_up, ex.down, weights, pick, self.experts_act, ex.gate_up_bias,
                   ex.down_bias)

    def _qk_norm(self, lw: LayerWeights) -> ref.QkNorm | None:
        """The layer's q and k norms (ModelConfig.qk_norm), which attention applies to q|k|v
        after the projection and its LoRA, before rotary: each head over its head_dim
        elements under one weight (Qwen3's and Gemma 3's q_norm, k_norm) or a weight of each
        head's own (Cohere's, a LayerNorm: `layer_norm`); or a token's whole q and whole k
        (OLMo 2's). None where the family has none."""
        cfg = self.cfg
        if lw.q_norm is None:
            return None
        return ref.QkNorm(lw.q_norm, lw.k_norm, cfg.rms_norm_eps,
                          None if cfg.qk_norm == "all" else cfg.head_dim, cfg.layer_norm)

    @torch.inference_mode()
    def head(self, b: Batch, h: Hidden, pool: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab + max_added] in float32 of the rows `b.logits_index` picks (each
        sequence's last token, then any prompt log-prob positions), from the last layer's
        residual stream, with each row's adapter's lm_head LoRA and added tokens' logits
        (their rows in the last layer's slot of the adapter's pages). `out` (float32 [R,
        vocab + max_added]): written and returned instead of a new tensor."""
        x = (h.x + h.down)[b.logits_index]
        x = self.backend.rms_norm(x, self.w.norm, self.cfg.rms_norm_eps,
                                  center=self.cfg.layer_norm)
        logits = self.backend.linear(x, self.w.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        self.backend.head_lora(logits, x, pool[-1], b.lora)
        cap, divisor = self.cfg.final_softcap, self.cfg.logits_scaling
        if divisor != 1.0:  # (Granite's logits_scaling)
            logits = logits / divisor
        if cap:
            logits = ref.cap_logits(logits, cap)
        if not self.max_added:
            return logits.float() if out is None else out.copy_(logits)
        added = self.backend.added_logits(x, pool[-1], b.lora, self.max_added)
        if divisor != 1.0:
            added = added / divisor
        if cap:  # (-inf, an added token not the row's adapter's, stays -inf)
            added = torch.where(added.isneginf(), added, ref.cap_logits(added, cap))
        if out is None:
            return torch.cat((logits.float(), added), dim=1)
        out[:, :logits.shape[1]] = logits
        out[:, logits.shape[1]:] = added
        return out
