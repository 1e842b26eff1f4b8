"""The runner's persistent block tables: rebuilt from the plan's table updates alone, grown as needed, and
gathered for a step without reading anything past a sequence's own blocks; and steps padded to GEMM row
buckets."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_model import make_tiny_model_dir

from engine.engine import LLMEngine
from engine.model.linear import SLOW_ROWS, probe_slow_rows
from engine.plan import ScheduledSeq
from engine.request import SamplingParams, SequenceGroup
from engine.runner import BlockTables, kv_pool


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


@dataclass
class _Traced:
    engine: LLMEngine
    rows: list[tuple[int, int]] = field(default_factory=list)  # per step: (rows run, real rows)
    heads: list[int] = field(default_factory=list)  # rows per LM head call


def _traced_engine(model_dir: str, attention_backend: str, pad_rows: bool, slow_rows: range | None) -> _Traced:
    """An engine on the tiny model (packed linears) whose runner records the rows of each step and LM head call."""
    engine = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn", num_kv_blocks=64,
                                 attention_backend=attention_backend)
    engine.runner.pad_rows, engine.runner.slow_rows = pad_rows, slow_rows
    traced = _Traced(engine)
    prepare, logits_of = engine.runner.prepare, engine.runner.model.compute_logits

    def observed(scheduled: Any) -> Any:
        inp = prepare(scheduled)
        traced.rows.append((int(inp.input_ids.shape[0]), int(inp.attn_metadata.query_start_loc[-1])))
        return inp

    def head(hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        traced.heads.append(int(hidden.shape[0]))
        out: torch.Tensor = logits_of(hidden, widen)
        return out

    engine.runner.prepare = observed  # type: ignore[method-assign]
    engine.runner.model.compute_logits = head  # type: ignore[method-assign]
    return traced


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
              late: list[int] | None = None) -> dict[str, list[int]]:
    """Greedy tokens per request; ``late`` joins after the first step."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), params, prompt_token_ids=ids)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 1 and late is not None:
            engine.add_request("late", params, prompt_token_ids=late)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        steps += 1
    return tokens


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_padded_rows_change_no_token_and_no_kv(tmp_path: Path, attention_backend: str) -> None:
    """A step padded to a GEMM row bucket stores and samples exactly what the unpadded step does, with the
    C++ kernels and with torch's: a prefill step, then a step mixing decodes with a prompt."""
    model_dir = str(make_tiny_model_dir(tmp_path))
    first = [[10 + 90 * k + i for i in range(n)] for k, n in enumerate((30, 25))]  # 55 tokens: exact
    late = [200 + i for i in range(70)]  # with the two decodes: 72 rows, padded to 80
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    padded, exact = (_traced_engine(model_dir, attention_backend, pad, None) for pad in (True, False))
    padded_tokens, exact_tokens = (_generate(t.engine, first, params, late) for t in (padded, exact))
    assert padded.rows[:2] == [(55, 55), (80, 72)] and exact.rows[:2] == [(55, 55), (72, 72)]
    assert all(n == real for n, real in padded.rows[2:])  # decode-only steps are not padded out of the band
    assert padded_tokens == exact_tokens
    torch.testing.assert_close(padded.engine.runner.kv_cache, exact.engine.runner.kv_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_slow_band_decodes_are_padded_and_change_no_token_and_no_kv(tmp_path: Path, attention_backend: str) -> None:
    """With a slow row band (as the probe finds on AMX Xeons), 20 decoding sequences run as 33 rows, the LM
    head too, and store and sample exactly what unpadded steps do."""
    model_dir = str(make_tiny_model_dir(tmp_path))
    prompts = [[10 + 7 * k + i for i in range(3 + k % 4)] for k in range(20)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    padded, exact = (_traced_engine(model_dir, attention_backend, True, band) for band in (SLOW_ROWS, None))
    padded_tokens, exact_tokens = (_generate(t.engine, prompts, params) for t in (padded, exact))
    assert padded.rows[0] == exact.rows[0] == (96, 90)  # the prompts: a row bucket either way
    assert padded.rows[1:] == [(33, 20)] * 4 and exact.rows[1:] == [(20, 20)] * 4  # the decodes
    assert 33 in padded.heads and 20 in exact.heads and not set(padded.heads) & set(SLOW_ROWS)
    assert all(len(t) == 5 for t in padded_tokens.values()) and padded_tokens == exact_tokens
    torch.testing.assert_close(padded.engine.runner.kv_cache, exact.engine.runner.kv_cache, atol=1e-5, rtol=1e-5)


def test_probe_finds_a_band_only_where_padding_wins() -> None:
    def probe(last_s: float, padded_s: float) -> range | None:
        now = [0.0]

        def run(rows: int) -> None:  # a pass "takes" its time on the probe's clock
            now[0] += padded_s if rows == SLOW_ROWS.stop else last_s

        return probe_slow_rows(run, clock=lambda: now[0])

    assert probe(0.040, 0.028) == SLOW_ROWS
    assert probe(0.025, 0.0245) == SLOW_ROWS  # no slower: padded, in case the band turns slow later
    assert probe(0.025, 0.0255) is None  # 33 rows costs more: left alone
    assert probe(0.025, 0.030) is None


def test_kv_pools_are_head_major_blocks_seen_token_major(tmp_path: Path) -> None:
    """The runner's pools (device and CPU swap space) have the kernels' shape [layers, 2, blocks, block_size,
    Hkv, D]; in memory each block holds one KV head's rows after another (a decode reads one head), and is one
    dense run, so whole-block copies and swaps move it in one piece."""
    pool = kv_pool((2, 2, 5, 16, 3, 8), torch.float32, "cpu")
    assert pool.shape == (2, 2, 5, 16, 3, 8) and not pool.any()
    assert pool.stride() == (2 * 5 * 3 * 16 * 8, 5 * 3 * 16 * 8, 3 * 16 * 8, 8, 16 * 8, 1)
    pool[1, 0, 2, 5, 1, 0] = 1.0  # token 5 of block 2, KV head 1: head 1's run starts 16 rows into the block
    assert pool.transpose(3, 4).contiguous().view(-1).nonzero().item() == ((1 * 2 + 0) * 5 + 2) * 3 * 16 * 8 + (
        1 * 16 + 5) * 8
    engine = LLMEngine.from_args(str(make_tiny_model_dir(tmp_path)), dtype="float32", num_kv_blocks=16,
                                 swap_space_mb=1)
    for cache in (engine.runner.kv_cache, engine.runner.cpu_cache):
        assert cache.shape[4] > 1 and cache.transpose(3, 4).is_contiguous() and not cache.is_contiguous()
    assert not engine.runner.kv_cache.any()  # what the kernels read is zeroed; the swap space need not be


def test_the_slow_row_probe_runs_once_per_machine_and_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine of the same model, dtype and threads takes the first one's probe decision from the
    cache directory instead of running the linears again; another thread count probes anew. (The torch
    attention backend: its decodes stay on oneDNN, where the C++ build's GEMM would skip the probe.)"""
    from engine.model.llama import LlamaForCausalLM

    monkeypatch.setenv("CHATSVC_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = make_tiny_model_dir(tmp_path / "m")
    passes: list[int] = []
    run_linears = LlamaForCausalLM.run_linears

    def counted(self: LlamaForCausalLM, rows: int) -> None:
        passes.append(rows)
        run_linears(self, rows)

    monkeypatch.setattr(LlamaForCausalLM, "run_linears", counted)
    threads = torch.get_num_threads()
    try:
        first = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn",
                                    attention_backend="torch", num_kv_blocks=16)
        probed = len(passes)
        second = LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn",
                                     attention_backend="torch", num_kv_blocks=16)
        assert probed >= 2 and len(passes) == probed
        assert second.runner.slow_rows == first.runner.slow_rows
        torch.set_num_threads(1 if threads > 1 else 2)
        LLMEngine.from_args(model_dir, dtype="float32", linear_backend="onednn",
                            attention_backend="torch", num_kv_blocks=16)
        assert len(passes) > probed
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads((tmp_path / "cache" / "gemm_probes.json").read_text())) == 2


def test_no_slow_row_probe_where_a_decode_runs_on_the_kernels_gemm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 in the AVX512-BF16 build: a decode's rows take amx_linear or bf16_linear, which have no slow row
    band to pad out of."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no native bf16 here: the linears are not packed")
    monkeypatch.setenv("CHATSVC_CACHE_DIR", str(tmp_path / "cache"))
    engine = LLMEngine.from_args(make_tiny_model_dir(tmp_path / "m"), dtype="bfloat16", num_kv_blocks=16)
    ext = getattr(engine.runner.model.backend, "ext", None)
    decode = ext is not None and bool(ext.amx_linear_supported() or ext.bf16_linear_supported())
    assert (engine.runner.model.lm_head_decode is not None) == decode
    assert (engine.runner.slow_rows is None) if decode else (tmp_path / "cache" / "gemm_probes.json").exists()
