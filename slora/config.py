"""Configuration: one frozen `EngineConfig`, validated once, passed through constructors.

`ModelConfig` is read from a Hugging Face `config.json` and describes the Llama-family
architecture (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text) that
`slora.model.llama` implements.
No torch import here: the simulator and the scheduler read these too.
"""

from __future__ import annotations

import json
import math
import numbers
from os import PathLike
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

BACKENDS = ("auto", "torch", "triton", "cuda")
DECODE_LORA = ("auto", "mbgmv", "segments", "hybrid")  # slora.kernels.segments
MOE_EXPERTS = ("auto", "fused", "grouped", "dense")  # EngineConfig.moe_experts
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's, read as the DTYPES they name
POLICIES = ("fcfs", "cluster", "abort", "fair", "priority")
QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization's values besides None
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Adapter rows in pool pages start at multiples of this many elements (see kernels/reference.py).
LORA_ALIGN = 64

# The seven linear modules LoRA may target, in the order adapters are laid out in their pages.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The vocabulary modules a LoRA may target besides the decoder's linear layers: the input
# embedding (its A gathered by token id) and the output head. Their rows live in one layer's
# slot of the adapter's pages each (core.adapters.AdapterLayout).
VOCAB_MODULES = ("embed_tokens", "lm_head")
MAX_ADDED_TOKENS = 256  # EngineConfig.max_added_tokens' bound
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "GemmaForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM",
                           "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                           "HeliumForCausalLM", "Ernie4_5ForCausalLM", "GlmForCausalLM",
                           "Glm4ForCausalLM", "Exaone4ForCausalLM", "SeedOssForCausalLM",
                           "CohereForCausalLM", "Cohere2ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                           "GraniteMoeForCausalLM", "GptOssForCausalLM")
# Vision-language checkpoints whose text model slora serves -> that model's architecture:
# config.json's text_config, the language model's weights (`ModelConfig.multimodal`)
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
              "Mistral3ForConditionalGeneration": "MistralForCausalLM"}
# config.json's keys outside a text_config that the text model reads where it lacks them
_SHARED_KEYS = ("bos_token_id", "pad_token_id", "tie_word_embeddings")
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The families whose rotary pairs a head's elements (2i, 2i + 1), not (i, i + D/2)
INTERLEAVED_ROPE = ("HeliumForCausalLM", "Ernie4_5ForCausalLM", "GlmForCausalLM",
                    "Glm4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM")
# The families whose attention has q/k/v biases but none on o_proj (Qwen2's always on, Qwen2-MoE's
# unless its qkv_bias is false)
QKV_BIAS_ONLY = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "HeliumForCausalLM", "GlmForCausalLM",
                 "Glm4ForCausalLM")
# The mixtures of experts: architecture -> (its config's key for the experts' count, HF's
# defaults of that count and of num_experts_per_tok). Qwen's and OLMoE's num_experts is written
# num_local_experts by transformers 5.
MOE = {"MixtralForCausalLM": ("num_local_experts", 8, 2),
       "GraniteMoeForCausalLM": ("num_local_experts", 8, 2),
       "Qwen2MoeForCausalLM": ("num_experts", 60, 4),
       "Qwen3MoeForCausalLM": ("num_experts", 128, 8),
       "OlmoeForCausalLM": ("num_experts", 64, 8),
       "GptOssForCausalLM": ("num_local_experts", 128, 4)}
# The MLP activations of [gate | up]: SwiGLU, GeGLU with gelu's tanh approximation, and
# gpt-oss's clamped SwiGLU (its experts' alone: a config's hidden_act names one of the first two).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")
# The rope_scaling types served (rope_inv_freq in slora/model/llama.py computes each).
ROPE_KINDS = ("linear, llama3, yarn, longrope (Phi-3's, served within its "
              "original_max_position_embeddings)")
# Checkpoint modules that stack several of LORA_MODULES by output rows, in this order (Phi-3's
# qkv_proj and gate_up_proj). A LoRA on one is the LoRAs of its parts with its A shared and its
# B split by the same rows.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}


def is_int(x) -> bool:
    """An integer value, not a bool: 2.5 and True are not counts, ids or seeds."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_seed(x) -> bool:
    """An integer that fits 64 bits, signed or not (what torch.Generator.manual_seed takes)."""
    return is_int(x) and -(1 << 63) <= x < (1 << 64)


def _of_type(value, annotation: str) -> bool:
    """Whether `value` fits a field annotation such as "int", "float | None" or "str": ints
    are ints (not bools, not 2.5), floats are finite numbers, None only where it is allowed."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return "int" in kinds or "float" in kinds
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    return "str" in kinds and isinstance(value, str)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the reason."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, fixed at construction.

    model: a local Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
        None means the embedded default (SmolLM2-135M-Instruct, see `slora.model.smollm`).
    device: "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU) or an explicit torch dtype name (vLLM's
        "half" and "float" are read as float16 and float32).
    block_size: tokens per KV page. A page holds K and V of `block_size` tokens for every layer.
    num_pages: pages in the pool. None sizes the pool from `gpu_memory_fraction` on CUDA or
        `cpu_pool_gb` on CPU.
    max_num_seqs / max_batch_tokens: per-step batch limits (sequences, tokens computed).
    max_prefill_chunk: chunked prefill. A step computes at most this many prompt tokens, its
        prompts' chunks together (decode rows come first and on top, within max_batch_tokens):
        a prompt longer than what is left is cut, its rest computed in later steps, each chunk
        attending to the KV of those before it. A step's prompt work, and with it the time
        decode rows wait, is bounded; a prompt of any length up to max_model_len runs. 0:
        prompts run whole (a prompt longer than max_batch_tokens runs in a step alone).
        Where graphs replay steps with prompts and a chunk fits mixed_graph_tokens, a step's
        chunk leaves room there for its decode rows (unless that would leave under half of
        it), so the step replays a graph rather than running eagerly.
    max_model_len: longest sequence (prompt + output); None means the model's context window
        (`ModelConfig.context_window`), capped by what the pool can hold. A value past the
        window or the pool is refused (ConfigError) when the engine is built (`max_model_len`).
    backend: kernels. "auto" is triton on CUDA and torch on CPU.
    host_cache_gb: bound of the host-memory LRU tier that holds adapters between disk and the pool.
    policy: queue order, one of `POLICIES` (see slora.core.policies).
    quantization: None (the base model's weights in `dtype`) or "fp8": the base model's linear
        layers (q/k/v/o, gate/up/down) in FP8 E4M3 with one scale per output channel
        (slora.model.quant), quantized at load time; embeddings, lm_head, norms and adapters
        stay in `dtype`.
    tensor_parallel_size: devices the model is sharded over (slora.distributed): one process
        per device, the engine's own being rank 0; heads, the MLP and the vocabulary are split
        across them. The model's heads must split evenly (see `distributed.check_degree`).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_pages: int | None = None
    gpu_memory_fraction: float = 0.85
    cpu_pool_gb: float = 1.0
    max_num_seqs: int = 256
    max_batch_tokens: int = 8192
    max_prefill_chunk: int = 2048
    max_model_len: int | None = None
    backend: str = "auto"
    host_cache_gb: float = 8.0
    policy: str = "fcfs"
    # adapter clustering: the most steps a request may be passed over before it goes first.
    max_skips: int = 64
    # S-LoRA's SLO: first token within this many seconds (early-abort policy, metrics).
    slo_ttft_s: float = 6.0
    # Prefetch: adapters of the first `prefetch_window` waiting requests are loaded ahead of
    # admission (evicting idle adapters the window does not need), while at least
    # `prefetch_reserve` pages stay free for KV.
    prefetch_window: int = 8
    prefetch_reserve: int = 64
    cuda_graphs: bool = True
    # Steps with prompts of at most this many tokens in all (prompts + decode rows) replay CUDA
    # graphs too (slora.graphs), on a GPU with cuda_graphs; 0 runs them eagerly. A small
    # eager step is bound by the host launching its ~450 Triton kernels, which a graph
    # replays at once.
    mixed_graph_tokens: int = 2048
    # Launch each step before collecting the one before it (vLLM's async scheduling): the
    # host's work for a step (scheduling, the batch, the launch) overlaps the device's for the
    # last one, decode rows take their input ids on the device, and a request that stops
    # computes one token more, dropped. Outputs are the same; Engine.step returns a step's
    # outputs one call later. None (auto): on with CUDA, where a launch returns before the
    # device is done, off on CPU, where it computes the step; the simulator takes its
    # profile's order (`Profile.async_scheduling`).
    async_scheduling: bool | None = None
    # Base GEMMs (q/k/v, o, gate/up, down, lm_head) of at most this many rows run through
    # slora's few-rows Triton kernel on CUDA (slora.kernels.gemm: it streams a decode step's
    # weights faster than cuBLAS at few rows), cuBLAS past them, which is faster from 64 rows
    # up; 0: cuBLAS always. CPU runs F.linear whatever this is.
    gemm_max_rows: int = 32
    # The LoRA of a step's decode rows on the GPU backends, prompts beside them or not:
    # "mbgmv" (each row its own programs), "segments" (the rows grouped by adapter, each
    # adapter's tiles read once for up to 16 rows: slora.kernels.segments), "auto" (each
    # adapter's rows grouped where the GPU's table says they are many and large enough, the
    # others through MBGMV) or "hybrid" ("auto"'s split with both kernels in every step).
    decode_lora: str = "auto"
    # A mixture of experts' MLP (slora.kernels.reference): "fused" runs the routing and each
    # (token, picked expert) pair's GLU as Triton kernels reading the experts' weights as they
    # lie (slora.kernels.experts: a weight stream, for few rows; the Triton backends only);
    # "grouped" runs each token's picked experts alone as grouped GEMMs (torch._grouped_mm: on
    # the CPU, or in bfloat16 on CUDA from compute capability 9.0, where it needs no host sync
    # and CUDA graphs capture it); "dense" runs every expert on every token as batched GEMMs
    # (num_experts / experts_per_token times the FLOPs); "auto" fused for a step of few rows
    # on the Triton backends (experts.few_rows), else grouped where it is served, else dense.
    moe_experts: str = "auto"
    # "auto" reads the weights; "dummy" makes random ones of the model's shapes (benchmarks
    # on a config.json alone, as vLLM's load_format="dummy").
    load_format: str = "auto"
    seed: int = 0
    # The most top log-probs a request may ask for (SamplingParams.logprobs), as vLLM's
    # max_logprobs: each costs a top-k over the vocabulary per generated token.
    max_logprobs: int = 20
    quantization: str | None = None
    # Prefix caching (slora.core.prefix): full KV pages stay cached, keyed by the adapter's
    # content, the request's cache_salt and every token up to them, and a request whose
    # prefix is cached computes only the rest. Cached pages no request holds are reclaimed
    # with idle adapters in one least-recently-used order.
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # The most tokens one adapter may add past the base vocabulary (its tokenizer's added
    # tokens, their embedding and lm_head rows in its pages), as vLLM's lora_extra_vocab_size:
    # every step's logits are this many columns wider, -inf in a row past its adapter's own
    # added tokens. 0: adapters that add tokens are refused.
    max_added_tokens: int = 0
    # The largest LoRA rank an adapter may have in any module (vLLM's max_lora_rank): a larger
    # one is refused when it is registered, naming both. None: any rank (the pool's pages are
    # rank-granular, so no rank sizes a buffer).
    max_lora_rank: int | None = None
    # torch's intra-op CPU threads (`torch.set_num_threads`, process-wide) once an engine on a
    # GPU starts. Its host work is small metadata tensors a step (the batch, the adapters'
    # pages and ranks, the graphs' inputs), where a pool of threads only adds the wake-up
    # and barrier of each parallel region, and now and then a stall of a whole step
    # (docs/performance.md). Adapter reads from disk (packing into pages, the finite check,
    # pinning) run on the count torch had before. 0: torch's own setting. On CPU the model
    # computes on the host, and this is not applied.
    host_threads: int = 1

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.model, PathLike):
            object.__setattr__(self, "model", str(self.model))
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        for f in fields(self):  # types first: the range checks below compare numbers
            need(_of_type(getattr(self, f.name), f.type), f.name, f"expected {f.type}")

        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             "device", "expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
        need(self.dtype in DTYPES, "dtype", f"expected one of {DTYPES} (or vLLM's "
             f"{', '.join(DTYPE_ALIASES)})")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "block_size", "must be a power of two")
        need(self.num_pages is None or self.num_pages >= 2, "num_pages", "must be at least 2")
        need(0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction", "must be in (0, 1]")
        need(self.cpu_pool_gb > 0, "cpu_pool_gb", "must be positive")
        need(1 <= self.max_num_seqs <= 65535, "max_num_seqs",
             "must be in [1, 65535] (a decode row is a grid row of the MBGMV expand)")
        need(self.max_batch_tokens >= 1, "max_batch_tokens", "must be at least 1")
        need(self.max_prefill_chunk >= 0, "max_prefill_chunk",
             "must be >= 0 (0: prompts run whole, unchunked)")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
             "must be at least 2")
        need(self.backend in BACKENDS, "backend", f"expected one of {BACKENDS}")
        need(self.host_cache_gb >= 0, "host_cache_gb", "must be >= 0")
        need(self.policy in POLICIES, "policy", f"expected one of {POLICIES}")
        need(self.max_skips >= 0, "max_skips", "must be >= 0")
        need(self.slo_ttft_s > 0, "slo_ttft_s", "must be positive")
        need(self.prefetch_window >= 0, "prefetch_window", "must be >= 0")
        need(self.prefetch_reserve >= 0, "prefetch_reserve", "must be >= 0")
        need(self.load_format in ("auto", "dummy"), "load_format", "expected 'auto' or 'dummy'")
        need(self.mixed_graph_tokens >= 0, "mixed_graph_tokens", "must be >= 0 (0: eager)")
        need(self.gemm_max_rows >= 0, "gemm_max_rows", "must be >= 0 (0: cuBLAS always)")
        need(self.max_logprobs >= 0, "max_logprobs", "must be >= 0")
        need(0 <= self.max_added_tokens <= MAX_ADDED_TOKENS, "max_added_tokens",
             f"must be in [0, {MAX_ADDED_TOKENS}] (the added tokens are rank rows of the LoRA "
             "kernels)")
        need(self.decode_lora in DECODE_LORA, "decode_lora", f"expected one of {DECODE_LORA}")
        need(self.moe_experts in MOE_EXPERTS, "moe_experts", f"expected one of {MOE_EXPERTS}")
        need(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
             f"expected None or one of {QUANTIZATIONS}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        need(self.host_threads >= 0, "host_threads", "must be >= 0 (0: torch's own setting)")
        need(self.max_lora_rank is None or self.max_lora_rank >= 1, "max_lora_rank",
             "must be at least 1 (or None: any rank)")

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    def replace(self, **changes) -> "EngineConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family architecture, as read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama when attention_bias is set)
    o_bias: bool  # bias on o_proj (Llama's attention_bias covers o too; Qwen2 has none)
    mlp_bias: bool
    bos_token_id: int | None
    # config.json's eos_token_id, and generation_config.json's beside it (vLLM's stop ids:
    # gpt-oss ends a tool call with <|call|>, which only the latter names)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # An RMSNorm on q and on k after the projection, before rotary: "head" (Qwen3, Gemma 3
    # and EXAONE 4) over each head's head_dim elements (weights q_norm, k_norm [head_dim]);
    # "heads" (Cohere's use_qk_norm) the same with a weight of each head's own ([q_size],
    # [kv_size]); "all" (OLMo 2 and 3, OLMoE) over a token's whole q and whole k (weights
    # [q_size], [kv_size]); None: none.
    qk_norm: str | None = None
    # The FUSED_MODULES the checkpoint holds, which PEFT adapters target by those names:
    # Phi-3's q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`; GLM's gate|up.
    fused_modules: tuple[str, ...] = ()
    # Cohere: every norm (q's and k's too) a LayerNorm without bias, each row's mean taken
    # off before the RMS (`rms_norm_eps` is its layer_norm_eps).
    layer_norm: bool = False
    # Cohere: attention and the MLP read the same normed input and both add to the residual
    # stream (x + attn(ln(x)) + mlp(ln(x))): one norm a layer.
    parallel_block: bool = False
    # A mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE): the MLP of each layer not in
    # `dense_layers` is `num_experts` experts (each a GLU of expert_intermediate_size), of which
    # a router picks `experts_per_token` for each token, their outputs weighted by the router's
    # softmax (renormalised over the picked ones where `norm_topk_prob`). `shared_expert`
    # (Qwen2-MoE): such a layer also runs a dense MLP of intermediate_size on every token, its
    # output times sigmoid(shared_gate . x). 0 experts: every layer's MLP is dense.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    shared_expert: bool = False
    # The MLP's activation, one of ACTIVATIONS (Gemma: GeGLU, "gelu_pytorch_tanh"; gpt-oss's
    # experts: "swiglu_oai", (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g) with
    # g = min(gate, limit), limit `swiglu_limit` and alpha `swiglu_alpha`).
    hidden_act: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # gpt-oss: biases on the router's logits and on each expert's gate|up and down outputs.
    experts_bias: bool = False
    # gpt-oss: a learned logit per query head (a layer's `sinks`) that joins the softmax over
    # the head's scores and takes its share of the weight, with no value behind it.
    attention_sinks: bool = False
    # Gemma: each RMSNorm scales by (1 + w); the loader folds the 1 in (see loader.load_weights).
    norm_plus_one: bool = False
    # Gemma: token embeddings multiplied by this (sqrt(hidden_size)), rounded to the model
    # dtype first as HF does; None: not scaled.
    embed_scale: float | None = None
    # Gemma 2/3: an RMSNorm on the attention output (post_attention_layernorm) and one on the
    # MLP output (post_feedforward_layernorm) before each residual add: four norms a layer.
    sandwich_norms: bool = False
    # False (OLMo 2 and 3, EXAONE 4): a layer norms its attention's and its MLP's outputs
    # (post_attention_layernorm, post_feedforward_layernorm) before each residual add, and
    # not their inputs.
    pre_norms: bool = True
    # Attention scores are q.k / sqrt(this) (Gemma's query_pre_attn_scalar); None: head_dim.
    query_pre_attn_scalar: float | None = None
    # Soft-capping, cap * tanh(x / cap), of the attention scores (Gemma 2's
    # attn_logit_softcapping) and of the final logits (final_logit_softcapping); None: off.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Sliding-window attention: the layers in `sliding_layers` attend to the last
    # `sliding_window` positions (their own included), the others to all of them.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Gemma 3, OLMo 3: the rope base of the sliding layers (rope_local_base_freq, or the
    # sliding_attention entry of rope_parameters), unscaled (no YaRN attention factor either:
    # `attn_scale_local`); None: the sliding layers use rope_theta and rope_scaling like the
    # others.
    rope_local_theta: float | None = None
    # SmolLM3: the layers that apply no rotary to q and k (its no_rope_layers' zeros); EXAONE 4
    # with a sliding window, and Cohere 2: their global layers.
    nope_layers: tuple[int, ...] = ()
    # Granite: token embeddings times embed_multiplier (exact, as HF multiplies by the float);
    # each residual branch (attention's and the MLP's output) times residual_multiplier,
    # folded into o_proj's and down_proj's weights and their adapters' B (see
    # loader.load_weights, PeftAdapter); attention scores scaled by attention_multiplier
    # instead of 1 / sqrt(head_dim); logits divided by logits_scaling (Cohere's: 1 /
    # logit_scale, which HF multiplies them by). 1 / None: off.
    embed_multiplier: float | None = None
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Rotary on the first rotary_dim elements of each head (partial_rotary_factor: Phi-4-mini's
    # 0.75), the rest left as they are; 0: head_dim. Served by a fixed permutation of each
    # q and k head's elements (`rotary_permutation`), so the kernels rotate whole heads.
    rotary_dim: int = 0
    # GLM, Helium, Ernie 4.5: rotary pairs element 2i with 2i + 1 (HF's interleaved
    # rotate_half), served by the same permutation.
    interleaved_rope: bool = False
    # The text model of a vision-language checkpoint (`MULTIMODAL`): its weights and adapters'
    # are named under the language model (`loader.text_tensors`), and its vision tower and
    # projector, which text never reaches, are neither loaded nor served.
    multimodal: bool = False

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's or LongRoPE's attention factor (1 for other kinds): HF multiplies the rotated
        elements' cos and sin by it."""
        return self.rope_scaling["attention_factor"] if self.rope_kind in ("yarn", "longrope") \
            else 1.0

    @property
    def rotary(self) -> int:
        """The elements of a head that rotary turns."""
        return self.rotary_dim or self.head_dim

    def rotary_permutation(self) -> list[int] | None:
        """Where each element of a served q or k head comes from in HF's head (None: no
        permutation, every element rotates in the kernels' pairs). HF pairs element i with
        i + r/2 (r = rotary_dim; interleaved: 2i with 2i + 1) and leaves r.. alone; the kernels
        pair i with i + D/2. Served head: the first element of HF's r/2 pairs, half of the
        unrotated ones, the second element of each pair, the other half: served pair (i,
        i + D/2) is HF's pair i for i < r/2 and two unrotated elements past it, whose inverse
        frequency is 0 (cos 1, sin 0). The scores q.k are the same under one permutation
        of both. (The unrotated elements are also divided by the rope's attention factor,
        `loader.served_qk`, which HF applies to the rotated ones alone and slora to the scores.)"""
        d, r = self.head_dim, self.rotary
        if r == d and not self.interleaved_rope:
            return None
        rest = list(range(r, d))
        half = (d - r) // 2
        first, second = ((list(range(0, r, 2)), list(range(1, r, 2))) if self.interleaved_rope
                         else (list(range(r // 2)), list(range(r // 2, r))))
        return first + rest[:half] + second + rest[half:]

    @property
    def rope_kind(self) -> str | None:
        """rope_scaling's type (one of ROPE_KINDS); None without scaling."""
        s = self.rope_scaling
        return None if s is None else s.get("rope_type", s.get("type"))

    @property
    def context_window(self) -> int:
        """The positions the model serves, as vLLM derives them: max_position_embeddings,
        times the factor of a linear rope_scaling; with YaRN its original_max_position_embeddings
        times its factor (or max_position_embeddings, if longer). A llama3 config already
        gives the extended length. LongRoPE: original_max_position_embeddings (its short
        factors' window)."""
        return int(self._context_window()[0])

    def _context_window(self) -> tuple[float, str]:
        """(the window, how it is derived: for error messages)."""
        s, n = self.rope_scaling, self.max_position_embeddings
        if self.rope_kind == "linear":
            return n * s["factor"], f"max_position_embeddings {n} x the linear rope_scaling factor"
        if self.rope_kind == "yarn" and s["original_max_position_embeddings"] * s["factor"] > n:
            return (s["original_max_position_embeddings"] * s["factor"],
                    f"original_max_position_embeddings {s['original_max_position_embeddings']} "
                    "x the yarn rope_scaling factor")
        if self.rope_kind == "longrope":
            orig = s["original_max_position_embeddings"]
            return min(orig, n), (f"original_max_position_embeddings {orig}: LongRoPE is served "
                                  "with its short factors, whose window that is; its long "
                                  "factors, which HF switches to past it, are not served")
        return n, f"max_position_embeddings {n}"

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model directory {path}: no config.json (expected a Hugging Face "
                              "model directory with config.json, *.safetensors and tokenizer.json)")
        cfg = cls.from_dict(json.loads(cfg_file.read_text()), source=str(cfg_file))
        gen_file = path / "generation_config.json"
        if not gen_file.is_file():
            return cfg
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"{gen_file}: not a JSON object ({e})") from None
        return cfg.with_eos(eos, str(gen_file))

    def with_eos(self, eos, source: str) -> "ModelConfig":
        """This config with `eos` (a token id, a list of them, or None) among its stop ids:
        another config file's `eos_token_id` (generation_config.json's, a vision-language
        config's outside its text_config). ConfigError naming `source` for anything else."""
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(is_int(t) and t >= 0 for t in eos):
            raise ConfigError(f"{source}: eos_token_id={eos!r} must be a token id or a list "
                              "of them")
        return replace(self, eos_token_ids=tuple(sorted(set(self.eos_token_ids) | set(eos))))

    @classmethod
    def from_dict(cls, c: dict, source: str = "config") -> "ModelConfig":
        archs = c.get("architectures") or []
        wrapper = next((a for a in archs if a in MULTIMODAL), None)
        if wrapper is not None:
            text = c.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: {wrapper} without a text_config object")
            text = {**{k: c[k] for k in _SHARED_KEYS if k in c}, **text,
                    "architectures": [MULTIMODAL[wrapper]]}
            cfg = cls.from_dict(text, f"{source} (text_config)")
            return replace(cfg, multimodal=True).with_eos(c.get("eos_token_id"), source)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"{source}: architecture {archs or c.get('model_type')!r} is not "
                              f"supported; slora serves {', '.join(SUPPORTED_ARCHITECTURES)}, "
                              f"and the text model of {', '.join(MULTIMODAL)}")
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        head_dim = c.get("head_dim") or hidden // heads
        qkv_bias_only = arch in QKV_BIAS_ONLY
        gemma = arch in GEMMA
        # (Ernie 4.5's use_bias: on q/k/v/o and the MLP)
        bias = bool(c.get("attention_bias", c.get("use_bias",
                                                      arch in ("GlmForCausalLM",
                                                               "GptOssForCausalLM"))))
        # Gemma 2/3's MLP reads hidden_activation (their configs may carry a stale hidden_act
        # too); Gemma 1's reads hidden_act, whose "gelu" HF reads as the tanh approximation
        gemma1 = arch == "GemmaForCausalLM"
        act = (c.get("hidden_activation") if gemma and not gemma1 else None) \
            or c.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
        if gemma1 and act == "gelu":
            act = "gelu_pytorch_tanh"
        gpt_oss = arch == "GptOssForCausalLM"
        if act not in ACTIVATIONS[:2]:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (slora's MLP is "
                              "SwiGLU, silu(gate) * up, or GeGLU, gelu_pytorch_tanh(gate) * up)")
        granite = arch in ("GraniteForCausalLM", "GraniteMoeForCausalLM")
        cohere = arch in ("CohereForCausalLM", "Cohere2ForCausalLM")
        positive = ((("query_pre_attn_scalar", "attn_logit_softcapping",
                      "final_logit_softcapping") if gemma else ())
                    + (("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                        "logits_scaling") if granite else ())
                    + (("logit_scale", "layer_norm_eps") if cohere else ())
                    + (("swiglu_limit", "swiglu_alpha") if gpt_oss else ()))
        for key in positive:
            v = c.get(key)
            if v is not None and not (_of_type(v, "float") and v > 0):
                raise ConfigError(f"{source}: {key}={v!r} must be a number > 0 (or null)")
        if c.get("use_bidirectional_attention"):
            raise ConfigError(f"{source}: use_bidirectional_attention=True is not supported "
                              "(slora serves causal decoders)")
        # transformers >= 5 writes rope_parameters {rope_theta, rope_type, factor, ...}, Gemma
        # 3's and OLMo 3's per layer type ({"full_attention": {...}, "sliding_attention":
        # {...}}); older configs have rope_theta, rope_scaling and Gemma 3's
        # rope_local_base_freq.
        rope = c.get("rope_parameters") or {}
        local_rope = None
        if "full_attention" in rope or "sliding_attention" in rope:
            local_rope = rope.get("sliding_attention") or {}
            rope = rope.get("full_attention") or {}
        gemma3 = arch == "Gemma3ForCausalLM"
        theta = c.get("rope_theta", rope.get("rope_theta", 1e6 if gemma3 else 10000.0))
        local_theta = None
        if gemma3 or arch == "Olmo3ForCausalLM":  # the sliding layers' own, unscaled rope
            local_rope = local_rope or {}
            if local_rope.get("rope_type", "default") != "default":
                raise ConfigError(f"{source}: rope type {local_rope['rope_type']!r} on the "
                                  "sliding-window layers is not supported (default only)")
            local_theta = c.get("rope_local_base_freq", local_rope.get(
                "rope_theta", 10000.0 if gemma3 else theta))
        partial = c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * partial) if _of_type(partial, "float") and 0 < partial <= 1 \
            else 0
        if rotary_dim < 2 or rotary_dim % 2:
            raise ConfigError(f"{source}: partial_rotary_factor={partial!r} must be a number in "
                              f"(0, 1] that rotates an even number (>= 2) of head_dim {head_dim}")
        qk_norm = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head",
                   "Gemma3ForCausalLM": "head",
                   "Olmo2ForCausalLM": "all", "Olmo3ForCausalLM": "all", "OlmoeForCausalLM": "all",
                   "Exaone4ForCausalLM": "head"}.get(arch)
        if cohere and c.get("use_qk_norm"):
            qk_norm = "heads"
        if rotary_dim != head_dim and qk_norm:
            raise ConfigError(f"{source}: partial_rotary_factor={partial!r} with q/k norms is "
                              "not supported (a whole rotary only)")
        scaling = c.get("rope_scaling") or (rope or None)
        max_pos = c.get("max_position_embeddings", 4096)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            # (HF's Phi-3 reads "su" and "yarn" as LongRoPE)
            if kind in ("su", "yarn") and arch == "Phi3ForCausalLM":
                kind = "longrope"
            if kind not in ("default", "linear", "llama3", "yarn", "longrope"):
                raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported "
                                  f"(supported: {ROPE_KINDS})")
            if kind == "default":
                scaling = None
            elif kind == "yarn":
                scaling = _yarn(scaling, c, max_pos, source)
            elif kind == "longrope":
                scaling = _longrope(scaling, c, max_pos, rotary_dim, gemma3, source)
        window, sliding = _sliding_layers(c, arch, source)
        moe = _experts(c, arch, source)
        nope = _nope_layers(c, source) if arch == "SmolLM3ForCausalLM" else ()
        # rotary on the sliding layers alone: Cohere 2 always, EXAONE 4 with a sliding window
        if arch == "Cohere2ForCausalLM" or (arch == "Exaone4ForCausalLM"
                                             and c.get("sliding_window") is not None):
            nope = tuple(i for i in range(c["num_hidden_layers"]) if i not in sliding)
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            intermediate_size=(c["shared_expert_intermediate_size"] if moe["shared_expert"]
                               else c["intermediate_size"]),
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("layer_norm_eps", 1e-5) if cohere else c.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=(arch == "Qwen2ForCausalLM" or bias or (
                arch == "Qwen2MoeForCausalLM" and c.get("qkv_bias", True) is not False)),
            o_bias=(bool(c.get("attention_out_bias")) if arch == "SeedOssForCausalLM"
                    else bias and not qkv_bias_only),
            mlp_bias=bool(c.get("mlp_bias", c.get("use_bias", False))),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=qk_norm,
            fused_modules={"Phi3ForCausalLM": ("qkv_proj", "gate_up_proj"),
                           "GlmForCausalLM": ("gate_up_proj",),
                           "Glm4ForCausalLM": ("gate_up_proj",)}.get(arch, ()),
            # (gpt-oss's config says "silu"; its experts apply their own clamped SwiGLU)
            hidden_act="swiglu_oai" if gpt_oss else act,
            swiglu_limit=float(c.get("swiglu_limit") or 7.0),
            swiglu_alpha=float(c.get("swiglu_alpha") or 1.702),
            experts_bias=gpt_oss,
            attention_sinks=gpt_oss,
            norm_plus_one=gemma,
            embed_scale=hidden ** 0.5 if gemma else None,
            sandwich_norms=arch in (*GEMMA[1:], "Glm4ForCausalLM"),
            pre_norms=arch not in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM"),
            query_pre_attn_scalar=c.get("query_pre_attn_scalar") if gemma else None,
            attn_softcap=c.get("attn_logit_softcapping") if gemma else None,
            final_softcap=c.get("final_logit_softcapping") if gemma else None,
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=local_theta,
            nope_layers=nope,
            embed_multiplier=c.get("embedding_multiplier") if granite else None,
            residual_multiplier=c.get("residual_multiplier") or 1.0 if granite else 1.0,
            attention_multiplier=c.get("attention_multiplier") if granite else None,
            logits_scaling=(c.get("logits_scaling") or 1.0 if granite
                            else 1 / (c.get("logit_scale", 0.0625) or 1.0) if cohere
                            else 1.0),
            layer_norm=cohere,
            parallel_block=cohere,
            **moe,
            rotary_dim=rotary_dim,
            interleaved_rope=arch in INTERLEAVED_ROPE,
        )

    @property
    def attn_scale(self) -> float:
        """The attention scores' scale: Granite's attention_multiplier, else 1 /
        sqrt(query_pre_attn_scalar or head_dim); times the square of YaRN's or LongRoPE's
        attention factor.
        (HF multiplies the rotary's cos and sin by that factor, so q and k each carry it;
        slora rotates without it and scales the scores.)"""
        m = self.rope_attention_factor
        return self._plain_scale * m * m

    @property
    def attn_scale_local(self) -> float:
        """The sliding layers' scores' scale: `attn_scale`, without the rope's attention factor
        where those layers have a rope of their own (rope_local_theta)."""
        return self.attn_scale if self.rope_local_theta is None else self._plain_scale

    @property
    def _plain_scale(self) -> float:
        """The scores' scale before any rope attention factor."""
        return self.attention_multiplier or (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in positions; 0 where it attends to all of them."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def checkpoint_modules(self) -> tuple[str, ...]:
        """The linear modules' names in the checkpoint (and in PEFT adapters' keys) that
        adapters may target: each of LORA_MODULES, or the fused module that holds it; the
        attention's alone where no layer has a dense MLP (experts alone: Mixtral, Qwen3-MoE)."""
        mlp = not self.num_experts or self.shared_expert or bool(self.dense_layers)
        names = [next((f for f in self.fused_modules if m in FUSED_MODULES[f]), m)
                 for m in LORA_MODULES[:None if mlp else 4]]
        return tuple(dict.fromkeys(names))

    def experts_in(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return bool(self.num_experts) and layer not in self.dense_layers

    def dense_mlp(self, layer: int) -> bool:
        """Whether layer `layer` runs a dense MLP (gate/up/down of intermediate_size, which
        adapters may target): its only one, or a shared expert beside its experts."""
        return self.shared_expert or not self.experts_in(layer)

    def mlp_path(self, layer: int) -> str:
        """The module path of layer `layer`'s dense MLP under model.layers.N (its gate_proj,
        up_proj and down_proj, in checkpoints and adapters): Qwen2-MoE's shared expert in a
        layer of experts."""
        return "mlp.shared_expert" if self.shared_expert and self.experts_in(layer) else "mlp"

    def module_dims(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of one LoRA-targetable linear module (or of a FUSED_MODULES one, or a
        VOCAB_MODULES one: embed_tokens maps a one-hot over the vocabulary to hidden)."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "embed_tokens": (self.vocab_size, h),
            "lm_head": (h, self.vocab_size),
            "qkv_proj": (h, self.q_size + 2 * self.kv_size),
            "gate_up_proj": (h, 2 * i),
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]

    def page_size(self, block_size: int) -> int:
        """Elements of one pool page in one layer: K and V of `block_size` tokens."""
        return block_size * 2 * self.kv_size

    def weight_bytes(self, dtype_bytes: int, quantization: str | None = None) -> int:
        """Bytes of the base model's weights (biases left out). quantization "fp8": the linear
        layers' weights take one byte each and a 4-byte scale per output channel."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        e, ei = self.num_experts, self.expert_intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        linear = rows = 0  # over the layers: weights, output channels (a scale each in FP8)
        for layer in range(L):
            dense, moe = self.dense_mlp(layer), self.experts_in(layer)
            # (a layer of experts: each expert's, the router's [experts, hidden] and a shared
            # expert's gate [1, hidden])
            linear += (attn + 3 * h * i * dense
                       + moe * (3 * h * ei * e + e * h + h * self.shared_expert))
            rows += (self.q_size + 2 * self.kv_size + h + (2 * i + h) * dense
                     + moe * ((2 * ei + h) * e + e + self.shared_expert))
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        per_layer = (4 if self.sandwich_norms else 1 if self.parallel_block else 2) * h
        qk = {"head": 2 * self.head_dim}.get(self.qk_norm, self.q_size + self.kv_size) \
            if self.qk_norm else 0
        norms = L * (per_layer + qk) + h
        rest = (norms + emb) * dtype_bytes  # norms, embedding, lm_head
        if quantization == "fp8":
            return rest + linear + 4 * rows
        return rest + linear * dtype_bytes


def _yarn(s: dict, c: dict, max_pos: int, source: str) -> dict:
    """A YaRN rope_scaling with every field HF reads settled, as HF settles it: the factor
    (or max_position_embeddings / original_max_position_embeddings where it is null), the
    pretraining length (a top-level original_max_position_embeddings first, else the
    scaling's, else max_position_embeddings), beta_fast / beta_slow (32 / 1), truncate
    (true), and the attention factor: given, or 0.1 * ln(factor) + 1, or with mscale and
    mscale_all_dim the ratio of that form at each."""
    def bad(key, why):
        return ConfigError(f"{source}: rope_scaling (yarn) {key}={s.get(key)!r} {why}")

    original = c.get("original_max_position_embeddings") or s.get(
        "original_max_position_embeddings") or max_pos
    if not (is_int(original) and original > 0):
        raise bad("original_max_position_embeddings", "must be an integer > 0")
    factor = s.get("factor")
    if factor is None:
        factor = max_pos / original
    if not (_of_type(factor, "float") and factor >= 1):
        raise bad("factor", "must be a number >= 1")
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if not _of_type(s.get(key), "float | None") or (s.get(key) or 0) < 0:
            raise bad(key, "must be a number >= 0 (or null)")

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(m) / mscale(m_all)) if m and m_all else mscale(1)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "attention_factor": attention, "beta_fast": s.get("beta_fast") or 32,
            "beta_slow": s.get("beta_slow") or 1, "truncate": bool(s.get("truncate", True))}


def _longrope(s: dict, c: dict, max_pos: int, head_dim: int, gemma3: bool, source: str) -> dict:
    """A LongRoPE rope_scaling with the fields HF reads settled: short and long factors (one
    per rotated pair), the pretraining length (a top-level original_max_position_embeddings
    first), and the attention factor (given, or sqrt(1 + ln(factor) / ln(original)) with
    factor max_position_embeddings / original where the scaling gives none)."""
    def bad(key, why):
        return ConfigError(f"{source}: rope_scaling (longrope) {key}={s.get(key)!r} {why}")

    if gemma3:
        raise ConfigError(f"{source}: rope_scaling type 'longrope' is not supported on Gemma 3")
    original = c.get("original_max_position_embeddings") or s.get(
        "original_max_position_embeddings")
    if not (is_int(original) and original > 0):
        raise ConfigError(f"{source}: rope_scaling (longrope) needs "
                          "original_max_position_embeddings, an integer > 0")
    for key in ("short_factor", "long_factor"):
        v = s.get(key)
        if not (isinstance(v, list) and len(v) == head_dim // 2
                and all(_of_type(x, "float") and x > 0 for x in v)):
            raise bad(key, f"must be {head_dim // 2} numbers > 0 (one per rotated pair of "
                      f"head_dim {head_dim})")
    factor = s.get("factor") or max_pos / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not (_of_type(attention, "float") and attention > 0):
        raise bad("attention_factor", "must be a number > 0 (or null)")
    return {"rope_type": "longrope", "short_factor": tuple(s["short_factor"]),
            "long_factor": tuple(s["long_factor"]), "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


def _experts(c: dict, arch: str, source: str) -> dict:
    """ModelConfig's mixture-of-experts fields as HF reads a config: Mixtral's, Granite
    MoE's, gpt-oss's and OLMoE's experts in every layer, each of intermediate_size, the picked
    ones' weights renormalised (Granite MoE's and gpt-oss's softmax over the top k's logits is
    that; OLMoE's where norm_topk_prob); Qwen2-MoE's and Qwen3-MoE's of
    moe_intermediate_size in each layer i with (i + 1) % decoder_sparse_step == 0 that
    mlp_only_layers leaves out (the others dense), renormalised where norm_topk_prob;
    Qwen2-MoE's shared expert beside them (shared_expert_intermediate_size, which a dense
    layer's MLP must then equal: one MLP width a model)."""
    none = dict(num_experts=0, experts_per_token=0, expert_intermediate_size=0,
                norm_topk_prob=True, dense_layers=(), shared_expert=False)
    if arch not in MOE:
        return none
    key, default_experts, default_per_token = MOE[arch]
    # (Granite MoE's and gpt-oss's routers: Mixtral's, whose picked weights HF always
    # renormalises; gpt-oss's softmax over the top k's logits is that)
    mixtral = arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM", "GptOssForCausalLM")
    olmoe = arch == "OlmoeForCausalLM"
    experts = c.get(key, c.get("num_local_experts", default_experts))
    per_token = c.get("num_experts_per_tok", default_per_token)
    if not (is_int(experts) and is_int(per_token) and 0 <= experts
            and (experts == 0 or 1 <= per_token <= experts)):
        raise ConfigError(f"{source}: {key}={experts!r} and num_experts_per_tok={per_token!r} "
                          f"must be integers with 1 <= num_experts_per_tok <= {key}")
    if experts == 0:  # (HF's Qwen MoE blocks need experts: every layer dense)
        return none
    topk = True if mixtral else c.get("norm_topk_prob", False)
    if not isinstance(topk, bool):
        raise ConfigError(f"{source}: norm_topk_prob={topk!r} must be true or false")
    if olmoe and c.get("clip_qkv") is not None:
        raise ConfigError(f"{source}: clip_qkv={c['clip_qkv']!r} is not supported (q, k and v "
                          "are served unclipped: clip_qkv null)")
    n = c["num_hidden_layers"]
    if mixtral or olmoe:
        return dict(none, num_experts=experts, experts_per_token=per_token,
                    expert_intermediate_size=c["intermediate_size"], norm_topk_prob=topk)
    width, step = c.get("moe_intermediate_size"), c.get("decoder_sparse_step", 1)
    dense_only = c.get("mlp_only_layers") or []
    for name, v in (("moe_intermediate_size", width), ("decoder_sparse_step", step)):
        if not is_int(v) or v < 1:
            raise ConfigError(f"{source}: {name}={v!r} must be an integer >= 1")
    if not isinstance(dense_only, list) or not all(is_int(i) for i in dense_only):
        raise ConfigError(f"{source}: mlp_only_layers={dense_only!r} must be a list of layer "
                          "indices")
    dense = tuple(i for i in range(n) if i in dense_only or (i + 1) % step)
    shared = arch == "Qwen2MoeForCausalLM"
    if shared:
        s = c.get("shared_expert_intermediate_size")
        if not is_int(s) or s < 1:
            raise ConfigError(f"{source}: shared_expert_intermediate_size={s!r} must be an "
                              "integer >= 1")
        if dense and s != c["intermediate_size"]:
            raise ConfigError(f"{source}: dense layers {list(dense)} (intermediate_size "
                              f"{c['intermediate_size']}) beside a shared expert of "
                              f"shared_expert_intermediate_size {s} are not supported (slora "
                              "serves one dense MLP width a model)")
    return dict(num_experts=experts, experts_per_token=per_token,
                expert_intermediate_size=width, norm_topk_prob=topk, dense_layers=dense,
                shared_expert=shared)


def _sliding_layers(c: dict, arch: str, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, the layers it applies to) as HF reads a config: its `layer_types`
    where it lists them, else the family's rule: Mistral and Phi-3 every layer, Qwen2/3
    (with use_sliding_window) the layers from max_window_layers on, Gemma 2 every other layer
    from layer 0, Gemma 3 all but every sliding_window_pattern-th, SmolLM3 (with
    use_sliding_window) its layers without rotary, OLMo 3 all but every fourth, EXAONE 4 and
    Cohere 2 all but every sliding_window_pattern-th. Llama, Gemma 1 and OLMo 2 have none."""
    window = c.get("sliding_window")
    if arch.startswith(("Qwen", "SmolLM3")) and not c.get("use_sliding_window"):
        window = None
    if window is None or arch in ("LlamaForCausalLM", "GemmaForCausalLM", "Olmo2ForCausalLM"):
        return None, ()
    if not is_int(window) or window < 1:
        raise ConfigError(f"{source}: sliding_window={window!r} must be an integer >= 1")
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != n
                or not set(types) <= {"sliding_attention", "full_attention"}):
            raise ConfigError(f"{source}: layer_types must list 'sliding_attention' or "
                              f"'full_attention' for each of the {n} layers")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif arch == "Gemma2ForCausalLM":
        layers = list(range(0, n, 2))
    elif arch == "Gemma3ForCausalLM":
        pattern = c.get("sliding_window_pattern", 6)
        layers = [i for i in range(n) if (i + 1) % pattern]
    elif arch.startswith("Qwen"):
        layers = list(range(c.get("max_window_layers", 28), n))
    elif arch == "SmolLM3ForCausalLM":
        layers = list(_nope_layers(c, source))
    elif arch == "Olmo3ForCausalLM":
        layers = [i for i in range(n) if (i + 1) % 4]
    elif arch in ("Exaone4ForCausalLM", "Cohere2ForCausalLM"):
        every = c.get("sliding_window_pattern", 4)
        if not is_int(every) or every < 1:
            raise ConfigError(f"{source}: sliding_window_pattern={every!r} without layer_types: "
                              "expected an integer >= 1 (every such layer global)")
        layers = [i for i in range(n) if (i + 1) % every]
    else:
        layers = list(range(n))
    return (window, tuple(layers)) if layers else (None, ())


def _nope_layers(c: dict, source: str) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: the zeros of its `no_rope_layers` (one 0 or 1 a
    layer), or, where the config lists none, HF's rule: every no_rope_layer_interval-th."""
    n = c["num_hidden_layers"]
    flags = c.get("no_rope_layers")
    if flags is None:
        every = c.get("no_rope_layer_interval", 4)
        if not is_int(every) or every < 1:
            raise ConfigError(f"{source}: no_rope_layer_interval={every!r} must be an "
                              "integer >= 1")
        return tuple(i for i in range(n) if (i + 1) % every == 0)
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"{source}: no_rope_layers must list 0 (no rotary) or 1 (rotary) "
                          f"for each of the {n} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


def max_model_len(config: EngineConfig, model: ModelConfig, pool_pages: int) -> int:
    """The longest sequence (prompt + output) an engine admits: `config.max_model_len`, or
    (None) the model's `context_window` capped by what a pool of `pool_pages` pages holds, as
    vLLM derives it. A value set past the window or past the pool is refused (ConfigError),
    not cut down: those positions were never trained, and a sequence longer than the pool
    could never run."""
    limit, pool_tokens = config.max_model_len, pool_pages * config.block_size
    if limit is None:
        return min(model.context_window, pool_tokens)
    if limit > model.context_window:
        raise ConfigError(f"EngineConfig.max_model_len={limit}: past the model's context window "
                          f"({model.context_window}: {model._context_window()[1]}); lower it, "
                          "or leave it None for the model's")
    if limit > pool_tokens:
        raise ConfigError(f"EngineConfig.max_model_len={limit}: the pool holds {pool_tokens} "
                          f"tokens ({pool_pages} pages of {config.block_size}); raise num_pages "
                          "or gpu_memory_fraction, or lower max_model_len")
    return limit


def round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A mixed step's CUDA-graph buckets (slora.graphs): its tokens in all (prompts and decode rows)
# are padded up to the first of these, or to mixed_graph_tokens past the last that is smaller.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket(n: int, buckets) -> int | None:
    """The first of `buckets` (ascending) that holds n; None past the last."""
    return next((b for b in buckets if b >= n), None)


def buckets_up_to(candidates, limit: int) -> tuple[int, ...]:
    """The candidates below `limit`, then `limit` itself."""
    return tuple(b for b in candidates if b < limit) + (limit,)
