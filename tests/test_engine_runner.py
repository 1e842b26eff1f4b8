"""The runner's persistent block tables: rebuilt from the plan's table updates alone, grown as needed, and
gathered for a step without reading anything past a sequence's own blocks; and steps padded to GEMM row
buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.engine import LLMEngine
from engine.model.testing import make_tiny_model_dir
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


def test_padded_rows_change_no_token_and_no_kv(tmp_path: Path) -> None:
    """A step padded to a GEMM row bucket stores and samples exactly what the unpadded step does."""
    model_dir = str(make_tiny_model_dir(tmp_path))
    prompts = [[10 + 90 * k + i for i in range(n)] for k, n in enumerate((30, 25, 22))]  # 77 tokens: 80 rows
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for pad in (True, False):
        engine = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn", num_kv_blocks=64)
        engine.runner.pad_rows = pad
        rows: list[tuple[int, int | None]] = []
        prepare = engine.runner.prepare

        def observed(scheduled: Any, prepare: Any = prepare, rows: list[tuple[int, int | None]] = rows) -> Any:
            inp = prepare(scheduled)
            rows.append((int(inp.input_ids.shape[0]), inp.attn_metadata.num_tokens))
            return inp

        engine.runner.prepare = observed  # type: ignore[method-assign]
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), params, prompt_token_ids=ids)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        runs.append((tokens, engine.runner.kv_cache.clone(), rows))
    (padded_tokens, padded_kv, padded_rows), (exact_tokens, exact_kv, exact_rows) = runs
    assert padded_rows[0] == (80, 77) and exact_rows[0] == (77, None)
    assert padded_tokens == exact_tokens
    torch.testing.assert_close(padded_kv, exact_kv, atol=1e-5, rtol=1e-5)
