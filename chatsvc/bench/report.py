"""The summary table (rich) and the JSON report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _f(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def summary_table(s: dict[str, Any], title: str = "chatsvc bench") -> Table:
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    for label, key in LATENCIES:
        t.add_row(f"{label} (ms)", *(_f(s[key][c]) for c in ("mean", "p50", "p90", "p99")))
    t.add_section()
    errors = s.get("errors") or {}
    rows = [
        ("requests sent / completed", f"{s['requests']} / {s['completed']}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"),
        ("cancelled (duration / Ctrl-C)", str(s.get("cancelled", 0))),
        ("duration (s)", _f(s["duration_s"], 2)),
        ("request throughput (req/s)", _f(s["request_s"], 3)),
        ("output throughput (tok/s)", _f(s["output_tok_s"], 1)),
        ("output / prompt tokens", f"{s['total_output_tokens']} / {s['total_prompt_tokens']}"),
        ("normalized latency (s/token)", _f(s.get("normalized_latency_s_per_token"), 4)),
        ("output tokens counted by", ", ".join(f"{k}: {v}" for k, v in s.get("token_count_source", {}).items())),
    ]
    if s.get("cached_prompt_tokens") is not None:
        rows.append(("cached prompt tokens", str(s["cached_prompt_tokens"])))
    if s.get("client_cpu_s") is not None:
        rows.append(("load generator CPU (s)", _f(s["client_cpu_s"], 2)))
    if "goodput_req_s" in s:
        slo = ",".join(f"{k}={v:g}" for k, v in s["slo_ms"].items())
        rows.append((f"goodput (req/s, {slo} ms)", _f(s["goodput_req_s"], 3)))
    for name, value in rows:
        t.add_row(name, value, "", "", "")
    return t


def sweep_table(points: list[dict[str, Any]]) -> Table:
    t = Table(title="request-rate sweep", header_style="bold")
    for col in ("server", "rate (/s)", "req/s", "tok/s", "norm. latency (s/tok)", "TTFT p50 (ms)", "goodput", "errors"):
        t.add_column(col, justify="right")
    for p in points:
        t.add_row(
            str(p.get("label", p.get("url"))), _f(p["rate"], 2), _f(p["request_s"], 3), _f(p["output_tok_s"]),
            _f(p.get("normalized_latency_s_per_token"), 4), _f(p["ttft_ms"]["p50"]), _f(p.get("goodput_req_s"), 3),
            str(sum(p["errors"].values())),
        )
    return t


def write_json(path: str | Path, obj: Any) -> None:
    """NaN/inf are not JSON; they become null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(clean(obj), indent=2) + "\n", encoding="utf-8")
