"""Reply events written in batches on a real Redis: EventWriter stores every event exactly once, in order,
in one command per batch; readers (local log or Redis) resuming from any id see no gap or duplicate."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401

from chatsvc.settings import Settings
from chatsvc.store import EventWriter, Store
from chatsvc.store.keys import stream_key
from chatsvc.turns import ActiveTurn, TurnRegistry, event_id


class CountingStore(Store):
    """The real store, counting the batches the writer sends."""

    batches: list[int]

    async def append_events(self, items: Sequence[tuple[str, str]]) -> list[str | Exception]:
        self.batches.append(len(items))
        return await super().append_events(items)


@pytest.fixture
async def store(redis_url: str):  # noqa: F811
    s = Store.from_url(redis_url, session_ttl_s=60, stream_ttl_s=30)
    counting = CountingStore(s.r, 60, 30)
    counting.batches = []
    yield counting
    await s.close()


async def stored(store: Store, key: str) -> list[tuple[str, str]]:
    return [(eid, f["e"]) for eid, f in await store.r.xrange(key)]


async def test_events_of_one_pass_share_a_pipeline_and_keep_their_order(store: CountingStore) -> None:
    writer = EventWriter(store)
    keys = [stream_key(f"s{i}", 1) for i in range(4)]
    got: dict[str, list[str]] = {k: [] for k in keys}

    def done(key: str) -> Any:
        def cb(eid: str | None, exc: BaseException | None) -> None:
            assert exc is None and eid is not None
            got[key].append(eid)
        return cb

    # Like an engine step: every stream gets an event in the same pass; three steps back to back.
    for step in range(3):
        for k in keys:
            writer.append(k, json.dumps({"type": "delta", "text": f"{k}-{step}"}), done(k))
    # More events while that batch is in flight: they form the next batch.
    await asyncio.sleep(0)
    for k in keys:
        writer.append(k, json.dumps({"type": "delta", "text": f"{k}-3"}), done(k))
    last = await writer.write(keys[0], json.dumps({"type": "done"}), final=True)
    assert store.batches[0] == 12 and sum(store.batches) == 17 and len(store.batches) <= 3
    for k in keys:
        rows = await stored(store, k)
        texts = [json.loads(e).get("text") for _, e in rows]
        assert texts == [f"{k}-{s}" for s in range(4)] + ([None] if k == keys[0] else [])
        assert got[k] == [eid for eid, _ in rows][:4]  # each callback got its own event's id
        assert 0 < await store.r.ttl(k) <= 30
    assert last == (await stored(store, keys[0]))[-1][0]


async def test_a_failed_stream_refuses_later_events_but_not_its_final_one(store: CountingStore) -> None:
    writer = EventWriter(store)
    bad, good = stream_key("bad", 1), stream_key("good", 1)
    await store.r.set(bad, "not a stream")  # XADD on it fails with WRONGTYPE, in the same MULTI as good's
    errors: list[BaseException] = []
    for i in range(3):
        writer.append(bad, json.dumps({"i": i}), lambda eid, exc: errors.append(exc) if exc else None)
        writer.append(good, json.dumps({"i": i}), lambda eid, exc: errors.append(exc) if exc else None)
    await writer.write(good, json.dumps({"i": 3}))
    assert len(errors) == 3 and all("WRONGTYPE" in str(e) for e in errors)
    assert [json.loads(e)["i"] for _, e in await stored(store, good)] == [0, 1, 2, 3]
    await store.r.delete(bad)  # the stream would now accept writes, but a gap must not be written
    with pytest.raises(RuntimeError, match="not stored"):
        await writer.write(bad, json.dumps({"i": 4}))
    await writer.write(bad, json.dumps({"type": "done"}), final=True)
    assert [json.loads(e) for _, e in await stored(store, bad)] == [{"type": "done"}]
    writer.forget(bad)
    await writer.write(bad, json.dumps({"i": 5}))


def registry(store: Store) -> TurnRegistry:
    # No engine or metrics: the writer, the turn log and follow() only need the store.
    return TurnRegistry(None, store, None, Settings())  # type: ignore[arg-type]


async def collect(reg: TurnRegistry, sid: str, turn: int, after: str) -> list[tuple[str, dict[str, Any], str]]:
    return [item async for item in reg.follow_json(sid, turn, after)]


async def test_readers_resuming_mid_stream_see_no_gap_or_duplicate(store: CountingStore) -> None:
    reg = registry(store)
    sid, turn = "s-resume", 2
    at = ActiveTurn(sid, turn, f"{sid}-{turn}")
    reg.active[sid] = at
    key = stream_key(sid, turn)
    early = asyncio.create_task(collect(reg, sid, turn, "0"))  # attached before the first event
    events = [{"type": "delta", "text": f"t{i} ", "tokens": 1} for i in range(20)]
    for start in range(0, 20, 5):  # written in batches of five (one engine step's worth each)
        for ev in events[start:start + 5]:
            reg._emit(at, key, ev, json.dumps(ev))
        while at.unwritten:
            await asyncio.sleep(0.001)
    assert store.batches == [5, 5, 5, 5]
    rows = await stored(store, key)
    ids = [eid for eid, _ in rows]
    # Local readers (the turn runs here) from every possible resume point.
    for cut in range(len(ids)):
        tail = await asyncio.wait_for(_tail_until(reg, sid, turn, ids[cut], len(ids) - cut - 1), 5)
        assert [e[0] for e in tail] == [event_id(turn, i) for i in ids[cut + 1:]]
        assert [e[2] for e in tail] == [data for _, data in rows[cut + 1:]]
    done = {"type": "done", "finish_reason": "stop", "usage": {}, "message": {}}
    fut = asyncio.get_running_loop().create_future()
    reg._emit(at, key, done, json.dumps(done), fut)
    await fut
    at.closed = True
    at.wake()
    whole = await asyncio.wait_for(early, 5)
    assert [e[1] for e in whole] == [*events, done]
    assert [e[0] for e in whole] == [event_id(turn, eid) for eid, _ in await stored(store, key)]
    # The same answers from Redis once the turn is gone from this process.
    reg.active.pop(sid)
    for cut in (0, 7, 19):
        assert await collect(reg, sid, turn, ids[cut]) == whole[cut + 1:]
    assert await collect(reg, sid, turn, "0") == whole


async def _tail_until(reg: TurnRegistry, sid: str, turn: int, after: str,
                      n: int) -> list[tuple[str, dict[str, Any], str]]:
    out: list[tuple[str, dict[str, Any], str]] = []
    if n == 0:
        return out
    async for item in reg.follow_json(sid, turn, after):
        out.append(item)
        if len(out) == n:
            break
    return out


async def test_a_turn_that_ends_without_its_final_event_falls_back_to_redis(store: CountingStore) -> None:
    reg = registry(store)
    sid, turn = "s-cut", 1
    at = ActiveTurn(sid, turn, f"{sid}-{turn}")
    reg.active[sid] = at
    key = stream_key(sid, turn)
    ev = {"type": "delta", "text": "partial", "tokens": 1}
    reader = asyncio.create_task(collect(reg, sid, turn, "0"))
    reg._emit(at, key, ev, json.dumps(ev))
    while at.unwritten:
        await asyncio.sleep(0.001)
    at.closed = True  # e.g. the done event could not be stored
    at.wake()
    reg.active.pop(sid)
    got = await asyncio.wait_for(reader, 5)
    assert [e[1]["type"] for e in got] == ["delta", "error"] and got[1][1]["code"] == "stream_ended"
    assert got[1][0] == got[0][0]  # the error carries the last id seen, as the Redis path always did
