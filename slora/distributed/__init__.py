"""Tensor parallelism: one model sharded over N devices, one process each (Megatron's
partitioning, S-LoRA's for the adapters' pages).

    sharding.py   what a rank holds: its view of the model (ShardConfig), its weight slices,
                  its slices of every adapter page; the degrees slora splits (check_degree)
    group.py      TensorParallel: the processes, the model's collectives, the step messages
    codec.py      a step's message as one int64 tensor
    tiers.py      adapter copies: rank 0 scatters each rank's shard of an adapter's pages
    worker.py     the loop of ranks 1..N-1
"""

from slora.distributed.group import TensorParallel, WorkerDied, torchrun_rank
from slora.distributed.sharding import (ShardConfig, VocabShard, check_degree, shard_weights,
                                        vocab_shard)
from slora.distributed.tiers import ShardedHostTier, WorkerHostTier, sharded_pack

__all__ = ["ShardConfig", "ShardedHostTier", "TensorParallel", "VocabShard", "WorkerDied",
           "WorkerHostTier", "check_degree", "shard_weights", "sharded_pack", "torchrun_rank",
           "vocab_shard"]
