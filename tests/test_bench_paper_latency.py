"""benchmarks/paper/latency_vs_rate.py: the sustained-rate reading of a curve, and a --quick smoke run of the
real engine that writes the record and the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))

from latency_vs_rate import Run, Sweep  # noqa: E402


def _run(policy: str, rate: float, latency: float, stopped: bool = False) -> Run:
    return Run("w", policy, rate, 10, 10, 1.0, latency, 1.0, 1.0, 1.0, 0, stopped)


def test_sustained_rate_interpolates_the_threshold_crossing() -> None:
    sweep = Sweep("w", base_rate=1.0, unloaded_latency=0.1, threshold=0.4)
    sweep.runs += [_run("paged", 1, 0.1), _run("paged", 2, 0.2), _run("paged", 4, 0.6)]
    sweep.runs += [_run("max", 1, 0.3), _run("max", 2, 0.5)]
    sweep.runs += [_run("oracle", 1, 0.9)]
    sweep.runs += [_run("pow2", 1, 0.1), _run("pow2", 2, 0.1)]
    assert sweep.sustained("paged") == pytest.approx(2 + 2 * (0.2 / 0.4))  # 3.0
    assert sweep.sustained("max") == pytest.approx(1.5)
    assert sweep.sustained("oracle") is None  # above the threshold at the lowest rate
    assert sweep.sustained("pow2") == 2  # never crossed: the highest rate swept
    assert sweep.ratio("max") == pytest.approx(2.0)
    assert sweep.ratio("oracle") is None
    # A run stopped while still busy did not keep up: it crosses the threshold even below it.
    stopped = Sweep("w", base_rate=1.0, unloaded_latency=0.1, threshold=0.4)
    stopped.runs += [_run("paged", 1, 0.2), _run("paged", 2, 0.3, stopped=True)]
    assert stopped.over(stopped.runs[1]) and stopped.sustained("paged") == pytest.approx(2.0)
    stopped.runs[0] = _run("paged", 1, 0.2, stopped=True)
    assert stopped.sustained("paged") is None


def test_a_curve_that_never_crosses_makes_the_ratio_a_bound() -> None:
    sweep = Sweep("w", base_rate=1.0, unloaded_latency=0.1, threshold=0.4)
    sweep.runs += [_run("paged", 1, 0.1), _run("paged", 2, 0.2)]  # never crosses: sustains >= 2
    sweep.runs += [_run("max", 1, 0.3), _run("max", 2, 0.5)]  # crosses at 1.5
    sweep.runs += [_run("oracle", 1, 0.1), _run("oracle", 2, 0.3)]  # never crosses either
    assert sweep.never_crossed("paged") and not sweep.never_crossed("max")
    assert sweep.bound("max") == ">=" and sweep.ratio("max") == pytest.approx(2 / 1.5)
    assert sweep.bound("oracle") == "?" and sweep.ratio("oracle") is None  # 2 / 2 would read as measured
    crossing = Sweep("w", base_rate=1.0, unloaded_latency=0.1, threshold=0.4)
    crossing.runs += [_run("paged", 1, 0.1), _run("paged", 2, 0.6), _run("pow2", 1, 0.1), _run("pow2", 2, 0.2)]
    assert crossing.bound("pow2") == "<=" and crossing.ratio("pow2") == pytest.approx(1.6 / 2)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.long  # minutes of arrivals in wall-clock time, mostly idle: .ci/run runs it
def test_quick_run_writes_the_record_and_figures(tmp_path: Path) -> None:
    output = tmp_path / "latency_vs_rate.txt"
    proc = subprocess.run([sys.executable, "benchmarks/paper/latency_vs_rate.py", "--quick", "--output", str(output)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = output.read_text().splitlines()
    assert lines[1].startswith("machine: ") and lines[2].startswith("command: python benchmarks/paper/")
    record = json.loads(lines[-1])
    assert set(record["summary"]) == {"sharegpt", "alpaca", "chatbot", "alpaca n=2", "alpaca beam=2"}
    runs = record["runs"]
    for name, policies in (("sharegpt", {"paged", "max", "pow2", "oracle"}), ("alpaca n=2", {"paged", "oracle"}),
                           ("alpaca beam=2", {"paged", "oracle"}), ("chatbot", {"paged", "max", "pow2", "oracle"})):
        ran = [r for r in runs if r["workload"] == name]
        assert {r["policy"] for r in ran} == policies
        assert all(r["requests"] >= 2 and r["normalized_latency"] > 0 for r in ran)
    assert any(r["finished"] == r["requests"] and r["mean_batched"] >= 1 for r in runs)
    for figure in (12, 13, 14, 17):
        assert (tmp_path / f"latency_vs_rate_fig{figure}.png").stat().st_size > 10_000
