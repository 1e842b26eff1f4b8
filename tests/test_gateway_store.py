from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import redis
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from redis.crc import key_slot

from chatsvc.store import LOCK_TTL_S, SessionGone, Store, session_key


@pytest.fixture
async def store(redis_url: str):  # noqa: F811
    s = Store.from_url(redis_url, session_ttl_s=60, stream_ttl_s=30)
    yield s
    await s.close()


async def test_personas_seed_once_and_deletion_sticks(store: Store) -> None:
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    assert list(await store.list_personas()) == ["a"]
    assert await store.delete_persona("a")
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    assert await store.list_personas() == {}
    assert await store.put_persona("b", {"system_prompt": "B", "description": "d"})
    assert not await store.put_persona("b", {"system_prompt": "B2", "description": "d"})
    assert (await store.get_persona("b"))["system_prompt"] == "B2"


async def test_sessions_are_owned_listed_newest_first_and_deleted(store: Store) -> None:
    s1 = await store.create_session("alice", "p", "sys")
    s2 = await store.create_session("alice", "p", "sys")
    other = await store.create_session("bob", "p", "sys")
    assert len(s1.id) >= 20 and s1.id != s2.id
    assert [m.id for m in await store.list_sessions("alice")] == [s2.id, s1.id]
    assert await store.get_session(other.id, "alice") is None
    assert not await store.delete_session(other.id, "alice")
    assert await store.delete_session(s1.id, "alice")
    assert await store.get_session(s1.id, "alice") is None
    assert [m.id for m in await store.list_sessions("alice")] == [s2.id]


async def test_concurrent_turns_append_once(store: Store) -> None:
    s = await store.create_session("o", "p", "sys")
    results = await asyncio.gather(*(store.begin_turn(s.id, {"role": "user", "content": str(i)}) for i in range(8)))
    assert sorted(r for r in results if r is not None) == [1]
    assert len(await store.messages(s.id)) == 1
    assert await store.is_busy(s.id)
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "hi", "finish_reason": "stop"}) == 1
    # A retry of a stored turn (its first answer lost) stores nothing twice.
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "hi", "finish_reason": "stop"}) == 0
    assert not await store.is_busy(s.id)
    assert await store.begin_turn(s.id, {"role": "user", "content": "again"}) == 2
    assert await store.rollback_turn(s.id, 2)
    assert not await store.is_busy(s.id)
    meta = await store.get_session(s.id, "o")
    assert meta is not None and meta.turns == 1
    assert [m["role"] for m in await store.messages(s.id)] == ["user", "assistant"]


async def test_reply_stream_reads_after_an_id(store: Store) -> None:
    ids = [await store.append_event("s", 1, {"type": "delta", "text": t}) for t in "abc"]
    everything = await store.read_events("s", 1, "0", block_ms=0)
    assert [e["text"] for _, e in everything] == ["a", "b", "c"]
    rest = await store.read_events("s", 1, ids[0], block_ms=0)
    assert [e["text"] for _, e in rest] == ["b", "c"]
    assert 0 < await store.r.ttl(store.stream_key("s", 1)) <= 30
    assert await store.read_events("s", 1, ids[-1], block_ms=0) == []


async def test_session_keys_expire_with_ttl(store: Store) -> None:
    s = await store.create_session("o", "p", "sys")
    assert 0 < await store.r.ttl(session_key(s.id)) <= 60


async def test_untitled_session_is_named_after_its_first_message(store: Store) -> None:
    meta = await store.create_session("carol", "p", "sys")
    assert meta.title == ""
    assert await store.begin_turn(meta.id, {"role": "user", "content": "  How do\nsails   work? " + "x" * 80}) == 1
    await store.end_turn(meta.id, 1, {"role": "assistant", "content": "wind"})
    first = await store.get_session(meta.id, "carol")
    assert first is not None and first.title.startswith("How do sails work? x") and len(first.title) == 60
    assert await store.begin_turn(meta.id, {"role": "user", "content": "second"}) == 2
    again = await store.get_session(meta.id, "carol")
    assert again is not None and again.title == first.title


async def test_the_lock_is_an_owner_token_with_a_short_ttl_released_only_by_its_owner(store: Store) -> None:
    s = await store.create_session("o", "p", "sys")
    assert await store.begin_turn(s.id, {"role": "user", "content": "hi"}) == 1
    lock = store.lock_key(s.id)
    assert await store.r.get(lock) == store.lock_token(1)
    assert 0 < await store.r.pttl(lock) <= LOCK_TTL_S * 1000
    # Another live instance neither takes nor releases it.
    other = Store(store.r, 60, 30, instance="other")
    await other.heartbeat()
    await store.heartbeat()
    assert await other.begin_turn(s.id, {"role": "user", "content": "me too"}) is None
    assert await other.end_turn(s.id, 1, {"role": "assistant", "content": "not mine"}) == 1
    assert await store.r.get(lock) == store.lock_token(1)  # stored once, but the lock stays its owner's
    assert await store.end_turn(s.id, 1, {"role": "assistant", "content": "mine"}) == 0
    assert await store.r.get(lock) is None
    # A lock that expired is taken back while its turn is pending, and refreshed while held.
    assert await store.begin_turn(s.id, {"role": "user", "content": "two"}) == 2
    await store.r.delete(lock)
    assert await store.refresh_lock(s.id, 2) and await store.r.get(lock) == store.lock_token(2)
    await store.r.pexpire(lock, 500)
    assert await store.refresh_lock(s.id, 2) and await store.r.pttl(lock) > 1000
    with pytest.raises(SessionGone):
        await store.begin_turn("no-such-session", {"role": "user", "content": "x"})


async def test_a_dead_instances_turn_is_recovered_from_its_stream(store: Store) -> None:
    dead = Store(store.r, 60, 30, instance="host:1")
    await dead.heartbeat()
    s = await store.create_session("o", "p", "sys")
    assert await dead.begin_turn(s.id, {"role": "user", "content": "tell me"}) == 1
    for text in ("Once", " upon"):
        await dead.append_event(s.id, 1, {"type": "delta", "text": text, "tokens": 1})
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
    events = await store.read_events(s.id, 1, "0", block_ms=0)
    assert events[-1][1]["type"] == "done" and events[-1][1]["finish_reason"] == "interrupted"
    assert await store.r.get(store.lock_key(s.id)) is None
    assert await store.r.smembers("chatsvc:instance:host:1:locks") == set()
    # The dead instance's late end_turn (it was only paused) stores nothing twice.
    assert await dead.end_turn(s.id, 1, {"role": "assistant", "content": "Once upon a time"}) == 0
    assert len(await store.messages(s.id)) == 2


async def test_begin_turn_takes_over_a_dead_lock_without_two_user_messages_in_a_row(store: Store) -> None:
    dead = Store(store.r, 60, 30, instance="gone")  # never heartbeats: dead from the start
    s = await store.create_session("o", "p", "sys")
    assert await dead.begin_turn(s.id, {"role": "user", "content": "first"}) == 1
    await dead.append_event(s.id, 1, {"type": "delta", "text": "half", "tokens": 1})
    assert await store.begin_turn(s.id, {"role": "user", "content": "second"}) == 2
    msgs = await store.messages(s.id)
    assert [(m["role"], m.get("finish_reason")) for m in msgs] == [
        ("user", None), ("assistant", "interrupted"), ("user", None)]
    assert msgs[1]["content"] == "half"
    # A lock that simply expired (no owner left at all) is handled the same way.
    await store.r.delete(store.lock_key(s.id))
    assert await store.begin_turn(s.id, {"role": "user", "content": "third"}) == 3
    assert [m["role"] for m in await store.messages(s.id)] == ["user", "assistant", "user", "assistant", "user"]


async def test_delete_session_removes_its_streams_without_scanning(store: Store) -> None:
    s = await store.create_session("o", "p", "sys")
    for turn in (1, 2):
        assert await store.begin_turn(s.id, {"role": "user", "content": str(turn)}) == turn
        await store.append_event(s.id, turn, {"type": "delta", "text": "x"})
        await store.end_turn(s.id, turn, {"role": "assistant", "content": "x"})
    await store.append_event("other", 1, {"type": "delta", "text": "kept"})
    assert await store.delete_session(s.id, "o")
    left = sorted(await store.r.keys("chatsvc:*"))
    assert not any(s.id in k for k in left), left
    assert store.stream_key("other", 1) in left


async def test_the_owner_index_drops_expired_sessions(store: Store) -> None:
    s1 = await store.create_session("dora", "p", "sys")
    s2 = await store.create_session("dora", "p", "sys")
    await store.r.delete(session_key(s1.id))  # as if it expired
    assert [m.id for m in await store.list_sessions("dora")] == [s2.id]
    assert await store.r.zrange("chatsvc:owner:dora:sessions", 0, -1) == [s2.id]


def _monitor(url: str, lines: list[str], started: threading.Event) -> None:
    """Every command Redis runs (scripts' own commands included, marked ``lua``) until ``ECHO monitor-end``."""
    with redis.Redis.from_url(url).monitor() as m:
        started.set()
        while True:
            line = m.connection.read_response()
            line = line.decode() if isinstance(line, bytes) else str(line)
            if "monitor-end" in line:
                return
            lines.append(line)


_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_MULTI_KEY = {"DEL", "UNLINK", "EXISTS"}


def script_slots(lines: list[str]) -> list[tuple[str, set[int]]]:
    """Per script run: its first declared key and the hash slots of every key it declared or touched."""
    runs: list[tuple[str, set[int]]] = []
    for line in lines:
        args = _ARG.findall(line)
        if not args:
            continue
        cmd = args[0].upper()
        if " lua]" not in line:
            if cmd in ("EVALSHA", "EVAL"):
                keys = args[3:3 + int(args[2])]
                runs.append((keys[0] if keys else "", {key_slot(k.encode()) for k in keys}))
            continue
        keys = args[1:] if cmd in _MULTI_KEY else args[1:2]
        runs[-1][1].update(key_slot(k.encode()) for k in keys)
    return runs


async def test_every_script_touches_one_hash_slot(store: Store, redis_url: str) -> None:  # noqa: F811
    """What a Redis Cluster requires of a script: all its keys, declared or not, in one slot."""
    lines: list[str] = []
    started = threading.Event()
    watcher = threading.Thread(target=_monitor, args=(redis_url, lines, started), daemon=True)
    watcher.start()
    assert started.wait(10)
    await store.heartbeat()
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    s1 = await store.create_session("o", "p", "sys")
    s2 = await store.create_session("o", "p", "sys")
    assert await store.begin_turn(s1.id, {"role": "user", "content": "1"}, "o") == 1
    assert await store.begin_turn(s2.id, {"role": "user", "content": "1"}, "o") == 1
    events = [(store.stream_key(sid, 1), json.dumps({"type": "delta", "text": "x", "tokens": 1}))
              for sid in (s1.id, s2.id, s1.id)]
    assert all(not isinstance(e, Exception) for e in await store.append_events(events))
    assert await store.is_busy(s1.id) and await store.refresh_lock(s1.id, 1)
    assert await store.end_turn(s1.id, 1, {"role": "assistant", "content": "x"}) == 1
    assert await store.begin_turn(s1.id, {"role": "user", "content": "2"}, "o") == 2
    assert await store.rollback_turn(s1.id, 2)
    # s2's turn belongs to a dead instance: recovered by the sweep, then by a new turn's takeover.
    dead = Store(store.r, 60, 30, instance="ghost")
    assert await dead.begin_turn(s1.id, {"role": "user", "content": "3"}, "o") == 2
    await store.r.delete(f"chatsvc:instance:{store.instance}")  # s2's holder (this store) looks dead now
    store.nonce, store._me = "other", f"{store.instance}|other"
    assert s2.id in await store.recover_dead_turns()
    assert await store.begin_turn(s1.id, {"role": "user", "content": "4"}, "o") == 3  # ghost never beat: dead
    assert await store.delete_session(s2.id, "o")
    await store.r.echo("monitor-end")
    watcher.join(10)
    runs = script_slots(lines)
    assert len(runs) >= 12
    crossing = [(first, slots) for first, slots in runs if len(slots) != 1]
    assert not crossing, crossing


async def test_sessions_stored_before_the_hash_tag_keep_working(store: Store) -> None:
    legacy = "A" * 23 + "b"  # a secrets.token_urlsafe(18) id: its keys were never tagged
    await store.r.hset(f"chatsvc:session:{legacy}", mapping={
        "id": legacy, "owner": "o", "persona": "p", "system_prompt": "sys", "title": "", "created": 1.0,
        "updated": 1.0, "turns": 0, "replied": 0})
    await store.r.zadd("chatsvc:owner:o:sessions", {legacy: 1.0})
    new = await store.create_session("o", "p", "sys")
    assert len(new.id) == 28 and session_key(new.id) == "chatsvc:session:{" + new.id + "}"
    assert session_key(legacy) == f"chatsvc:session:{legacy}"
    assert [m.id for m in await store.list_sessions("o")] == [new.id, legacy]
    assert await store.begin_turn(legacy, {"role": "user", "content": "hi"}, "o") == 1
    await store.append_event(legacy, 1, {"type": "delta", "text": "x"})
    assert await store.r.exists(f"chatsvc:stream:{legacy}:1")
    assert await store.end_turn(legacy, 1, {"role": "assistant", "content": "x"}) == 1
    assert [m["role"] for m in await store.r.lrange(f"chatsvc:session:{legacy}:messages", 0, -1) and
            await store.messages(legacy)] == ["user", "assistant"]
    assert await store.delete_session(legacy, "o")
    assert not await store.r.exists(f"chatsvc:session:{legacy}", f"chatsvc:stream:{legacy}:1")


async def test_personas_seeded_by_an_older_server_are_not_seeded_again(store: Store) -> None:
    await store.r.set("chatsvc:personas:seeded", "1")  # where older servers kept the flag
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    assert await store.list_personas() == {} and await store.get_persona(":seeded") is None
    await store.r.delete("chatsvc:personas:seeded")
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})  # the flag moved into the hash
    assert await store.list_personas() == {}
