from __future__ import annotations

import asyncio

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401

from chatsvc.store import Store


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
    await store.end_turn(s.id, {"role": "assistant", "content": "hi", "finish_reason": "stop"})
    assert not await store.is_busy(s.id)
    assert await store.begin_turn(s.id, {"role": "user", "content": "again"}) == 2
    await store.rollback_turn(s.id)
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
    assert 0 < await store.r.ttl(f"chatsvc:session:{s.id}") <= 60


async def test_untitled_session_is_named_after_its_first_message(store: Store) -> None:
    meta = await store.create_session("carol", "p", "sys")
    assert meta.title == ""
    assert await store.begin_turn(meta.id, {"role": "user", "content": "  How do\nsails   work? " + "x" * 80}) == 1
    await store.end_turn(meta.id, {"role": "assistant", "content": "wind"})
    first = await store.get_session(meta.id, "carol")
    assert first is not None and first.title.startswith("How do sails work? x") and len(first.title) == 60
    assert await store.begin_turn(meta.id, {"role": "user", "content": "second"}) == 2
    again = await store.get_session(meta.id, "carol")
    assert again is not None and again.title == first.title
