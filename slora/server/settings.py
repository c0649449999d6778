"""What `slora serve` is told: the server's own settings, and the engine's flags made from
`EngineConfig`'s fields so that every knob has a flag and none drifts from the dataclass.

No FastAPI import here: `slora --help` reads this module.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields

from slora.config import BACKENDS, DTYPE_ALIASES, DTYPES, MOE_EXPERTS, POLICIES, EngineConfig
from slora.server.adapters import AdapterResolver

# tool-call parsers (slora.server.tools)
PARSERS = ("hermes", "llama3_json", "mistral", "granite", "pythonic", "openai")
REASONING = ("deepseek_r1", "qwen3", "gpt_oss")  # reasoning parsers (slora.server.reasoning)


@dataclass(frozen=True)
class ServerSettings:
    """model_name: what clients call the base model (`model` in OpenAI requests, the parent in
        GET /v1/models).
    adapter_dir: runtime loads take paths under it, and a name that is not registered is looked
        up in it (DIR/<name>) on first use. None: no lookup; runtime loads need
        `allow_any_adapter_path`.
    allow_any_adapter_path: runtime loads may read any directory on the machine.
    api_key: every route but /health needs `Authorization: Bearer <api_key>`; None: open.
    max_waiting: engine requests submitted and not yet given their first token, at most; a
        request that would pass it is answered 503 with Retry-After.
    max_body_bytes: larger request bodies are answered 413 unread.
    retry_after_s: the Retry-After of 503 answers.
    resolver: finds adapters by name; None: a `LocalDirResolver` over `adapter_dir`, if any.
    tool_call_parser: how chat answers find the model's tool calls in its text
        (`PARSERS`, read by `slora.server.tools`); None: tool_choice "auto" is refused.
    reasoning_parser: how chat answers find a thinking model's reasoning (`REASONING`, read
        by `slora.server.reasoning`); None: the whole output is content.
    chat_template: the chat template of the base model and of the adapters without their
        own (in place of the model's); None: the model's.
    """

    model_name: str = "slora"
    adapter_dir: str | None = None
    allow_any_adapter_path: bool = False
    api_key: str | None = None
    max_waiting: int = 4096
    max_body_bytes: int = 8 << 20
    retry_after_s: int = 1
    resolver: AdapterResolver | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"ServerSettings.tool_call_parser={self.tool_call_parser!r}: "
                             f"expected one of {', '.join(PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING):
            raise ValueError(f"ServerSettings.reasoning_parser={self.reasoning_parser!r}: "
                             f"expected one of {', '.join(REASONING)}")
        if self.max_waiting < 1:
            raise ValueError(f"ServerSettings.max_waiting={self.max_waiting}: must be at least 1")
        if self.max_body_bytes < 1:
            raise ValueError(f"ServerSettings.max_body_bytes={self.max_body_bytes}: must be "
                             "at least 1")
        if not self.model_name:
            raise ValueError("ServerSettings.model_name: must be non-empty")


# Help of EngineConfig's flags; a field missing here still gets its flag, with a plain help.
ENGINE_HELP = {
    "model": "Hugging Face model directory (config.json, *.safetensors, tokenizer.json); "
             "default: the embedded SmolLM2-135M-Instruct",
    "device": "auto (cuda if available), cpu, cuda or cuda:N",
    "dtype": "weights, activations and pool; auto: bfloat16 on CUDA, float32 on CPU (vLLM's "
             "half and float: float16 and float32)",
    "block_size": "tokens per KV page",
    "num_pages": "pages in the unified pool; default: sized to memory",
    "gpu_memory_fraction": "share of free GPU memory the pool takes when --num-pages is unset",
    "cpu_pool_gb": "pool size on CPU when --num-pages is unset",
    "max_num_seqs": "most sequences in a batch",
    "max_batch_tokens": "most tokens computed in a step",
    "max_prefill_chunk": "chunked prefill: most prompt tokens a step computes (0: whole prompts)",
    "max_model_len": "longest sequence (prompt + output); default: the model's, capped by the pool; "
                     "a value past either is refused",
    "backend": "kernels; auto: triton on CUDA, torch on CPU",
    "host_cache_gb": "host-memory LRU tier for adapters between disk and pool",
    "policy": "queue order",
    "max_skips": "cluster policy: most steps a request may be passed over",
    "slo_ttft_s": "first-token SLO in seconds (the abort policy)",
    "prefetch_window": "waiting requests whose adapters are loaded ahead",
    "prefetch_reserve": "free pages prefetching leaves for KV",
    "cuda_graphs": "replay decode steps as CUDA graphs",
    "mixed_graph_tokens": "steps with prompts of at most this many tokens replay graphs too "
                          "(0: eager)",
    "async_scheduling": "launch each step before collecting the last; default: on with CUDA",
    "gemm_max_rows": "base GEMMs of at most this many rows run through slora's Triton kernel "
                     "(0: cuBLAS always)",
    "load_format": "dummy: random weights from config.json alone (benchmarks)",
    "seed": "the engine's random seed",
    "enable_prefix_caching": "keep full KV pages for later requests with the same adapter, "
                             "salt and prefix",
    "max_logprobs": "the most top log-probs a request may ask for",
    "tensor_parallel_size": "devices the model is sharded over, one process each",
    "max_lora_rank": "refuse adapters of a larger rank in any module (default: any rank)",
    "moe_experts": "a mixture of experts: fused (Triton kernels over the picked experts' "
                   "weights, for few rows), grouped (the picked experts alone; CPU, or "
                   "bfloat16 on compute capability 9.0+), dense (every expert on every token), "
                   "auto (fused for decode steps of few rows, else grouped where served)",
}
# vLLM's spellings of EngineConfig's flags, accepted beside slora's own
ENGINE_ALIASES = {
    "max_batch_tokens": ("--max-num-batched-tokens",),
    # (vLLM's share is of the whole device, weights included; slora's of the memory free
    # after the weights: both size the KV cache)
    "gpu_memory_fraction": ("--gpu-memory-utilization",),
}
ENGINE_CHOICES = {"dtype": DTYPES + tuple(DTYPE_ALIASES), "backend": BACKENDS,
                  "policy": POLICIES, "load_format": ("auto", "dummy"),
                  "moe_experts": MOE_EXPERTS}


def add_engine_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--max-num-seqs` for max_num_seqs), typed from the
    field's annotation, and vLLM's spelling beside it where it has one (ENGINE_ALIASES);
    unset flags keep EngineConfig's defaults."""
    group = parser.add_argument_group("engine (every EngineConfig field; unset: its default)")
    for f in fields(EngineConfig):
        kinds = {k.strip() for k in f.type.split("|")}
        default = "" if f.default in (MISSING, None) else f" (default: {f.default})"
        kw = {"dest": f.name, "default": None,
              "help": ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}") + default}
        if "bool" in kinds:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = int if "int" in kinds else float if "float" in kinds else str
            kw["choices"] = ENGINE_CHOICES.get(f.name)
            kw["metavar"] = None if kw["choices"] else f.name.split("_")[-1].upper()
        group.add_argument("--" + f.name.replace("_", "-"), *ENGINE_ALIASES.get(f.name, ()),
                           **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags given (see `add_engine_config_args`)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)
                           if getattr(args, f.name, None) is not None})
