"""Work tiles of the prefill kernels (prefill attention, MBGMM).

A step's segments (one per sequence: its new tokens) are cut on the host into tiles of
`tile_rows` tokens, and the kernels' grids run over that list rather than over (token tile x
segment): a graph's grid over every segment's possible tiles must cover its token bucket for
each of its sequence slots, and would launch mostly empty programs.

The list is int32 [1 + 2 * capacity]: the count n, then n pairs (segment, first token). A
kernel's program p takes tiles p, p + P, p + 2P, ... (P: the grid's first axis), so a graph
captured for a bucket replays any list that fits its capacity, and an eager launch sizes P
to n.
"""

from __future__ import annotations

import functools

import torch

from slora.config import cdiv
from slora.kernels import tuning


def tile_rows(device: torch.device, dtype: torch.dtype) -> int:
    """Tokens per tile: the prefill kernels' BLOCK_M (table entry `tile_rows`, by `itemsize`,
    the element bytes). Fp32 takes a smaller tile where its IEEE dots would spill registers at
    the 16-bit tile (checked with ptxas: `experiments/compile_check.py`); the interpreter a
    small one, as its cost grows with the tile."""
    return _tile_rows(tuning.kind(device), dtype.itemsize)


@functools.lru_cache(maxsize=None)
def _tile_rows(table: str, itemsize: int) -> int:
    return tuning.choose(table, "tile_rows", itemsize=itemsize)["BLOCK_M"]


def token_tiles(seg_start: list[int], tile: int, keep: list[bool] | None = None) -> list[int]:
    """[n, s, m0, s, m0, ...]: the tiles of segments seg_start[s]:seg_start[s+1] that have
    tokens (and keep[s], when given)."""
    out = [0]
    for s, (lo, hi) in enumerate(zip(seg_start, seg_start[1:])):
        if keep is None or keep[s]:
            for m0 in range(lo, hi, tile):
                out += (s, m0)
    out[0] = (len(out) - 1) // 2
    return out


def capacity(num_tokens: int, num_segments: int, tile: int) -> int:
    """The most tiles `num_tokens` tokens in `num_segments` segments can make."""
    return cdiv(num_tokens, tile) + min(num_segments, num_tokens)


def as_tiles(tiles: torch.Tensor | None, seg_start: torch.Tensor, tile: int,
             keep: torch.Tensor | None = None) -> torch.Tensor:
    """`tiles`, or (None) the tiles of `seg_start` built here: a host round trip, for tests
    and benchmarks; the engine builds its lists with the batch."""
    if tiles is not None:
        return tiles
    k = None if keep is None else (keep >= 0).tolist()
    return torch.tensor(token_tiles(seg_start.tolist(), tile, k), dtype=torch.int32,
                        device=seg_start.device)
