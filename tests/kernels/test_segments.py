"""The decode rows grouped by adapter (slora.kernels.segments): the host grouping and the
per-step choice of path. The kernels over the groups: tests/kernels/test_lora.py."""

import pytest
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


@pytest.mark.parametrize("table", [tuning.kind(torch.device("cpu")), "h200"])
def test_split_rows_groups_the_adapters_the_table_names(table):
    """An adapter's rows go by adapter when the table's `decode_by_adapter` rule holds for
    their count and bytes; "auto" runs one path where the other has no adapter row, and both
    where the grouped rows' bytes pass `decode_hybrid` (else MBGMV alone); "hybrid" both
    always, "mbgmv" and "segments" every row on theirs."""
    rule = tuning.table(table)["decode_by_adapter"][0]
    need, min_bytes = rule["when"]["rows"][0], rule["when"]["row_bytes"][0]
    split = tuning.table(table)["decode_hybrid"][0]
    step_bytes = split["when"]["grouped_bytes"][0]
    assert rule["cfg"]["by_adapter"] and split["cfg"]["split"] and need >= 2
    big = -(-max(min_bytes, step_bytes) // need) + 1  # `need` rows pass both rules
    nbytes = [big, big, 0]  # adapter 2's rows read nothing: grouped only where 0 bytes are enough
    slots = [0] * need + [1] + [-1] + [2] * need
    group2 = min_bytes == 0
    by, rest = segments.split_rows(table, "auto", slots, nbytes)
    assert by == [0] * need + [-1, -1] + [2 if group2 else -1] * need
    assert rest == [-1] * need + [1, -1] + [-1 if group2 else 2] * need
    assert segments.split_rows(table, "hybrid", slots, nbytes) == (by, rest)
    if step_bytes > min_bytes:  # adapter 0 grouped alone would not pay for both kernel sets
        small = [-(-min_bytes // need)] * 2 + [0]
        assert segments.split_rows(table, "auto", slots, small) == (None, slots)
        assert segments.split_rows(table, "hybrid", slots, small) == (by, rest)
    shared = [0] * need + [-1]
    assert segments.split_rows(table, "auto", shared, nbytes) == (shared, None)
    assert segments.split_rows(table, "hybrid", shared, nbytes) == (shared, [-1] * (need + 1))
    distinct = [0, 1, -1]
    assert segments.split_rows(table, "auto", distinct, nbytes) == (None, distinct)
    assert segments.split_rows(table, "hybrid", distinct, nbytes) == ([-1] * 3, distinct)
    assert segments.split_rows(table, "auto", [-1, -1], nbytes) == (None, [-1, -1])
    for rows in (slots, shared, distinct):  # a fixed path whatever the rows
        assert segments.split_rows(table, "mbgmv", rows, nbytes) == (None, rows)
        assert segments.split_rows(table, "segments", rows, nbytes) == (rows, None)
