"""Decode LoRA that reads each adapter once a step: the decode rows grouped by adapter.

MBGMV (`mbgmv.py`) gives every decode row programs of its own, so rows that share an adapter
each read its A and B^T rows: a step of 128 rows on one adapter costs what 128 distinct
adapters cost. The segmented path groups a step's decode rows by adapter on the host
(`group_rows`: the rows with an adapter, stably sorted by adapter row, as segments of one
adapter each) and runs MBGMM over them (`mbgmm_shrink` / `mbgmm_expand` with `rows`): one
program reads an adapter's tile once for up to `decode_tile_rows` rows of it (tl.dot over a
[rows, 64] block, rows padded to the tile), a segment of n rows taking ceil(n / tile) tiles.
A one-row segment fills a tile alone, where MBGMV's per-row programs are faster: which path a
step takes is data, table entry `decode_lora` (`choose_path`), by `rows` (decode rows with an
adapter) and `rows_per_adapter` (rows over the distinct adapters among them, rounded down).

Semantics: both paths compute `reference.lora_shrink` / `reference.lora_expand` with the
step's token_slot; the segments are another view of it (`reference.segments_token_slot`:
token_slot[rows[m]] is the adapter row of position m's segment; rows not listed are
base-only). xa is indexed by token row on both paths.

In a CUDA graph (`slora.graphs`) the segments live in preallocated buffers of the bucket's
size: rows [B], seg_start [B + 1], seg_slot [B] and the work list (`tiles.capacity(B, B,
tile)` entries); MBGMM counts the step's tiles on the device, so a bucket replays any grouping
of its rows. The path is part of a graph's key (decode and mixed graphs alike).
"""

from __future__ import annotations

import functools

import torch

from slora.config import DECODE_LORA
from slora.kernels import tuning
from slora.kernels.tiles import token_tiles

# EngineConfig.decode_lora: "auto" (the table's choice per step), or one of the paths always
PATHS = tuple(m for m in DECODE_LORA if m != "auto")


def decode_tile_rows(device: torch.device) -> int:
    """Rows a tile of the segmented path (table entry `decode_tile_rows`): 16 on a GPU, where
    tl.dot needs at least 16 rows; small under the interpreter, whose cost grows with a
    tile."""
    return _tile(tuning.kind(device))


@functools.lru_cache(maxsize=None)
def _tile(table: str) -> int:
    return tuning.choose(table, "decode_tile_rows")["BLOCK_M"]


def choose_path(table: str, mode: str, slots: list[int]) -> str:
    """The path of a step's decode rows, whose adapter rows are `slots` (-1: base model):
    `mode` itself unless "auto", else table `table`'s `decode_lora` rule."""
    if mode != "auto":
        return mode
    adapters = {s for s in slots if s >= 0}
    rows = sum(s >= 0 for s in slots)
    if not adapters:
        return "mbgmv"
    return tuning.choose(table, "decode_lora", rows=rows,
                         rows_per_adapter=rows // len(adapters))["path"]


def group_rows(slots: list[int], tile: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(rows, seg_start, seg_slot, tiles) of decode rows whose adapter rows are `slots`: the
    rows with an adapter, stably sorted by adapter row; one segment per adapter row, over
    positions seg_start[i]:seg_start[i+1] of `rows`; the work list of its tiles of `tile`
    positions (`tiles.token_tiles`)."""
    rows = sorted((i for i, s in enumerate(slots) if s >= 0), key=slots.__getitem__)
    seg_start, seg_slot = [0], []
    for i, r in enumerate(rows):
        if not seg_slot or slots[r] != seg_slot[-1]:
            if seg_slot:
                seg_start.append(i)
            seg_slot.append(slots[r])
    if seg_slot:
        seg_start.append(len(rows))
    return rows, seg_start, seg_slot, token_tiles(seg_start, tile)
