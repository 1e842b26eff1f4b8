"""chatsvc/store/streams.py on a real Redis: a reply's events read after an id, its readers' leases.
(The EventWriter's batching is tested in test_gateway_events.py, with the turn log it feeds.)"""

from __future__ import annotations

import asyncio
import json

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from redis.exceptions import ResponseError
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.keys import lock_key, stream_key
from chatsvc.store.streams import Fenced


async def test_reply_stream_reads_after_an_id(store: Store) -> None:  # noqa: F811
    ids = [await append_event(store, "s", 1, {"type": "delta", "text": t}) for t in "abc"]
    everything = await store.read_events_json("s", 1, "0", block_ms=0)
    assert [e["text"] for _, e, _ in everything] == ["a", "b", "c"]
    assert [eid for eid, _, _ in everything] == ids
    assert json.loads(everything[0][2]) == everything[0][1]  # the JSON as stored
    rest = await store.read_events_json("s", 1, ids[0], block_ms=0)
    assert [e["text"] for _, e, _ in rest] == ["b", "c"]
    assert 0 < await store.r.ttl(stream_key("s", 1)) <= 30
    assert await store.read_events_json("s", 1, ids[-1], block_ms=0) == []
    assert await store.stream_exists("s", 1) and not await store.stream_exists("s", 2)


async def test_a_blocking_read_wakes_on_the_next_event(store: Store) -> None:  # noqa: F811
    first = await append_event(store, "s", 1, {"type": "delta", "text": "a"})
    reader = asyncio.create_task(store.read_events_json("s", 1, first, block_ms=5000))
    await asyncio.sleep(0.1)
    await append_event(store, "s", 1, {"type": "delta", "text": "b"})
    got = await asyncio.wait_for(reader, 5)
    assert [e["text"] for _, e, _ in got] == ["b"]


async def test_a_failed_append_is_reported_in_its_place(store: Store) -> None:  # noqa: F811
    await store.r.set(stream_key("bad", 1), "not a stream")
    out = await store.append_events([(stream_key("good", 1), "{}"), (stream_key("bad", 1), "{}"),
                                     (stream_key("good", 1), "{}")])
    assert isinstance(out[1], ResponseError) and "WRONGTYPE" in str(out[1])
    assert all(isinstance(e, str) for e in (out[0], out[2])) and str(out[0]) < str(out[2])


async def test_an_event_is_written_only_under_its_writers_lock(store: Store) -> None:  # noqa: F811
    key, lock = stream_key("f", 1), lock_key("f")
    mine = (lock, "gw-a|n1|1")
    await store.r.set(lock, "gw-a|n1|1")
    assert all(isinstance(e, str) for e in await store.append_events([(key, '{"type": "delta"}', mine)]))
    await store.r.set(lock, "gw-b|n2|1")  # taken over by another gateway
    out = await store.append_events([(key, '{"type": "delta"}', mine), (key, '{"type": "delta"}', None)])
    assert isinstance(out[0], Fenced) and isinstance(out[1], str)
    await store.r.delete(lock)  # expired in an outage, nobody took it: still the writer's
    assert isinstance((await store.append_events([(key, '{"type": "delta"}', mine)]))[0], str)
    await store.append_events([(key, '{"type": "done"}', (lock, "gw-b|n2|1"))])  # the reply ended elsewhere
    assert isinstance((await store.append_events([(key, '{"type": "delta"}', mine)]))[0], Fenced)
    assert [e["type"] for _, e, _ in await store.read_events_json("f", 1, "0", block_ms=0)] == [
        "delta", "delta", "delta", "done"]  # nothing after the done


async def test_readers_count_while_their_lease_runs(store: Store) -> None:  # noqa: F811
    await store.hold_reader("s", 1, "gw-a|1", lease_s=30)
    await store.hold_reader("s", 1, "gw-b|1", lease_s=0.05)
    assert await store.readers("s", 1) == 2
    assert 0 < await store.r.ttl(stream_key("s", 1) + ":readers") <= 30
    await asyncio.sleep(0.1)  # gw-b's gateway stopped renewing: its reader lapses
    assert await store.readers("s", 1) == 1
    await store.drop_reader("s", 1, "gw-a|1")
    assert await store.readers("s", 1) == 0
