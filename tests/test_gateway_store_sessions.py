"""chatsvc/store/sessions.py on a real Redis: sessions owned, listed newest first, expiring, deleted whole;
their prompt stored once and referenced; their messages read a page at a time."""

from __future__ import annotations

import json

from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.store import Store, session_key
from chatsvc.store.keys import messages_key, prompt_key, stream_key
from chatsvc.store.sessions import prompt_sha


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


async def test_sessions_share_one_stored_copy_of_their_prompt(store: Store) -> None:  # noqa: F811
    prompt = "You are a patient tutor. " * 40
    a = await store.create_session("o", "tutor", prompt)
    b = await store.create_session("p", "tutor", prompt)
    assert a.prompt_sha == b.prompt_sha == prompt_sha(prompt)
    assert not await store.r.hexists(session_key(a.id), "system_prompt")  # referenced, not copied
    assert await store.r.keys("chatsvc:prompt:*") == [prompt_key(a.prompt_sha)]
    await store.r.expire(prompt_key(a.prompt_sha), 5)
    got = await store.get_session(a.id, "o")
    assert got is not None and got.system_prompt == prompt
    assert await store.r.ttl(prompt_key(a.prompt_sha)) > 60  # a read refreshes it past the session's TTL
    assert (await store.meta_of(b.id) or a).system_prompt == prompt
    assert [m.system_prompt for m in await store.list_sessions("o")] == [""]  # a listing does not resolve it


async def test_a_session_that_holds_its_prompt_inline_still_works(store: Store) -> None:  # noqa: F811
    sid = "legacy-" + "x" * 21
    await store.r.hset(session_key(sid), mapping={"id": sid, "owner": "o", "persona": "p", "system_prompt": "old",
                                                  "title": "", "created": 1.0, "updated": 1.0, "turns": 1,
                                                  "replied": 1})
    await store.r.rpush(messages_key(sid), json.dumps({"role": "user", "content": "hi"}),
                        json.dumps({"role": "assistant", "content": "hello"}))
    meta = await store.get_session(sid, "o")
    assert meta is not None and meta.system_prompt == "old" and meta.prompt_sha == ""
    page = await store.message_page(sid, 10, count_users=True)
    assert (page.first_index, page.message_count, page.user_messages, page.has_more) == (0, 2, 1, False)
    assert await store.begin_turn(sid, {"role": "user", "content": "again"}) == 2
    assert await store.end_turn(sid, 2, {"role": "assistant", "content": "yes"}) == 1
    raw = await store.r.hgetall(session_key(sid))
    stored = await store.r.lrange(messages_key(sid), 0, -1)
    assert int(raw["history_bytes"]) == sum(len(m.encode()) for m in stored) and raw["user_messages"] == "2"


async def test_message_pages_are_read_by_absolute_index(store: Store) -> None:  # noqa: F811
    s = await store.create_session("o", "p", "sys")
    for turn in range(1, 6):
        assert await store.begin_turn(s.id, {"role": "user", "content": f"u{turn}"}) == turn
        await store.end_turn(s.id, turn, {"role": "assistant", "content": f"a{turn}"})
    newest = await store.message_page(s.id, 4)
    assert [m["content"] for m in newest.messages] == ["u4", "a4", "u5", "a5"]
    assert (newest.first_index, newest.message_count, newest.has_more) == (6, 10, True)
    older = await store.message_page(s.id, 4, before=newest.first_index)
    assert older.first_index == 2 and older.has_more
    assert [m["content"] for m in older.messages] == ["u2", "a2", "u3", "a3"]
    first = await store.message_page(s.id, 4, before=older.first_index)
    assert [m["content"] for m in first.messages] == ["u1", "a1"] and not first.has_more
    assert (await store.message_page(s.id, 3, before=99)).first_index == 7  # past the end: the newest
    assert (await store.message_page(s.id, 3, before=0)).messages == []
    assert (await store.message_page(s.id, 3, count_users=True)).user_messages == 5
