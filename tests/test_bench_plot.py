"""PNG output: the run figure and the sweep figure are written and are real PNGs."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatsvc.bench.metrics import RequestRecord
from chatsvc.bench.plot import plot_run, plot_sweep

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # matplotlib import and rendering take ~2 s
def test_plots_are_pngs(tmp_path: Path) -> None:
    recs = [RequestRecord(i, 0, 0.1 * i, end=0.1 * i + 1.0, delta_times=[0.1 * i + 0.2 + 0.1 * k for k in range(8)],
                          output_tokens=8) for i in range(5)]
    recs.append(RequestRecord(9, 0, 0.2, error="timeout"))
    run_png = tmp_path / "run.png"
    plot_run(recs, 0.0, run_png)
    points = [{"label": lbl, "rate": r, "normalized_latency_s_per_token": 0.1 * r, "request_s": r,
               "goodput_req_s": None} for lbl in ("ours", "vllm") for r in (1.0, 2.0)]
    sweep_png = tmp_path / "sweep.png"
    plot_sweep(points, sweep_png)
    for p in (run_png, sweep_png):
        data = p.read_bytes()
        assert data[:8] == PNG and len(data) > 10_000
