"""TurnRegistry.follow_json on a real Redis: replay from an event id, and an explicit end when a reply's
stream stops without its done/error event (e.g. the server restarted mid-reply)."""

from __future__ import annotations

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.turns import TurnRegistry, event_id


def _registry(store: Store) -> TurnRegistry:  # noqa: F811
    # No engine or metrics: follow_json() only reads the stream and the registry of active turns.
    return TurnRegistry(None, store, None, Settings())  # type: ignore[arg-type]


async def test_follow_replays_after_an_event_id_and_stops_at_done(store: Store) -> None:  # noqa: F811
    sid = "s-follow"
    first = await append_event(store, sid, 1, {"type": "delta", "text": "Hel"})
    await append_event(store, sid, 1, {"type": "delta", "text": "lo"})
    await append_event(store, sid, 1, {"type": "done", "finish_reason": "stop", "usage": {}})
    await append_event(store, sid, 1, {"type": "delta", "text": "never read"})
    events = [ev async for _, ev, _ in _registry(store).follow_json(sid, 1, first)]
    assert [e["type"] for e in events] == ["delta", "done"]
    assert events[0]["text"] == "lo"


async def test_follow_reports_a_stream_that_ended_without_done(store: Store) -> None:  # noqa: F811
    sid = "s-orphan"
    last = await append_event(store, sid, 2, {"type": "delta", "text": "partial"})
    got = [(eid, ev) async for eid, ev, _ in _registry(store).follow_json(sid, 2, "0")]
    assert [ev["type"] for _, ev in got] == ["delta", "error"]
    assert got[-1][1]["code"] == "stream_ended"
    assert got[-1][0] == event_id(2, last)
