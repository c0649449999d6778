"""Decode LoRA that reads each shared adapter once a step: the decode rows grouped by adapter.

MBGMV (`mbgmv.py`) gives every decode row programs of its own, so rows that share an adapter
each read its A and B^T rows: a step of 128 rows on one adapter costs what 128 distinct
adapters cost. The segmented path groups a step's decode rows by adapter on the host
(`group_rows`: the rows with an adapter, stably sorted by adapter row, as segments of one
adapter each) and runs MBGMM over them (`mbgmm_shrink` / `mbgmm_expand` with `rows`): one
program reads an adapter's tile once for up to `decode_tile_rows` rows of it (tl.dot over a
[rows, 64] block, rows padded to the tile), a segment of n rows taking ceil(n / tile) tiles.
A one-row segment fills a tile alone, where MBGMV's per-row programs are faster.

So a step splits its decode rows per adapter (`split_rows`): an adapter's rows go by adapter
when they are many enough and their reads large enough (table entry `decode_by_adapter`, by
`rows` and `row_bytes`: the adapter's rows in the step, and those rows times its bytes), the
other rows through MBGMV. A step runs one path where the other has no row, else both
("hybrid": MBGMV over the rest with the grouped rows at adapter row -1, then MBGMM over the
groups, into the same xa and out; they share no row) where the grouped rows read enough to
pay for the second set of launches (table entry `decode_hybrid`, by `grouped_bytes`), else
MBGMV alone.

Semantics: every path computes `reference.lora_shrink` / `reference.lora_expand` with the
step's token_slot; the segments are another view of it (`reference.segments_token_slot`:
token_slot[rows[m]] is the adapter row of position m's segment; rows not listed are
base-only or MBGMV's). xa is indexed by token row on both paths.

In a CUDA graph (`slora.graphs`) the segments live in preallocated buffers of the bucket's
size: rows [B], seg_start [B + 1], seg_slot [B], the work list (`tiles.capacity(B, B, tile)`
entries) and the rest's adapter rows [B]; MBGMM counts the step's tiles on the device, so a
bucket replays any grouping of its rows. The path is part of a graph's key (decode and mixed
graphs alike).
"""

from __future__ import annotations

import functools

import torch

from slora.config import DECODE_LORA
from slora.kernels import tuning
from slora.kernels.tiles import token_tiles

# EngineConfig.decode_lora: "auto" (the table's split per step), or one of the paths always
PATHS = tuple(m for m in DECODE_LORA if m != "auto")


def decode_tile_rows(device: torch.device) -> int:
    """Rows a tile of the segmented path (table entry `decode_tile_rows`): 16 on a GPU, where
    tl.dot needs at least 16 rows; small under the interpreter, whose cost grows with a
    tile."""
    return _tile(tuning.kind(device))


@functools.lru_cache(maxsize=None)
def _tile(table: str) -> int:
    return tuning.choose(table, "decode_tile_rows")["BLOCK_M"]


def split_rows(table: str, mode: str, slots: list[int],
               nbytes: list[int]) -> tuple[list[int] | None, list[int] | None]:
    """(by_adapter, rest): the adapter rows of a step's decode rows (`slots`, -1: base model)
    that run grouped by adapter and of those that run through MBGMV, each list with the
    other's rows at -1; None for a path no row takes. `nbytes[s]`: adapter row s's bytes.

    mode "mbgmv" / "segments": every row on that path. "auto": each adapter's rows by
    adapter where table `table`'s `decode_by_adapter` rule says so, the others through
    MBGMV, one path alone where the other has no adapter row; a step that would run both
    (a second set of LoRA launches) splits only where the `decode_hybrid` rule holds for the
    grouped rows' bytes, else runs MBGMV alone. "hybrid": the split, both paths always (a step
    whose rows share one adapter still runs MBGMV over none of them)."""
    if mode == "mbgmv":
        return None, slots
    if mode == "segments":
        return slots, None
    count: dict[int, int] = {}
    for s in slots:
        if s >= 0:
            count[s] = count.get(s, 0) + 1
    # (a one-row segment fills a tile alone: such a row stays MBGMV's without asking)
    grouped = {s for s, n in count.items() if n > 1 and _by_adapter(table, n, n * nbytes[s])}
    by_adapter = [s if s in grouped else -1 for s in slots]
    if mode == "auto":
        if len(grouped) == len(count) and grouped:
            return by_adapter, None
        if not grouped or not tuning.choose(
                table, "decode_hybrid",
                grouped_bytes=sum(count[s] * nbytes[s] for s in grouped))["split"]:
            return None, slots
    return by_adapter, [-1 if s in grouped else s for s in slots]


@functools.lru_cache(maxsize=4096)
def _by_adapter(table: str, rows: int, row_bytes: int) -> bool:
    """Table `table`'s `decode_by_adapter` rule for an adapter's `rows` decode rows reading
    `row_bytes` together (few distinct pairs: an engine's adapters come in a few sizes)."""
    return tuning.choose(table, "decode_by_adapter", rows=rows,
                         row_bytes=row_bytes)["by_adapter"]


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
