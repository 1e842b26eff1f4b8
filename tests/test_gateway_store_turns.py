"""chatsvc/store/turns.py on a real Redis: one turn at a time per session, owner-token locks, and the turns
of dead gateways recovered or taken over."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.store import SessionGone, Store
from chatsvc.store.keys import lock_key, messages_key, session_key
from chatsvc.store.liveness import LOCK_TTL_S
from chatsvc.store.turns import Retention


async def test_concurrent_turns_append_once(store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    results = await asyncio.gather(*(store.begin_turn(s.id, {"role": "user", "content": str(i)}) for i in range(8)))
    assert sorted(r for r in results if r is not None) == [1]
    assert len(await store.messages(s.id)) == 1
    assert await store.is_busy(s.id)
    assert await store.lock_holder(s.id) == (store.instance, 1, True)
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "hi", "finish_reason": "stop"}) == 1
    # A retry of a stored turn (its first answer lost) stores nothing twice.
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "hi", "finish_reason": "stop"}) == 0
    assert not await store.is_busy(s.id) and await store.lock_holder(s.id) is None
    assert await store.begin_turn(s.id, {"role": "user", "content": "again"}) == 2
    assert await store.rollback_turn(s.id, 2)
    assert not await store.is_busy(s.id)
    meta = await store.get_session(s.id, "o")
    assert meta is not None and meta.turns == 1
    assert [m["role"] for m in await store.messages(s.id)] == ["user", "assistant"]


async def test_untitled_session_is_named_after_its_first_message(store: Store) -> None:  # noqa: F811
    meta = await store.create_session("carol", "p", "sys")
    assert meta.title == ""
    assert await store.begin_turn(meta.id, {"role": "user", "content": "  How do\nsails   work? " + "x" * 80}) == 1
    await store.end_turn(meta.id, 1, {"role": "assistant", "content": "wind"})
    first = await store.get_session(meta.id, "carol")
    assert first is not None and first.title.startswith("How do sails work? x") and len(first.title) == 60
    assert await store.begin_turn(meta.id, {"role": "user", "content": "second"}) == 2
    again = await store.get_session(meta.id, "carol")
    assert again is not None and again.title == first.title


async def test_the_lock_is_an_owner_token_with_a_short_ttl_released_only_by_its_owner(
        store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    assert await store.begin_turn(s.id, {"role": "user", "content": "hi"}) == 1
    lock = lock_key(s.id)
    assert await store.r.get(lock) == store.lock_token(1)
    assert 0 < await store.r.pttl(lock) <= LOCK_TTL_S * 1000
    # Another live instance neither takes nor releases it.
    other = Store(store.r, 60, 30, instance="other")
    await other.heartbeat()
    await store.heartbeat()
    assert await other.begin_turn(s.id, {"role": "user", "content": "me too"}) is None
    # Fenced: a turn's reply is stored only under its lock (another instance's end_turn stores nothing).
    assert await other.end_turn(s.id, 1, {"role": "assistant", "content": "not mine"}) == -2
    assert await store.r.get(lock) == store.lock_token(1)
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "mine"}) == 1
    assert await store.r.get(lock) is None
    # A lock that expired is taken back while its turn is pending, and refreshed while held.
    assert await store.begin_turn(s.id, {"role": "user", "content": "two"}) == 2
    await store.r.delete(lock)
    assert await store.refresh_lock(s.id, 2) and await store.r.get(lock) == store.lock_token(2)
    await store.r.pexpire(lock, 500)
    assert await store.refresh_lock(s.id, 2) and await store.r.pttl(lock) > 1000
    with pytest.raises(SessionGone):
        await store.begin_turn("no-such-session", {"role": "user", "content": "x"})


async def test_a_dead_instances_turn_is_recovered_from_its_stream(store: Store) -> None:  # noqa: F811
    dead = Store(store.r, 60, 30, instance="host:1")
    await dead.heartbeat()
    s = await store.create_session("o", "p", "sys")
    assert await dead.begin_turn(s.id, {"role": "user", "content": "tell me"}) == 1
    for text in ("Once", " upon"):
        await append_event(dead, s.id, 1, {"type": "delta", "text": text, "tokens": 1})
    await store.heartbeat()
    assert await store.recover_dead_turns() == []  # its instance is alive: left alone
    assert await store.is_busy(s.id)
    # The same name restarting (host and port) makes the old nonce dead at once.
    restarted = Store(store.r, 60, 30, instance="host:1")
    await restarted.heartbeat()
    assert not await store.is_busy(s.id)
    assert await restarted.recover_dead_turns() == [s.id]
    msgs = await store.messages(s.id)
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["content"] == "Once upon" and msgs[1]["finish_reason"] == "interrupted"
    assert msgs[1]["tokens"] == 2
    events = await store.read_events_json(s.id, 1, "0", block_ms=0)
    assert events[-1][1]["type"] == "done" and events[-1][1]["finish_reason"] == "interrupted"
    assert await store.r.get(lock_key(s.id)) is None
    assert await store.r.smembers("chatsvc:instance:host:1:locks") == set()
    # The dead instance's late end_turn (it was only paused) stores nothing twice.
    assert await dead.end_turn(s.id, 1, {"role": "assistant", "content": "Once upon a time"}) == 0
    assert len(await store.messages(s.id)) == 2


async def test_begin_turn_takes_over_a_dead_lock_without_two_user_messages_in_a_row(
        store: Store) -> None:  # noqa: F811
    dead = Store(store.r, 60, 30, instance="gone")  # never heartbeats: dead from the start
    s = await store.create_session("o", "p", "sys")
    assert await dead.begin_turn(s.id, {"role": "user", "content": "first"}) == 1
    await append_event(dead, s.id, 1, {"type": "delta", "text": "half", "tokens": 1})
    assert await store.begin_turn(s.id, {"role": "user", "content": "second"}) == 2
    msgs = await store.messages(s.id)
    assert [(m["role"], m.get("finish_reason")) for m in msgs] == [
        ("user", None), ("assistant", "interrupted"), ("user", None)]
    assert msgs[1]["content"] == "half"
    # A lock that simply expired (no owner left at all) is handled the same way.
    await store.r.delete(lock_key(s.id))
    assert await store.begin_turn(s.id, {"role": "user", "content": "third"}) == 3
    assert [m["role"] for m in await store.messages(s.id)] == ["user", "assistant", "user", "assistant", "user"]


async def test_one_gateway_takes_over_each_running_turn_of_a_dead_one(store: Store) -> None:  # noqa: F811
    dead = Store(store.r, 60, 30, instance="gw-dead")
    await dead.heartbeat()
    s1 = await store.create_session("o", "p", "sys")
    s2 = await store.create_session("o", "p", "sys")
    assert await dead.begin_turn(s1.id, {"role": "user", "content": "1"}) == 1
    assert await dead.begin_turn(s2.id, {"role": "user", "content": "1"}) == 1
    peer = Store(store.r, 60, 30, instance="gw-peer")
    await store.heartbeat()
    await peer.heartbeat()
    assert await store.take_over_turns() == []  # its holder is alive
    await store.r.delete("chatsvc:instance:gw-dead")  # it stopped heartbeating
    taken = await asyncio.gather(store.take_over_turns(skip={s2.id}), peer.take_over_turns())
    assert sorted(t for ts in taken for t in ts) == sorted([(s1.id, 1), (s2.id, 1)])
    assert taken[0] in ([(s1.id, 1)], [])  # skipped s2; s1 went to whichever got it first
    for sid, turn in (t for ts in taken for t in ts):
        winner = store if (sid, turn) in taken[0] else peer
        assert await store.r.get(lock_key(sid)) == winner.lock_token(turn)
        assert await store.r.sismember(winner.locks_key(), sid)
    assert await store.r.smembers("chatsvc:instance:gw-dead:locks") == set()
    assert await store.r.smembers(store.locks_key()) == {sid for sid, _ in taken[0]}
    # The taker now holds the turn: it stores the reply, and nothing is recovered as interrupted.
    assert await peer.end_turn(s2.id, 1, {"role": "assistant", "content": "relayed"}) == 1
    assert await store.recover_dead_turns() == []


async def test_an_adopting_sweep_leaves_a_dead_holders_turn_to_the_take_over(store: Store) -> None:  # noqa: F811
    # A gateway that hands its turns off steps down between another's take-over pass and its recovery pass
    # in the same beat: that recovery must not cut the turn the next take-over pass would adopt.
    leaving = Store(store.r, 60, 30, instance="gw-leaving")
    await leaving.heartbeat()
    await store.heartbeat()
    s = await store.create_session("o", "p", "sys")
    assert await leaving.begin_turn(s.id, {"role": "user", "content": "go on"}) == 1
    assert await store.take_over_turns() == []  # read alive
    await leaving.step_down()
    assert await store.recover_dead_turns(adoptable=True) == []
    assert await store.take_over_turns() == [(s.id, 1)]
    assert await store.r.get(lock_key(s.id)) == store.lock_token(1)
    # Without an engine to adopt it, the same sweep stores the turn as interrupted.
    other = await store.create_session("o", "p", "sys")
    assert await leaving.begin_turn(other.id, {"role": "user", "content": "cut"}) == 1
    assert await store.recover_dead_turns() == [other.id]


async def _turns(store: Store, sid: str, first: int, last: int, tokens: int = 10, size: int = 10) -> None:  # noqa: F811
    for turn in range(first, last + 1):
        assert await store.begin_turn(sid, {"role": "user", "content": f"u{turn}".ljust(size), "tokens": tokens}) == turn
        assert await store.end_turn(sid, turn, {"role": "assistant", "content": f"a{turn}".ljust(size),
                                                "tokens": tokens}) == 1


async def _stored_bytes(store: Store, sid: str) -> int:  # noqa: F811
    return sum(len(m.encode()) for m in await store.r.lrange(messages_key(sid), 0, -1))


async def test_retention_drops_the_oldest_whole_turns_past_the_message_cap(store: Store) -> None:  # noqa: F811
    store.retention_source = lambda: Retention(max_messages=5, max_bytes=1 << 20, floor_tokens=0)
    s = await store.create_session("o", "p", "sys")
    await _turns(store, s.id, 1, 10)
    msgs = await store.messages(s.id)
    # 5 at most, cut at a turn's start: the newest two turns whole (the cap counts the pending user message).
    assert [m["content"].strip() for m in msgs] == ["u9", "a9", "u10", "a10"]
    raw = await store.r.hgetall(session_key(s.id))
    assert raw["trimmed_messages"] == "16" and int(raw["history_bytes"]) == await _stored_bytes(store, s.id)
    assert raw["user_messages"] == "10"  # trimmed ones still count: the turns left out of a prompt
    page = await store.message_page(s.id, 100)
    assert (page.first_index, page.message_count, page.has_more) == (16, 20, False)


async def test_retention_drops_past_the_byte_cap_and_a_rollback_keeps_the_counts(store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    await _turns(store, s.id, 1, 3, size=1000)
    store.retention_source = lambda: Retention(max_messages=1000, max_bytes=4500, floor_tokens=0)
    await _turns(store, s.id, 4, 4, size=1000)
    assert [m["content"].strip() for m in await store.messages(s.id)] == ["u3", "a3", "u4", "a4"]
    assert await _stored_bytes(store, s.id) <= 4500
    assert await store.begin_turn(s.id, {"role": "user", "content": "x" * 2000}) == 5  # over: u3 and a3 go
    assert await store.rollback_turn(s.id, 5)
    raw = await store.r.hgetall(session_key(s.id))
    assert int(raw["history_bytes"]) == await _stored_bytes(store, s.id) and raw["user_messages"] == "4"
    assert [m["content"].strip() for m in await store.messages(s.id)] == ["u4", "a4"]


async def test_retention_never_drops_below_its_floor(store: Store) -> None:  # noqa: F811
    # Each message is guessed at 10 + 5 tokens; the floor of 50 keeps the newest four messages, whatever the cap.
    store.retention_source = lambda: Retention(max_messages=1, max_bytes=1, floor_tokens=50)
    s = await store.create_session("o", "p", "sys")
    await _turns(store, s.id, 1, 6)
    assert [m["content"].strip() for m in await store.messages(s.id)] == ["u5", "a5", "u6", "a6"]
    # A floor that ends inside a turn keeps that turn whole: never a reply without its message.
    store.retention_source = lambda: Retention(max_messages=1, max_bytes=1, floor_tokens=20)
    await _turns(store, s.id, 7, 7)
    assert [m["content"].strip() for m in await store.messages(s.id)] == ["u7", "a7"]
