"""The decode rows grouped by adapter (slora.kernels.segments): the host grouping and the
per-step choice of path. The kernels over the groups: tests/kernels/test_lora.py."""

import torch

from slora.kernels import segments, tuning


def test_group_rows_sorts_rows_by_adapter_into_segments():
    slots = [2, -1, 0, 2, 2, 0, -1, 1]
    rows, seg_start, seg_slot, tiles = segments.group_rows(slots, tile=2)
    assert rows == [2, 5, 7, 0, 3, 4]  # stable within an adapter; base rows left out
    assert seg_start == [0, 2, 3, 6] and seg_slot == [0, 1, 2]
    # (segment, first position) per tile of 2: adapter 2's three rows take two tiles
    assert tiles == [4, 0, 0, 1, 2, 2, 3, 2, 5]
    for s, slot in enumerate(seg_slot):
        assert all(slots[r] == slot for r in rows[seg_start[s]:seg_start[s + 1]])
    assert segments.group_rows([-1, -1], tile=4) == ([], [0], [], [0])


def test_choose_path_reads_the_table_by_rows_per_adapter():
    table = tuning.kind(torch.device("cpu"))
    rule = tuning.table(table)["decode_lora"][0]
    need = rule["when"]["rows_per_adapter"][0]  # the fewest rows an adapter that take segments
    assert rule["cfg"]["path"] == "segments" and need >= 2
    distinct = list(range(8))
    shared = [0] * (need * 2) + [1] * need + [-1] * 5
    assert segments.choose_path(table, "auto", distinct) == "mbgmv"
    assert segments.choose_path(table, "auto", shared) == "segments"
    assert segments.choose_path(table, "auto", [-1, -1]) == "mbgmv"
    for mode in segments.PATHS:  # a fixed mode whatever the rows
        assert segments.choose_path(table, mode, distinct) == mode
        assert segments.choose_path(table, mode, shared) == mode
