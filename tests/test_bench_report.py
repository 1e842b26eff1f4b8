"""Summary table and JSON writing."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from chatsvc.bench.metrics import RequestRecord, summarize
from chatsvc.bench.report import summary_table, sweep_table, write_json


def sample_summary() -> dict:
    recs = [RequestRecord(0, 0, 0.0, end=0.5, delta_times=[0.1, 0.3], output_tokens=3, token_source="usage"),
            RequestRecord(1, 0, 0.0, error="http_503")]
    s = summarize(recs, 1.0, {"ttft": 200.0})
    s.update(label="srv", rate=2.0)
    return s


def render(table: object) -> str:
    c = Console(record=True, width=140)
    c.print(table)
    return c.export_text()


def test_summary_table_shows_numbers_and_errors() -> None:
    text = render(summary_table(sample_summary(), "t"))
    assert "TTFT (ms)" in text and "100.0" in text  # the only TTFT is 100 ms
    assert "2 / 1" in text and "http_503: 1" in text
    assert "goodput" in text and "usage: 1" in text


def test_sweep_table_has_a_row_per_point() -> None:
    text = render(sweep_table([sample_summary(), {**sample_summary(), "rate": 4.0}]))
    assert text.count("srv") == 2 and "4.00" in text


def test_write_json_turns_nan_and_inf_into_null(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "r.json"
    write_json(p, {"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}})
    assert json.loads(p.read_text()) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
