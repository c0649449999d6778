"""Tensor parallelism: one model sharded over N devices, one process each (Megatron's
partitioning, S-LoRA's for the adapters' pages).

    shapes.py     a rank's view of the model (ShardConfig) and the degrees slora splits
                  (check_degree); no torch, the simulator reads them
    sharding.py   a rank's slices of the weights and of every adapter page
    group.py      TensorParallel: the processes, the model's collectives, the step messages
    codec.py      a step's message as one int64 tensor
    tiers.py      adapter copies: rank 0 scatters each rank's shard of an adapter's pages
    worker.py     the loop of ranks 1..N-1

The names below load their module on first use, so `slora.distributed.shapes` imports no
torch.
"""

import importlib

_WHERE = {"ShardConfig": "shapes", "check_degree": "shapes", "VocabShard": "sharding",
          "shard_weights": "sharding", "vocab_shard": "sharding", "TensorParallel": "group",
          "WorkerDied": "group", "torchrun_rank": "group", "ShardedHostTier": "tiers",
          "WorkerHostTier": "tiers", "sharded_pack": "tiers"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'slora.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"slora.distributed.{_WHERE[name]}"), name)
