"""Adapter copies under tensor parallelism.

Rank 0's host tier keeps each adapter as every rank's shard, [N, layers, pages * P] (its
`pack` is wrapped by `sharded_pack`); a copy into the pool scatters shard k to rank k and
copies shard 0 into its own pool. A worker's tier holds nothing: each copy receives its shard
from rank 0 and copies it into the same pages of its pool. Both copy in the same order, the
order of the step message's loads, then its prefetches.
"""

from __future__ import annotations

from typing import Callable

import torch

from slora.config import ModelConfig
from slora.core.adapters import AdapterLayout
from slora.distributed.shapes import ShardConfig
from slora.distributed.sharding import shard_packed
from slora.runner.host_tier import HostAdapterTier, Loads


def sharded_pack(pack: Callable, full: ModelConfig, layout: AdapterLayout,
                 locals_: list[ShardConfig]) -> Callable:
    """A `pack(page_size, dtype)` that returns every rank's shard [N, layers, pages *
    page_size] of the adapter `pack` lays out for the full model (`layout`): each its slice
    of every A and B (`shard_packed`), 1/N of the adapter up to LORA_ALIGN rounding."""
    def pack_shards(page_size: int, dtype: torch.dtype) -> torch.Tensor:
        packed = pack(page_size, dtype)
        return torch.stack([shard_packed(packed, full, layout, c, page_size) for c in locals_])

    return pack_shards


class ShardedHostTier(HostAdapterTier):
    """Rank 0's host tier: each copy scatters the other ranks' shards first."""

    def __init__(self, tp, *args) -> None:
        super().__init__(*args)
        self.tp = tp

    def _copy(self, loads: Loads, hosts: list[torch.Tensor], on_piece) -> None:
        mine = [self.tp.scatter(h, None, h.dtype) for h in hosts]
        super()._copy(loads, mine, on_piece)


class WorkerHostTier(HostAdapterTier):
    """A worker's tier: each copy's shard comes from rank 0."""

    def __init__(self, tp, *args) -> None:
        super().__init__(*args)
        self.tp = tp

    def load(self, loads: Loads, adapters, on_piece=None) -> None:
        L, _, ps = self.pool.shape
        hosts = [self.tp.scatter(None, (L, len(pages) * ps), self.dtype) for _, pages in loads]
        self._copy(loads, hosts, on_piece)
