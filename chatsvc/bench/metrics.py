"""Per-request timings and the summary statistics computed from them.

Definitions follow vLLM's ``bench serve`` so numbers are comparable across tools:
TTFT is send -> first non-empty content delta; TPOT is (E2E - TTFT) / (output tokens - 1) per
request (requests with one output token have none); ITL pools every gap between consecutive
content deltas of all requests; throughputs divide by the wall-clock duration of the run.
Percentiles use linear interpolation (numpy's default), as vLLM does.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request (one chat turn) as the client saw it; times are ``time.perf_counter()`` seconds."""

    session: int
    turn: int
    start: float
    end: float | None = None
    # Arrival time of each non-empty content delta, in order.
    delta_times: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    token_source: str | None = None  # "usage", "tokenizer" or "deltas" once counted
    finish_reason: str | None = None
    error: str | None = None  # error kind ("http_503", "timeout", ...) or None on success
    error_detail: str = ""
    cancelled: bool = False  # cut off by --duration or Ctrl-C; neither success nor error

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.delta_times[0] - self.start if self.delta_times else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        n, ttft, lat = self.output_tokens, self.ttft, self.latency
        if n is None or n < 2 or ttft is None or lat is None:
            return None
        return (lat - ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_times, self.delta_times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method); ``q`` in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 of ``values`` times ``scale``; None for an empty list (valid JSON)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    tails = {f"p{q}": percentile(values, q) * scale for q in (50, 90, 99)}
    return {"mean": sum(values) / len(values) * scale, **tails}


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` (milliseconds) -> ``{"ttft": 500.0, "tpot": 50.0}``; keys ttft, tpot, e2e."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        key = {"e2el": "e2e", "latency": "e2e"}.get(key, key)
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"bad SLO {part!r}: expected ttft=MS, tpot=MS or e2e=MS")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"SLO {key} must be > 0 ms")
        slo[key] = ms
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """A request is good when it succeeded and every given bound holds (a missing TPOT counts as 0)."""
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2e": rec.latency}
    return rec.ok and all((v := values[key]) is not None and v * 1000.0 <= ms for key, ms in slo.items())


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The report's numbers. ``requests`` counts every request sent, so
    ``requests == completed + sum(errors.values()) + cancelled``."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if r.error is not None and not r.cancelled]
    cancelled = sum(1 for r in records if r.cancelled)
    out_tokens = sum(r.output_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    dur = max(duration_s, 1e-9)
    ttfts = [t for r in done if (t := r.ttft) is not None]
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = [g for r in done for g in r.itls]
    e2es = [t for r in done if (t := r.latency) is not None]
    # The paper's normalized latency: per request E2E / output tokens, averaged (s/token).
    norm = [r.latency / r.output_tokens for r in done if r.latency is not None and r.output_tokens]
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "cancelled": cancelled,
        "errors": dict(sorted(Counter(r.error for r in failed if r.error).items())),
        "duration_s": duration_s,
        "request_s": len(done) / dur,
        "output_tok_s": out_tokens / dur,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": in_tokens,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "ttft_ms": describe(ttfts, 1000.0),
        "tpot_ms": describe(tpots, 1000.0),
        "itl_ms": describe(itls, 1000.0),
        "e2e_ms": describe(e2es, 1000.0),
        "normalized_latency_s_per_token": sum(norm) / len(norm) if norm else None,
        "token_count_source": dict(sorted(Counter(r.token_source or "none" for r in done).items())),
    }
    if slo:
        good = sum(1 for r in done if meets_slo(r, slo))
        summary["slo_ms"] = dict(slo)
        summary["goodput_req_s"] = good / dur
        summary["slo_attainment"] = good / len(records) if records else None
    return summary


def throughput_timeline(records: list[RequestRecord], t0: float, bin_s: float = 1.0) -> list[tuple[float, float]]:
    """Output tokens/s per time bin since ``t0``. A request's tokens are spread evenly over its deltas
    (a delta can carry several tokens; only the total per request is known)."""
    bins: defaultdict[int, float] = defaultdict(float)
    for r in records:
        if not r.delta_times or not r.output_tokens:
            continue
        per_delta = r.output_tokens / len(r.delta_times)
        for t in r.delta_times:
            bins[int((t - t0) // bin_s)] += per_delta
    if not bins:
        return []
    last = max(bins)
    return [((i + 0.5) * bin_s, bins.get(i, 0) / bin_s) for i in range(0, last + 1)]
