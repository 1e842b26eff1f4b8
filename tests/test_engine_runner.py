"""The runner's persistent block tables: rebuilt from the plan's table updates alone, grown as needed, and
gathered for a step without reading anything past a sequence's own blocks; and steps padded to GEMM row
buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import LLMEngine
from engine.model.linear import SLOW_ROWS, probe_slow_rows
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


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_padded_rows_change_no_token_and_no_kv(tmp_path: Path, attention_backend: str) -> None:
    """A step padded to a GEMM row bucket stores and samples exactly what the unpadded step does, with the
    C++ kernels and with torch's: a prefill step, then a step mixing decodes with a prompt."""
    model_dir = str(make_tiny_model_dir(tmp_path))
    first = [[10 + 90 * k + i for i in range(n)] for k, n in enumerate((30, 25))]  # 55 tokens: exact
    late = [200 + i for i in range(70)]  # with the two decodes: 72 rows, padded to 80
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for pad in (True, False):
        engine = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn", num_kv_blocks=64,
                                     attention_backend=attention_backend)
        engine.runner.pad_rows = pad
        rows: list[tuple[int, int]] = []
        prepare = engine.runner.prepare

        def observed(scheduled: Any, prepare: Any = prepare, rows: list[tuple[int, int]] = rows) -> Any:
            inp = prepare(scheduled)
            rows.append((int(inp.input_ids.shape[0]), int(inp.attn_metadata.query_start_loc[-1])))
            return inp

        engine.runner.prepare = observed  # type: ignore[method-assign]
        for i, ids in enumerate(first):
            engine.add_request(str(i), params, prompt_token_ids=ids)
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            if steps == 1:
                engine.add_request("late", params, prompt_token_ids=late)
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            steps += 1
        runs.append((tokens, engine.runner.kv_cache.clone(), rows))
    (padded_tokens, padded_kv, padded_rows), (exact_tokens, exact_kv, exact_rows) = runs
    assert padded_rows[:2] == [(55, 55), (80, 72)] and exact_rows[:2] == [(55, 55), (72, 72)]
    assert all(n == real for n, real in padded_rows[2:])  # decode-only steps are never padded
    assert padded_tokens == exact_tokens
    torch.testing.assert_close(padded_kv, exact_kv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_slow_band_decodes_are_padded_and_change_no_token_and_no_kv(tmp_path: Path, attention_backend: str) -> None:
    """With a slow row band (as the probe finds on AMX Xeons), 20 decoding sequences run as 33 rows, the LM
    head too, and store and sample exactly what unpadded steps do."""
    model_dir = str(make_tiny_model_dir(tmp_path))
    prompts = [[10 + 7 * k + i for i in range(3 + k % 4)] for k in range(20)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = []
    for band in (SLOW_ROWS, None):
        engine = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn", num_kv_blocks=64,
                                     attention_backend=attention_backend)
        engine.runner.slow_rows = band
        rows: list[tuple[int, int]] = []
        heads: list[int] = []
        prepare, logits_of = engine.runner.prepare, engine.runner.model.compute_logits

        def observed(scheduled: Any, prepare: Any = prepare, rows: list[tuple[int, int]] = rows) -> Any:
            inp = prepare(scheduled)
            rows.append((int(inp.input_ids.shape[0]), int(inp.attn_metadata.query_start_loc[-1])))
            return inp

        def head(hidden: torch.Tensor, logits_of: Any = logits_of, heads: list[int] = heads) -> torch.Tensor:
            heads.append(int(hidden.shape[0]))
            out: torch.Tensor = logits_of(hidden)
            return out

        engine.runner.prepare = observed  # type: ignore[method-assign]
        engine.runner.model.compute_logits = head  # type: ignore[method-assign]
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), params, prompt_token_ids=ids)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        runs.append((tokens, engine.runner.kv_cache.clone(), rows, heads))
    (padded_tokens, padded_kv, padded_rows, padded_heads), (exact_tokens, exact_kv, exact_rows, exact_heads) = runs
    assert padded_rows[0] == exact_rows[0] == (96, 90)  # the prompts: a row bucket either way
    assert padded_rows[1:] == [(33, 20)] * 4 and exact_rows[1:] == [(20, 20)] * 4  # the decodes
    assert 33 in padded_heads and 20 in exact_heads and not set(padded_heads) & set(SLOW_ROWS)
    assert all(len(t) == 5 for t in padded_tokens.values()) and padded_tokens == exact_tokens
    torch.testing.assert_close(padded_kv, exact_kv, atol=1e-5, rtol=1e-5)


def test_probe_finds_a_band_only_where_padding_wins() -> None:
    def probe(last_s: float, padded_s: float) -> range | None:
        now = [0.0]

        def run(rows: int) -> None:  # a pass "takes" its time on the probe's clock
            now[0] += padded_s if rows == SLOW_ROWS.stop else last_s

        return probe_slow_rows(run, clock=lambda: now[0])

    assert probe(0.040, 0.028) == SLOW_ROWS
    assert probe(0.025, 0.022) == SLOW_ROWS  # 12% is worth one padded row
    assert probe(0.025, 0.025) is None
    assert probe(0.025, 0.030) is None
