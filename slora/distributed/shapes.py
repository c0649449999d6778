"""A tensor-parallel rank's view of the model's shapes (no torch: the simulator reads it too).

`ShardConfig` is a `ModelConfig` with the rank's own head, KV-head, intermediate (the
experts' too) and vocabulary counts; its `module_dims` are the shapes of the rank's slice of
each LoRA module (see `sharding`), so its page size, adapter layouts and weight bytes are one
rank's. `check_degree` says which degrees a model splits over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from slora.config import ConfigError, ModelConfig

ROW_PARALLEL = ("o_proj", "down_proj")
ROW_PARALLEL_GROUPS = ("o", "down")  # their LoRA groups (slora.model.llama.GROUPS)
# every other module (q, k, v, gate, up and the fused qkv_proj, gate_up_proj) reads the
# hidden state: column-parallel


def check_degree(cfg: ModelConfig, n: int) -> None:
    """ConfigError unless the model splits evenly over `n` ranks: num_heads, hidden_size,
    intermediate_size and the experts' intermediate size divisible by n, and
    num_key_value_heads divisible by n or dividing it (fewer KV heads than ranks: each
    replicated over n / KVH ranks)."""
    if n == 1:
        return
    why = []
    if cfg.num_heads % n:
        why.append(f"its {cfg.num_heads} attention heads are not divisible by {n}")
    kvh = cfg.num_kv_heads
    if kvh % n and n % kvh:
        why.append(f"its {kvh} KV heads are neither divisible by {n} nor a divisor of it")
    if cfg.hidden_size % n:
        why.append(f"its hidden size {cfg.hidden_size} is not divisible by {n}")
    if cfg.intermediate_size % n:
        why.append(f"its intermediate size {cfg.intermediate_size} is not divisible by {n}")
    if cfg.qk_norm == "all":
        why.append("its q and k norms (OLMo's) span every head, which slora does not "
                   "gather across devices")
    if cfg.num_experts and cfg.expert_intermediate_size % n:
        why.append(f"its experts' intermediate size {cfg.expert_intermediate_size} is not "
                   f"divisible by {n}")
    if cfg.qk_norm == "heads":
        why.append("its q and k norms have a weight for each head (Cohere's), which slora "
                   "does not split across devices")
    if why:
        raise ConfigError(
            f"EngineConfig.tensor_parallel_size={n}: this model cannot be split over {n} "
            f"devices: {'; '.join(why)}. slora splits evenly: num_attention_heads, hidden_size "
            "and intermediate_size divisible by the degree; num_key_value_heads divisible by "
            "it, or fewer KV heads than devices with the degree a multiple of them (KV heads "
            "replicated)")


@dataclass(frozen=True)
class ShardConfig(ModelConfig):
    """Rank `tp_rank`'s view of the model: its own head and intermediate counts, the hidden
    size whole. `module_dims` gives the (d_in, d_out) of this rank's slice of each LoRA
    module, so the adapter layout, the LoRA groups' shapes and the page size are per rank:
    every module's hidden-sized side is split too (a column-parallel module's A input
    columns, a row-parallel module's B rows), so a rank holds 1/N of each A and each B
    (k and v's B whole per replicated KV head when there are fewer KV heads than ranks)."""

    tp_size: int = 1
    tp_rank: int = 0
    full_vocab_size: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, n: int, rank: int) -> "ShardConfig":
        check_degree(cfg, n)
        values = {f.name: getattr(cfg, f.name) for f in fields(ModelConfig)}
        values.update(num_heads=cfg.num_heads // n,
                      num_kv_heads=max(cfg.num_kv_heads // n, 1),
                      intermediate_size=cfg.intermediate_size // n,
                      expert_intermediate_size=cfg.expert_intermediate_size // n,
                      vocab_size=-(-cfg.vocab_size // n))
        return cls(**values, tp_size=n, tp_rank=rank, full_vocab_size=cfg.vocab_size)

    def module_dims(self, module: str) -> tuple[int, int]:
        d_in, d_out = super().module_dims(module)
        if module in ROW_PARALLEL:  # B: the rank's hidden columns
            return d_in, self.hidden_size // self.tp_size
        return self.hidden_size // self.tp_size, d_out  # A: the rank's hidden columns

    def kv_heads(self, full: ModelConfig) -> list[int]:
        """The full model's KV heads this rank holds."""
        if full.num_kv_heads % self.tp_size == 0:
            return list(range(self.tp_rank * self.num_kv_heads,
                              (self.tp_rank + 1) * self.num_kv_heads))
        return [self.tp_rank * full.num_kv_heads // self.tp_size]
