"""chatsvc/quotas.py on a real Redis: per-key limits answer 429 with Retry-After; the anonymous owner (no keys)
has none; places are given back once, renewed while held, and lapse when their gateway stops."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import store  # noqa: F401

from chatsvc import quotas as quotas_module
from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.quotas import FrameBudget, Quotas
from chatsvc.settings import Settings
from chatsvc.store import Store
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


def settings(**kw: float) -> Settings:
    return dataclasses.replace(Settings(), **kw)


async def test_generations_are_capped_per_key_in_requests_and_in_sequences(store: Store) -> None:  # noqa: F811
    q = Quotas(settings(max_streams_per_key=3, max_sequences_per_key=16, retry_after_s=3), store)
    first = await q.reserve_generation("k1", 8)
    second = await q.reserve_generation("k1", 8)
    with pytest.raises(APIError) as exc:
        await q.reserve_generation("k1", 1)  # 16 sequences held: even one more is refused
    assert exc.value.status == 429 and exc.value.code == "quota_exceeded" and "sequences" in exc.value.message
    assert exc.value.headers == {"Retry-After": "3"}
    await (await q.reserve_generation("k2", 8)).release()  # another key has its own count
    await first.release()
    await first.release()  # given back once, however often released
    assert await store.places_held("k1", "generations") == (1, 8)
    small = [await q.reserve_generation("k1") for _ in range(2)]
    with pytest.raises(APIError) as exc:
        await q.reserve_generation("k1")
    assert "generations" in exc.value.message
    for lease in (second, *small):
        await lease.release()
    assert not q.held and await store.places_held("k1", "generations") == (0, 0)
    for _ in range(5):
        await q.reserve_generation(ANON, 8)  # no keys configured: no quota
    assert await store.places_held(ANON, "generations") == (0, 0)


async def test_new_sessions_per_minute_are_a_sliding_window(store: Store) -> None:  # noqa: F811
    q = Quotas(settings(max_sessions_per_minute=2), store)
    await q.new_session("k")
    await q.new_session("k")
    with pytest.raises(APIError) as exc:
        await q.new_session("k")
    assert 59 <= int(exc.value.headers["Retry-After"]) <= 61  # the first one leaves the window in a minute
    await q.new_session("other")


async def test_live_sessions_are_capped_until_deleted_or_expired(store: Store) -> None:  # noqa: F811
    q = Quotas(settings(max_live_sessions_per_key=2, session_ttl_s=1), store)
    await q.live_session("k", "s1")
    await q.live_session("k", "s2")
    with pytest.raises(APIError) as exc:
        await q.live_session("k", "s3")
    assert exc.value.status == 429 and "live sessions" in exc.value.message
    await q.live_session("other", "s3")  # another key's own
    await q.session_gone("k", "s1")
    await q.live_session("k", "s3")
    await asyncio.sleep(0.6)
    await q.session_used("k", "s3")  # a turn renews its session's TTL, and its place with it
    await asyncio.sleep(0.6)
    assert await store.places_held("k", "live_sessions") == (1, 1)  # s2 expired; s3 lives on
    await q.live_session("k", "s4")


async def test_open_connections_are_capped_and_released(store: Store) -> None:  # noqa: F811
    q = Quotas(settings(max_sockets_per_key=1, max_kv_streams_per_key=1), store)
    socket = await q.open_socket("k")
    with pytest.raises(APIError):
        await q.open_socket("k")
    kv = await q.open_kv_stream("k")  # a quota of its own
    with pytest.raises(APIError):
        await q.open_kv_stream("k")
    await socket.release()
    await kv.release()
    await (await q.open_socket("k")).release()


async def test_held_places_are_renewed_while_held_and_lapse_once_the_gateway_stops(store: Store) -> None:  # noqa: F811
    q = Quotas(settings(max_streams_per_key=1, quota_lease_ttl_s=0.6), store)
    await q.open()
    try:
        lease = await q.reserve_generation("k")
        await asyncio.sleep(1.5)  # well past the place's lifetime: renewed meanwhile
        with pytest.raises(APIError):
            await q.reserve_generation("k")
    finally:
        await q.close()  # a crashed gateway renews nothing
    await asyncio.sleep(1.0)
    assert await store.places_held("k", "generations") == (0, 0)
    await lease.release()


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


def test_a_key_holds_at_most_its_share_of_the_waiting_queue_while_admitting(store: Store) -> None:  # noqa: F811
    from chatsvc.metrics import Metrics

    m = Metrics(QueueOf(10))  # type: ignore[arg-type]
    q = Quotas(dataclasses.replace(Settings(), max_waiting_share=0.25, retry_after_s=2), store, m,
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
    assert Quotas(Settings(), store).waiting_limit() is None  # no engine to measure: no waiting quota
