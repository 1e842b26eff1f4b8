"""The runner's persistent block tables: rebuilt from the plan's table updates alone, grown as needed, and
gathered for a step without reading anything past a sequence's own blocks."""

from __future__ import annotations

import torch

from engine.plan import ScheduledSeq
from engine.request import SamplingParams, SequenceGroup
from engine.runner import BlockTables


def _item(group: SequenceGroup, start: int, blocks: list[int]) -> ScheduledSeq:
    seq = group.seqs[0]
    return ScheduledSeq(group, seq, start=0, num_new_tokens=1, table_start=start, new_blocks=tuple(blocks))


def test_updates_append_replace_and_grow_the_table() -> None:
    tables = BlockTables(rows=1, width=2)
    a = SequenceGroup("a", [1, 2, 3], SamplingParams())
    b = SequenceGroup("b", [4, 5], SamplingParams())
    row_a = tables.update(_item(a, 0, [7, 8]))
    row_b = tables.update(_item(b, 0, [3]))  # a second sequence: a second row
    assert row_a != row_b and tables.table.shape[0] >= 2
    assert tables.update(_item(a, 2, [9, 10, 11])) == row_a  # appended past the width: the table grows
    assert tables.update(_item(a, 4, [12])) == row_a  # copy-on-write of the last block
    assert tables.update(_item(a, 4, [12])) == row_a  # a step re-run after a fault applies it again
    assert tables.table[row_a, :5].tolist() == [7, 8, 9, 10, 12]
    assert tables.table[row_b, :1].tolist() == [3]
    assert tables.table.dtype == torch.int32
    tables.update(_item(b, 0, [5, 6]))  # swapped back in: the whole table anew
    assert tables.table[row_b, :2].tolist() == [5, 6]


def test_a_freed_row_is_reused() -> None:
    tables = BlockTables(rows=2, width=4)
    a = SequenceGroup("a", [1], SamplingParams())
    b = SequenceGroup("b", [2], SamplingParams())
    row_a = tables.update(_item(a, 0, [1]))
    tables.free(a.seqs[0].seq_id)
    tables.free(a.seqs[0].seq_id)  # forgetting twice is harmless
    assert tables.update(_item(b, 0, [2])) == row_a
    assert tables.table.shape == (2, 4)
