"""benchmarks/results_index.py: the pages that show benchmark results are generated from the records, and
the committed ones match them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    # benchmarks/ is a folder of scripts, not an installed package: load the module from its file.
    spec = importlib.util.spec_from_file_location("bench_results_index", ROOT / "benchmarks" / "results_index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ri = _load()

TXT_RECORD = """# 2026-12-02T23:02:50Z  commit bbb0ced  command: python benchmarks/step_ab.py --rows 32,64
machine: AMD EPYC (family 26 model 2); ISA avx2 avx512f avx512_bf16 avx512_vnni; 2 cores; commit bbb0ced; dtype bfloat16
decode step, ms: ...
{"base": "24f59c9", "step_ms": {"32": {"base": 31.18, "new": 27.04}}, "base_over_new": {"32": 1.151}}
"""


def _serving_record(date: str, ratio: float) -> str:
    w = {"ratio": ratio, "ours_tok_s": 700.0, "vllm_tok_s": 700.0 / ratio, "ours_ttft_p50": 900.0,
         "vllm_ttft_p50": 1300.0, "ours_tpot_p50": 37.0, "vllm_tpot_p50": 49.0}
    return json.dumps({"date": date, "command": "benchmarks/serving_vs_vllm.py --workloads 32",
                       "machine": {"cpu": "AMD EPYC", "isa": ["avx2"], "commit": "abc1234"},
                       "final": {"workload_32": w, "served_over_offline": 0.93, "rounds": 3}})


def _slot(results: Path, benchmark: str, cls: str, name: str, text: str) -> Path:
    slot = results / benchmark / cls
    slot.mkdir(parents=True)
    (slot / name).write_text(text)
    return slot


def test_committed_pages_match_the_records() -> None:
    """docs/performance.md, the results index and README's table are what the records give today."""
    stale = [str(p.relative_to(ROOT)) for p in ri.stale(ri.render())]
    assert not stale, f"stale: {', '.join(stale)}; regenerate them with `{ri.COMMAND}` and commit the result"


def test_every_kept_record_has_figures_and_a_machine() -> None:
    kept = ri.records()
    assert {r.benchmark for r in kept} <= set(ri.BENCHMARKS), "a benchmark without a figures function"
    for r in kept:
        assert ri.figures(r), r.path
        assert r.date != "unknown" and r.commit != "unknown", r.path
        assert (ROOT / r.path).is_file()


def test_a_txt_record_is_read_from_its_header_and_last_json_line() -> None:
    r = ri.parse("step_ab", "avx512-bf16", "benchmarks/results/step_ab/avx512-bf16/record.txt", TXT_RECORD)
    assert (r.date, r.commit, r.cpu) == ("2026-12-02 23:02", "bbb0ced", "AMD EPYC (family 26 model 2)")
    assert r.command == "python benchmarks/step_ab.py --rows 32,64"
    assert ri.figures(r) == [("decode step time at base 24f59c9 / this commit, 32 sequences",
                              "1.151× (31.18 / 27.04 ms)")]


def test_a_json_record_is_read_from_its_fields() -> None:
    r = ri.parse("serving_vs_vllm", "avx2-fp32", "x/record.json", _serving_record("20261203T040715Z", 1.4))
    assert (r.date, r.commit, r.cpu) == ("2026-12-03 04:07", "abc1234", "AMD EPYC")
    assert ri.figures(r)[:2] == [("chatsvc / vLLM output tok/s; TTFT p50, 32 chats", "1.40×; 0.69×"),
                                 ("chatsvc / vLLM output tok/s, 32 chats", "1.40× (700.0 / 500.0 tok/s)")]


def test_the_serving_headline_names_every_workload_with_its_ttft() -> None:
    """README's row for a serving record: each workload's tok/s ratio, then each one's TTFT p50 ratio (the
    first-token figure a chat user feels), in the record's order of 32, 64, multi-turn, persona."""
    final = json.loads(_serving_record("20261206T030930Z", 1.2))
    w = final["final"]["workload_32"]
    final["final"] |= {"workload_64": {**w, "ratio": 1.1}, "workload_b": {**w, "ratio": 1.05, "ours_ttft_p50": 1300.0},
                       "workload_c": {**w, "ratio": 1.3, "ours_ttft_p50": None}}
    r = ri.parse("serving_vs_vllm", "amx-bf16", "x/record.json", json.dumps(final))
    assert ri.figures(r)[0] == ("chatsvc / vLLM output tok/s; TTFT p50, 32 / 64 / multi-turn / persona",
                                "1.20× / 1.10× / 1.05× / 1.30×; 0.69× / 0.69× / 1.00× / n/a")
    del final["final"]["workload_b"], final["final"]["workload_c"]
    for key in ("32", "64"):
        final["final"][f"workload_{key}"]["ours_ttft_p50"] = None  # a record without the latencies
    r = ri.parse("serving_vs_vllm", "amx-bf16", "x/record.json", json.dumps(final))
    assert ri.figures(r)[0] == ("chatsvc / vLLM output tok/s, 32 / 64 chats", "1.20× / 1.10×")


def test_records_are_found_by_benchmark_and_class(tmp_path: Path) -> None:
    _slot(tmp_path, "step_ab", "avx512-bf16", "record.txt", TXT_RECORD)
    _slot(tmp_path, "serving_vs_vllm", "avx2-fp32", "record.json", _serving_record("20261203T040715Z", 1.4))
    _slot(tmp_path, "serving_vs_vllm", "avx2-fp32-quick", "record.json", _serving_record("20261203T050000Z", 9.0))
    (tmp_path / "serving_vs_vllm" / "empty").mkdir()
    found = {(r.benchmark, r.cls) for r in ri.records(tmp_path)}
    assert found == {("step_ab", "avx512-bf16"), ("serving_vs_vllm", "avx2-fp32")}


def test_a_record_outside_a_class_folder_is_refused(tmp_path: Path) -> None:
    _slot(tmp_path, "step_ab", "My Machine", "record.txt", TXT_RECORD)
    with pytest.raises(ValueError, match="not a machine class"):
        ri.records(tmp_path)


def test_a_replaced_record_joins_the_superseded_list() -> None:
    new = ri.parse("serving_vs_vllm", "avx2-fp32", "benchmarks/results/serving_vs_vllm/avx2-fp32/record.json",
                   _serving_record("20261204T000000Z", 1.2))
    old_entry = {**new.index_entry(), "date": "2026-12-02 07:37"}
    gone = {"benchmark": "huge_pages", "class": "amx-bf16", "path": "benchmarks/results/nowhere/record.txt",
            "date": "2026-12-01 00:00", "commit": "abc", "cpu": "x"}
    earlier = {"path": "benchmarks/results/step_ab.txt", "commit": "0dff254", "why": "run-by-run log"}
    index = ri.build_index([new], {"records": [old_entry, gone], "superseded": [earlier]})
    assert index["records"] == [new.index_entry()]
    assert index["superseded"][0] == earlier  # what the previous index said stays as it was
    replaced, removed = index["superseded"][1:]
    assert (replaced["path"], replaced["date"], replaced["why"]) == (
        new.path, "2026-12-02 07:37", "replaced by the record of 2026-12-04 00:00")
    assert removed["why"] == "removed" and removed["commit"] == "unknown"  # no commit ever held it
    # The next run sees the index it wrote: nothing more is superseded.
    assert ri.build_index([new], index) == index


def test_the_commit_holding_a_superseded_record_is_found_in_history() -> None:
    """The serving record of avx512-bf16 kept today was committed: its commit is found from its date."""
    kept = {(r.benchmark, r.cls): r for r in ri.records()}
    r = kept.get(("serving_vs_vllm", "avx512-bf16"))
    if r is None:
        pytest.skip("no avx512-bf16 serving record kept")
    sha = ri.holding_commit(r.index_entry())
    if sha == "unknown":
        pytest.skip("the record is not committed yet")
    assert ri._git("cat-file", "-t", sha) == "commit"


def test_the_readme_table_links_every_kept_record() -> None:
    kept = ri.records()
    table = ri.readme_table(kept)
    assert table.startswith(ri.BEGIN) and table.endswith(ri.END)
    for r in kept:
        link = Path(r.path).parent.as_posix() + "/"
        assert f"]({link})" in table, link
        assert (ROOT / link).is_dir()


def test_the_readme_needs_its_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        ri.with_readme_table("# no table here\n", "table")
    replaced = ri.with_readme_table(f"a\n{ri.BEGIN}\nold\n{ri.END}\nb\n", "NEW")
    assert replaced == "a\nNEW\nb\n"


def test_check_mode_reports_stale_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "performance.md"
    page.write_text("old\n")
    monkeypatch.setattr(ri, "render", lambda: {page: "new\n"})
    monkeypatch.setattr(ri, "ROOT", tmp_path)
    monkeypatch.setattr("sys.argv", ["results_index.py", "--check"])
    assert ri.main() == 1 and page.read_text() == "old\n"
    monkeypatch.setattr("sys.argv", ["results_index.py"])
    assert ri.main() == 0 and page.read_text() == "new\n"


def test_the_served_session_return_record_reads_ratios_and_seconds_longest_first() -> None:
    def side(ret: float, restart: float | None = None, first: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"return": {"p50": ret}}
        if restart is not None:
            out.update(restart_return={"p50": restart}, restart_first_s=first)
        return out

    final = {"lengths": {
        "512": {"ours_off": side(1.0), "ours": side(0.2, 0.2, 0.3), "ratios": {"recompute_over_ours_p50": 5.0}},
        "2048": {"ours_off": side(4.0), "ours": side(0.5, 0.6, 0.7), "vllm": side(2.0, 3.0, 3.5),
                 "ratios": {"vllm_over_ours_p50": 4.0, "recompute_over_ours_p50": 8.0,
                            "vllm_restart_over_ours_restart_p50": 5.0}}}}
    rows = ri.BENCHMARKS["session_return_vs_vllm"].figures(final)
    assert rows[0] == ("served returning-turn TTFT p50 at 2048 tokens of history: vLLM / chatsvc, recompute / "
                       "chatsvc; after a restart, vLLM / chatsvc", "4.00×, 8.00×; 5.00×")
    assert rows[1][1] == "0.50 / 4.00 / 2.00; 0.60 / 3.00, 0.70 / 3.50"
    assert rows[2][1] == "n/a, 5.00×; n/a"  # a run without vLLM says so
    assert rows[3][1] == "0.20 / 1.00 / n/a; 0.20 / n/a, 0.30 / n/a"


def test_the_papers_records_give_one_row_per_figure_with_the_papers_ratio(tmp_path: Path) -> None:
    runs = [{"workload": "sharegpt", "policy": p, "rate": rate, "mean_batched": b}
            for p, rate, b in (("paged", 0.4, 2.0), ("oracle", 0.4, 1.0), ("paged", 0.8, 9.0), ("max", 0.8, 3.0))]
    final = {"machine": {"cpu": "Intel Xeon", "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
                         "commit": "abc1234"},
             "command": "python benchmarks/paper/latency_vs_rate.py", "runs": runs,
             "summary": {"sharegpt": {"ratio_paged_over": {"max": 2.5, "pow2": None, "oracle": 1.5},
                                      "ratio_bound": {"max": ">=", "pow2": "?", "oracle": "="}},
                         "chatbot": {"ratio_paged_over": {"max": 1.1, "pow2": 1.2, "oracle": 1.3}},
                         "alpaca n=2": {"ratio_paged_over": {"oracle": 1.25}}}}
    (tmp_path / "latency_vs_rate.txt").write_text("the paper's figures\ntable\n" + json.dumps(final) + "\n")
    papers = ri.paper_records(tmp_path)
    assert [(r.benchmark, r.cls, r.commit) for r in papers] == [("latency_vs_rate", "amx-bf16", "abc1234")]
    rows = ri.paper_rows(papers)
    assert len(rows) == 4  # Figs. 12, 13, 14, 17
    assert "**≥2.50× / 1.50×** (paper 2.7-8× / 1.7-2.7×)" in rows[0]  # paged never crossed: a lower bound
    assert "**2.00×** at 0.40 req/s" in rows[1]  # the highest rate both paged and Oracle ran
    assert "n=2" in rows[2] and "**1.25×**" in rows[2]
    assert "**1.10× / 1.20× / 1.30×**" in rows[3]
    assert ri.readme_table([], papers).count("| Paper: latency vs rate |") == 4


def test_a_serving_record_with_ttft_p99_shows_it_beside_p50() -> None:
    final = json.loads(_serving_record("20261206T030930Z", 1.4))
    final["final"]["workload_32"] |= {"ours_ttft_p99": 1500.0, "vllm_ttft_p99": 2500.0}
    r = ri.parse("serving_vs_vllm", "amx-bf16", "x/record.json", json.dumps(final))
    assert ("TTFT p50 / TTFT p99 / TPOT p50 ms, 32 chats, chatsvc vs vLLM",
            "900 / 1,500 / 37.0 vs 1,300 / 2,500 / 49.0") in ri.figures(r)
