"""Metric math of ``chatsvc bench`` on synthetic timings (no server)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from chatsvc.bench.metrics import (
    RequestRecord,
    describe,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
    throughput_timeline,
)


def rec(start: float, deltas: list[float], end: float | None, tokens: int | None, **kw: object) -> RequestRecord:
    r = RequestRecord(session=0, turn=0, start=start, end=end, delta_times=list(deltas), output_tokens=tokens)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_describe_scales_and_handles_empty() -> None:
    d = describe([0.1, 0.2, 0.3, 0.4], scale=1000.0)
    assert d["mean"] == pytest.approx(250.0)
    assert d["p50"] == pytest.approx(250.0)
    assert d["p90"] == pytest.approx(370.0)
    assert describe([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_request_record_ttft_tpot_itl_follow_vllm_definitions() -> None:
    r = rec(10.0, [10.1, 10.2, 10.4], end=10.5, tokens=5)
    assert r.ttft == pytest.approx(0.1)
    assert r.latency == pytest.approx(0.5)
    # (E2E - TTFT) / (output tokens - 1), not over deltas: a delta may carry several tokens.
    assert r.tpot == pytest.approx((0.5 - 0.1) / 4)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert rec(0.0, [0.3], end=0.3, tokens=1).tpot is None
    assert rec(0.0, [], end=0.3, tokens=0).ttft is None


def test_summarize_counts_every_request_once() -> None:
    records = [
        rec(0.0, [0.1, 0.2], 0.3, 4),
        rec(0.0, [0.3, 0.5, 0.6], 0.6, 7),
        rec(1.0, [1.2], 1.25, 2),
        rec(0.0, [], None, None, error="http_500"),
        rec(0.0, [], None, None, error="timeout"),
        rec(0.0, [], None, None, error="http_500"),
        rec(0.5, [0.6], None, None, cancelled=True),
    ]
    s = summarize(records, duration_s=2.0)
    assert s["requests"] == 7
    assert s["completed"] == 3
    assert s["errors"] == {"http_500": 2, "timeout": 1}
    assert s["cancelled"] == 1
    assert s["requests"] == s["completed"] + sum(s["errors"].values()) + s["cancelled"]
    assert s["total_output_tokens"] == 13
    assert s["output_tok_s"] == pytest.approx(6.5)
    assert s["request_s"] == pytest.approx(1.5)
    ttfts = [100.0, 300.0, 200.0]
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(float(np.percentile(ttfts, 90)))
    tpots = [(0.3 - 0.1) / 3 * 1000, (0.6 - 0.3) / 6 * 1000, (0.25 - 0.2) / 1 * 1000]
    assert s["tpot_ms"]["mean"] == pytest.approx(sum(tpots) / 3)
    itls = [100.0, 200.0, 100.0]  # pooled over requests; a single-delta request adds none
    assert s["itl_ms"]["mean"] == pytest.approx(sum(itls) / 3)
    assert s["e2e_ms"]["p50"] == pytest.approx(300.0)
    assert s["normalized_latency_s_per_token"] == pytest.approx((0.3 / 4 + 0.6 / 7 + 0.25 / 2) / 3)
    assert "goodput_req_s" not in s


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = rec(0.0, [0.05, 0.06], 0.1, 6)  # ttft 50 ms, tpot 10 ms
    slow_first = rec(0.0, [0.4, 0.41], 0.45, 6)  # ttft 400 ms
    slow_tokens = rec(0.0, [0.05, 0.5], 1.05, 6)  # tpot 200 ms
    failed = rec(0.0, [], None, None, error="connect")
    slo = parse_slo("ttft=200,tpot=50")
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_tokens, failed)] == [True, False, False, False]
    s = summarize([fast, slow_first, slow_tokens, failed], duration_s=4.0, slo=slo)
    assert s["goodput_req_s"] == pytest.approx(0.25)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert meets_slo(fast, parse_slo("e2e=99")) is False


@pytest.mark.parametrize("bad", ["ttft", "ttft=0", "foo=3", "ttft=-1"])
def test_parse_slo_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(bad)


def test_parse_slo_aliases() -> None:
    assert parse_slo("TTFT=500, e2el=2000") == {"ttft": 500.0, "e2e": 2000.0}
    assert parse_slo(None) == {}


def test_throughput_timeline_spreads_tokens_over_deltas() -> None:
    records = [rec(0.0, [0.5, 1.5], 1.6, 10), rec(0.0, [2.2], 2.3, 3)]
    tl = throughput_timeline(records, t0=0.0, bin_s=1.0)
    assert [t for t, _ in tl] == [0.5, 1.5, 2.5]
    assert [v for _, v in tl] == pytest.approx([5.0, 5.0, 3.0])
    assert sum(v for _, v in tl) == pytest.approx(13.0)
