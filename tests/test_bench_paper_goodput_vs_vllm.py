"""benchmarks/paper/goodput_vs_vllm.py without the servers: the rate grid, the runs' caps and order, the
``chatsvc bench`` flags it sends, the points it reads from bench's reports, and the record and figure."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))

import goodput_vs_vllm as gv  # noqa: E402

import chatsvc.bench as cb  # noqa: E402
from chatsvc.bench.metrics import RequestRecord, parse_slo, summarize  # noqa: E402

SLO = parse_slo(gv.DEFAULT_SLO)


def _point(server: str, rate: float, goodput: float, cancelled: int = 0, latency: float | None = 0.05) -> gv.Point:
    return gv.Point(server, rate, 10, 10 - cancelled, cancelled, 0, 10.0, rate, goodput, goodput / rate, 300.0,
                    900.0, 40.0, latency, 100.0, 500.0)


def test_the_grid_is_the_multipliers_of_the_capacity_ascending_and_distinct() -> None:
    assert gv.rate_grid(4.37, [2.0, 0.25, 0.5, 1.0]) == [1.1, 2.2, 4.4, 8.7]
    # Multipliers that round to the same rate give it once.
    assert gv.rate_grid(1.0, [1.0, 1.001, 0.5]) == [0.5, 1.0]
    assert gv.round_sig(0.01234) == 0.012 and gv.round_sig(123.4) == 120
    with pytest.raises(ValueError):
        gv.rate_grid(0.0, [1.0])


def test_a_run_has_the_windows_requests_and_is_cut_when_no_request_could_still_meet_the_slo() -> None:
    assert gv.requests_at(2.0, 50.0, 10) == 100
    assert gv.requests_at(0.1, 50.0, 10) == 10
    # TTFT 2 s + 127 tokens x 100 ms: no request running longer can meet the SLO.
    assert gv.e2e_bound_s(SLO, 128) == pytest.approx(14.7)
    assert gv.e2e_bound_s({**SLO, "e2e": 5000.0}, 128) == pytest.approx(5.0)
    assert gv.e2e_bound_s({"ttft": 500.0}, 128) is None
    assert gv.run_cap_s(40.0, SLO, 128) == pytest.approx(40.0 + 14.7 + gv.CAP_SLACK_S)
    assert gv.run_cap_s(40.0, {"ttft": 500.0}, 128) == pytest.approx(40.0 + gv.UNBOUNDED_DRAIN_S + gv.CAP_SLACK_S)


def test_servers_alternate_who_goes_first_and_a_rate_runs_only_when_both_runs_fit() -> None:
    assert [gv.order_at(i, ["ours", "vllm"]) for i in range(3)] == [["ours", "vllm"], ["vllm", "ours"],
                                                                    ["ours", "vllm"]]
    assert gv.order_at(1, ["ours"]) == ["ours"]
    per_run = 60.0 + gv.svv.PAUSE_S + gv.BENCH_START_S
    assert gv.fits(0.0, 2 * per_run, 60.0, 2)
    assert not gv.fits(1.0, 2 * per_run, 60.0, 2)


def test_the_bench_flags_parse_as_chatsvc_benchs_own(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cb.add_arguments(parser)
    data = tmp_path / "prompts.json"
    a = parser.parse_args(gv.bench_args(25, 0.5, 128, data, "ttft=2000,tpot=100", 74.7))
    assert (a.sessions, a.turns, a.rate, a.max_tokens, a.temperature) == (25, 1, 0.5, 128, 0.0)
    assert (a.dataset, a.slo, a.duration, a.request_timeout, a.ignore_eos) == (str(data), "ttft=2000,tpot=100",
                                                                               74.7, 74.7, False)
    # The probe: every request at once, no SLO. After serving_vs_vllm.bench's own --duration, this one wins.
    probe = parser.parse_args(["--duration", "900", *gv.bench_args(32, None, 128, data, None, 300.0)])
    assert probe.rate == float("inf") and probe.slo is None and probe.duration == 300.0


def test_default_and_quick_settings() -> None:
    a = gv.parse_args([])
    assert (a.slo, a.max_tokens, a.multipliers, a.rates, a.settle_s) == (
        "ttft=2000,tpot=100", 128, list(gv.DEFAULT_MULTIPLIERS), None, 150.0)
    q = gv.parse_args(["--quick", "--rates", "1,3"])
    assert (q.multipliers, q.rates, q.max_tokens, q.settle_s) == (list(gv.QUICK_MULTIPLIERS), [1.0, 3.0], 16, 0.0)
    with pytest.raises(SystemExit):
        gv.parse_args(["--slo", "ttft=-1"])


def test_a_point_is_read_from_a_bench_report() -> None:
    def rec(session: int, ttft: float, tpot: float, tokens: int = 11) -> RequestRecord:
        r = RequestRecord(session=session, turn=0, start=0.0, output_tokens=tokens)
        r.delta_times = [ttft + tpot * i for i in range(tokens)]
        r.end = r.delta_times[-1]
        return r

    cancelled = RequestRecord(session=3, turn=0, start=0.0, cancelled=True)
    records = [rec(0, 0.5, 0.05), rec(1, 0.5, 0.2), rec(2, 3.0, 0.05), cancelled]
    report = summarize(records, 10.0, SLO)
    report["client_cpu_s"] = 1.5
    p = gv.point_from_summary("vllm", 0.4, json.loads(json.dumps(report)), (0.1, 0.2, 0.3), (1.0, 0.5, 0.4))
    # Only the first meets both bounds: the second's TPOT and the third's TTFT are over.
    assert (p.requests, p.completed, p.cancelled, p.errors) == (4, 3, 1, 0)
    assert p.goodput_req_s == pytest.approx(0.1) and p.achieved_req_s == pytest.approx(0.3)
    assert p.slo_attainment == pytest.approx(0.25) and p.output_tokens_per_request == pytest.approx(11)
    assert p.ttft_p50_ms == pytest.approx(500.0) and p.tpot_p50_ms == pytest.approx(50.0)
    assert p.cut and p.client_cpu_s == 1.5 and p.load_before == (0.1, 0.2, 0.3)


def test_the_peak_and_the_ratio_of_the_peaks() -> None:
    points = [_point("ours", 1.0, 0.9), _point("vllm", 1.0, 0.9), _point("ours", 2.0, 1.8), _point("vllm", 2.0, 1.2),
              _point("ours", 4.0, 0.4, cancelled=5), _point("vllm", 4.0, 1.2)]
    result = gv.summary(points)
    assert result["ours"] == {"peak_goodput_req_s": 1.8, "at_rate": 2.0, "past_peak": True}
    # Equal goodput at two rates: the lower one is the peak.
    assert result["vllm"] == {"peak_goodput_req_s": 1.2, "at_rate": 2.0, "past_peak": True}
    assert result["ratio_ours_over_vllm"] == 1.5
    rising = gv.summary([_point("ours", 1.0, 0.9), _point("ours", 2.0, 1.9)])
    assert rising["ours"]["past_peak"] is False
    assert rising["vllm"] is None and rising["ratio_ours_over_vllm"] is None
    assert "may still rise" in gv.peak_lines(rising, "ttft=2000,tpot=100")[0]


def test_the_record_ends_with_its_json_and_the_figure_is_written(tmp_path: Path) -> None:
    points = [_point("ours", 1.0, 0.9), _point("vllm", 1.0, 0.8), _point("vllm", 3.0, 0.5, cancelled=4),
              _point("ours", 3.0, 2.0, latency=None)]
    result = gv.summary(points)
    lines = gv.record_lines(["title", "machine: m"], points, result, "ttft=2000,tpot=100", {"quick": True})
    assert lines[:2] == ["title", "machine: m"]
    rows = [line for line in lines if line.lstrip().startswith(("1 ", "3 "))]
    assert len(rows) == 4 and "cut at the cap: 4 cancelled" in rows[2] and gv.LABELS["ours"] in rows[0]
    assert "peak goodput, ours / vLLM: 2.50x" in lines
    record = json.loads(lines[-1])
    assert record["quick"] is True and record["summary"]["ratio_ours_over_vllm"] == 2.5
    assert [p["server"] for p in record["points"]] == ["ours", "vllm", "vllm", "ours"]
    png = gv.plot(points, "ttft=2000,tpot=100", tmp_path / "goodput.png", "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
