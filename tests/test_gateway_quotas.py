"""chatsvc/quotas.py: per-key limits answer 429 with Retry-After; the anonymous owner (no keys) has none."""

from __future__ import annotations

import dataclasses

import pytest

from chatsvc import quotas as quotas_module
from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.quotas import FrameBudget, Quotas
from chatsvc.settings import Settings
from engine.protocol import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(quotas_module.time, "monotonic", c)
    return c


def settings(**kw: int) -> Settings:
    return dataclasses.replace(Settings(), **kw)


def test_concurrent_generations_are_capped_per_key_counting_session_turns() -> None:
    q = Quotas(settings(max_streams_per_key=2, retry_after_s=3))
    q.start_stream("k1")
    with pytest.raises(APIError) as exc:
        q.start_stream("k1", session_turns=1)
    assert exc.value.status == 429 and exc.value.code == "quota_exceeded"
    assert exc.value.headers == {"Retry-After": "3"}
    q.start_stream("k2", session_turns=1)  # another key has its own count
    q.end_stream("k1")
    q.start_stream("k1", session_turns=1)
    for _ in range(5):
        q.start_stream(ANON)  # no keys configured: no quota


def test_new_sessions_per_minute_slide_with_the_clock(clock: Clock) -> None:
    q = Quotas(settings(max_sessions_per_minute=2))
    q.new_session("k")
    clock.now += 30
    q.new_session("k")
    with pytest.raises(APIError) as exc:
        q.new_session("k")
    assert exc.value.headers == {"Retry-After": "31"}  # the first one leaves the window in 30 s
    clock.now += 31
    q.new_session("k")


def test_open_sockets_are_capped_and_released() -> None:
    q = Quotas(settings(max_sockets_per_key=1))
    q.open_socket("k")
    with pytest.raises(APIError):
        q.open_socket("k")
    q.close_socket("k")
    q.open_socket("k")
    assert dict(q.sockets) == {"k": 1}


def test_frame_budget_allows_a_burst_then_the_rate(clock: Clock) -> None:
    budget = FrameBudget(rate=5)
    assert all(budget.take() for _ in range(10))  # a burst of twice the rate
    assert not budget.take()
    clock.now += 0.2  # one more frame's worth
    assert budget.take() and not budget.take()


class QueueOf:
    """An engine that only says how long its waiting queue is."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting

    def stats(self) -> EngineStats:
        return EngineStats(max_waiting=self.max_waiting)


def test_a_key_holds_at_most_its_share_of_the_waiting_queue_while_admitting() -> None:
    from chatsvc.metrics import Metrics

    m = Metrics(QueueOf(10))  # type: ignore[arg-type]
    q = Quotas(dataclasses.replace(Settings(), max_waiting_share=0.25, retry_after_s=2), m,
               QueueOf(10))  # type: ignore[arg-type]
    assert q.waiting_limit() == 2
    with q.admitting("k1"), q.admitting("k1"):
        with pytest.raises(APIError) as exc, q.admitting("k1"):
            pass
        assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "2"}
        with q.admitting("k2"), q.admitting(ANON), q.admitting(ANON), q.admitting(ANON):
            pass  # another key's own share; no keys configured: no quota
    assert not q.waiting  # every place given back, the refused one never taken
    with pytest.raises(RuntimeError), q.admitting("k1"):
        raise RuntimeError("admission failed")
    assert not q.waiting
    assert m.quota_refused.labels("waiting")._value.get() == 1
    assert Quotas(Settings()).waiting_limit() is None  # no engine to measure: no waiting quota
