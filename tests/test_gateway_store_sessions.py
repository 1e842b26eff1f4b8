"""chatsvc/store/sessions.py on a real Redis: sessions owned, listed newest first, expiring, deleted whole."""

from __future__ import annotations

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.store import Store, session_key
from chatsvc.store.keys import stream_key


async def test_sessions_are_owned_listed_newest_first_and_deleted(store: Store) -> None:  # noqa: F811
    s1 = await store.create_session("alice", "p", "sys")
    s2 = await store.create_session("alice", "p", "sys")
    other = await store.create_session("bob", "p", "sys")
    assert len(s1.id) == 28 and s1.id != s2.id
    assert [m.id for m in await store.list_sessions("alice")] == [s2.id, s1.id]
    assert await store.get_session(other.id, "alice") is None
    assert not await store.delete_session(other.id, "alice")
    assert await store.delete_session(s1.id, "alice")
    assert await store.get_session(s1.id, "alice") is None
    assert [m.id for m in await store.list_sessions("alice")] == [s2.id]
    assert (await store.meta_of(other.id) or s1).owner == "bob"  # whoever owns it
    assert await store.meta_of(s1.id) is None


async def test_session_keys_are_tagged_and_expire_with_ttl(store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    assert await store.r.exists("chatsvc:session:{" + s.id + "}")
    assert 0 < await store.r.ttl(session_key(s.id)) <= 60
    assert 0 < await store.r.ttl("chatsvc:owner:o:sessions") <= 60


async def test_delete_session_removes_its_streams_without_scanning(store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    for turn in (1, 2):
        assert await store.begin_turn(s.id, {"role": "user", "content": str(turn)}) == turn
        await append_event(store, s.id, turn, {"type": "delta", "text": "x"})
        await store.end_turn(s.id, turn, {"role": "assistant", "content": "x"})
    await append_event(store, "other", 1, {"type": "delta", "text": "kept"})
    assert await store.delete_session(s.id, "o")
    left = sorted(await store.r.keys("chatsvc:*"))
    assert not any(s.id in k for k in left), left
    assert stream_key("other", 1) in left


async def test_the_owner_index_drops_expired_sessions(store: Store) -> None:  # noqa: F811
    s1 = await store.create_session("dora", "p", "sys")
    s2 = await store.create_session("dora", "p", "sys")
    await store.r.delete(session_key(s1.id))  # as if it expired
    assert [m.id for m in await store.list_sessions("dora")] == [s2.id]
    assert await store.r.zrange("chatsvc:owner:dora:sessions", 0, -1) == [s2.id]


async def test_update_session_changes_only_an_owned_live_session(store: Store) -> None:  # noqa: F811
    fmt = '{"type":"json_object"}'
    s = await store.create_session("o", "p", "sys", "t", response_format=fmt)
    got = await store.get_session(s.id, "o")
    assert got is not None and got.response_format == fmt and got.public()["response_format"] == {
        "type": "json_object"}
    updated = await store.update_session(s.id, "o", response_format="")
    assert updated is not None and updated.response_format == "" and updated.title == "t"
    assert updated.public()["response_format"] is None
    assert await store.update_session(s.id, "mallory", title="x") is None  # another owner's: untouched
    assert (await store.get_session(s.id, "o") or s).title == "t"
    assert await store.update_session("gone", "o", title="x") is None
    assert not await store.r.exists(session_key("gone"))  # no session appears from an update
