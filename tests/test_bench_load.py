"""Arrival processes and the session driver, against an in-memory client (no network)."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

import pytest

from chatsvc.bench.clients import BenchError
from chatsvc.bench.load import LoadConfig, arrival_offsets, run_load
from chatsvc.bench.metrics import RequestRecord


class MemorySession:
    def __init__(self, client: MemoryClient) -> None:
        self.client = client

    async def send(self, content: str, rec: RequestRecord) -> None:
        c = self.client
        c.active += 1
        c.peak = max(c.peak, c.active)
        try:
            c.sent.append((rec.session, rec.turn, content, time.perf_counter()))
            if content == "FAIL":
                raise BenchError("server_internal", "boom")
            for _ in range(3):
                await asyncio.sleep(c.gap)
                rec.delta_times.append(time.perf_counter())
            rec.output_tokens, rec.token_source = 3, "usage"
            rec.end = time.perf_counter()
        finally:
            c.active -= 1

    async def close(self) -> None:
        self.client.closed += 1


class MemoryClient:
    def __init__(self, gap: float = 0.001) -> None:
        self.gap = gap
        self.sent: list[tuple[int, int, str, float]] = []
        self.active = self.peak = self.closed = 0

    async def open_session(self) -> Any:
        return MemorySession(self)


def test_arrivals_all_at_once_without_rate() -> None:
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    assert arrival_offsets(0, 2.0, 1.0, 0) == []


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_asked_mean_rate_and_burstiness(burstiness: float) -> None:
    rate, n = 4.0, 20000
    t = arrival_offsets(n, rate, burstiness, seed=3)
    assert t[0] == 0.0 and t == sorted(t)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # A gamma with shape k has coefficient of variation 1/sqrt(k): 1 for Poisson, larger when burstier.
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert t == arrival_offsets(n, rate, burstiness, seed=3)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, 0)


async def test_closed_loop_turns_wait_for_replies_and_think_time() -> None:
    client = MemoryClient()
    records: list[RequestRecord] = []
    convos = [["a", "b", "c"], ["d", "e", "f"]]
    _, duration = await run_load(client, convos, LoadConfig(think_time_s=0.02), records)  # type: ignore[arg-type]
    assert len(records) == 6 and all(r.ok for r in records)
    assert client.closed == 2
    for s in (0, 1):
        mine = sorted((r for r in records if r.session == s), key=lambda r: r.turn)
        for prev, nxt in zip(mine, mine[1:], strict=False):
            assert prev.end is not None and nxt.start - prev.end >= 0.02
    assert [c for _, _, c, _ in sorted(client.sent)] == ["a", "b", "c", "d", "e", "f"]
    assert duration >= 0.04


async def test_error_ends_that_session_only() -> None:
    client = MemoryClient()
    records: list[RequestRecord] = []
    await run_load(client, [["x", "FAIL", "never"], ["y", "z"]], LoadConfig(), records)  # type: ignore[arg-type]
    assert sorted((r.session, r.turn, r.error) for r in records) == [
        (0, 0, None), (0, 1, "server_internal"), (1, 0, None), (1, 1, None)]
    assert all(c != "never" for _, _, c, _ in client.sent)


async def test_open_loop_starts_sessions_at_their_arrival_times_and_caps_concurrency() -> None:
    client = MemoryClient(gap=0.01)
    records: list[RequestRecord] = []
    cfg = LoadConfig(rate=50.0, seed=5, max_concurrency=2)
    # The schedule counts from the run's start, not from the first send: session 0 may
    # itself start late on a busy machine, so only "never before its arrival" is exact.
    before = time.perf_counter()
    await run_load(client, [["q"]] * 6, cfg, records)  # type: ignore[arg-type]
    assert len(records) == 6 and client.peak <= 2
    offsets = arrival_offsets(6, 50.0, 1.0, 5)
    assert sorted(s for s, *_ in client.sent) == list(range(6))
    for (s, _, _, t) in client.sent:
        assert t - before >= offsets[s] - 0.001


async def test_duration_cancels_in_flight_requests() -> None:
    client = MemoryClient(gap=0.2)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    _, duration = await run_load(client, [["slow", "never"]] * 3, LoadConfig(duration_s=0.1), records)  # type: ignore[arg-type]
    assert time.perf_counter() - start < 0.5
    assert duration == pytest.approx(0.1, abs=0.08)
    assert len(records) == 3 and all(r.cancelled and not r.ok and r.error is None for r in records)
    assert client.closed == 3


async def test_stop_event_ends_the_run() -> None:
    client = MemoryClient(gap=0.2)
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    await run_load(client, [["a"]] * 2, LoadConfig(), records, stop=stop)  # type: ignore[arg-type]
    assert [r.cancelled for r in records] == [True, True]


async def test_request_timeout_is_an_error() -> None:
    client = MemoryClient(gap=0.2)
    records: list[RequestRecord] = []
    await run_load(client, [["a", "b"]], LoadConfig(request_timeout_s=0.05), records)  # type: ignore[arg-type]
    assert [(r.error, r.cancelled) for r in records] == [("timeout", False)]
