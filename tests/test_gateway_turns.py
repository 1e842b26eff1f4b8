"""TurnRegistry.follow on a real Redis: replay from an event id, and an explicit end when a reply's
stream stops without its done/error event (e.g. the server restarted mid-reply)."""

from __future__ import annotations

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401

from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.turns import TurnRegistry, event_id


@pytest.fixture
async def store(redis_url: str):  # noqa: F811
    s = Store.from_url(redis_url, session_ttl_s=60, stream_ttl_s=30)
    yield s
    await s.close()


def _registry(store: Store) -> TurnRegistry:
    # No engine or metrics: follow() only reads the stream and the registry of active turns.
    return TurnRegistry(None, store, None, Settings())  # type: ignore[arg-type]


async def test_follow_replays_after_an_event_id_and_stops_at_done(store: Store) -> None:
    sid = "s-follow"
    first = await store.append_event(sid, 1, {"type": "delta", "text": "Hel"})
    await store.append_event(sid, 1, {"type": "delta", "text": "lo"})
    await store.append_event(sid, 1, {"type": "done", "finish_reason": "stop", "usage": {}})
    await store.append_event(sid, 1, {"type": "delta", "text": "never read"})
    events = [ev async for _, ev in _registry(store).follow(sid, 1, first)]
    assert [e["type"] for e in events] == ["delta", "done"]
    assert events[0]["text"] == "lo"


async def test_follow_reports_a_stream_that_ended_without_done(store: Store) -> None:
    sid = "s-orphan"
    last = await store.append_event(sid, 2, {"type": "delta", "text": "partial"})
    got = [(eid, ev) async for eid, ev in _registry(store).follow(sid, 2, "0")]
    assert [ev["type"] for _, ev in got] == ["delta", "error"]
    assert got[-1][1]["code"] == "stream_ended"
    assert got[-1][0] == event_id(2, last)
