"""The session routes over HTTP/SSE (chatsvc.sessions, chatsvc.session_ops) and the KV routes
(chatsvc.kv_routes), served by uvicorn over the fake engine and a real Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from fake_engine import REPLY, FakeEngine, engine_fixture, fake_gateway, wait_for  # noqa: F401
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

from chatsvc.store.keys import prompt_key, session_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GRACE_S = 1.5
LONG = {"content": "long", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok"), abort_grace_s=GRACE_S) as live:
        yield live


@pytest.fixture
def sid(server: LiveServer) -> str:
    r = httpx.post(server.url + "/v1/sessions", json={"persona": "tutor"})
    assert r.status_code == 201
    return str(r.json()["id"])


def events(resp: httpx.Response, limit: int | None = None) -> list[tuple[str | None, dict[str, Any]]]:
    out: list[tuple[str | None, dict[str, Any]]] = []
    eid = None
    for line in resp.iter_lines():
        if line.startswith("id:"):
            eid = line[3:].strip()
        elif line.startswith("data:"):
            out.append((eid, json.loads(line[5:])))
            if limit is not None and len(out) >= limit:
                break
    return out


def send(server: LiveServer, sid: str, body: dict[str, Any], limit: int | None = None,
         headers: dict[str, str] | None = None) -> list[tuple[str | None, dict[str, Any]]]:
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", json=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        return events(r, limit)


def text(evs: list[tuple[str | None, dict[str, Any]]]) -> str:
    return "".join(e["text"] for _, e in evs if e["type"] == "delta")


def test_a_message_streams_its_reply_with_event_ids(server: LiveServer, sid: str) -> None:
    evs = send(server, sid, {"content": "Hi"})
    assert text(evs) == REPLY and evs[-1][1]["type"] == "done" and evs[-1][1]["finish_reason"] == "stop"
    assert all(eid is not None and eid.startswith("1:") for eid, _ in evs)
    view = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert view["busy"] is False and [m["content"] for m in view["messages"]] == ["Hi", REPLY]


@pytest.mark.parametrize("how", ["after", "last-event-id", "post-last-event-id"])
def test_resuming_after_an_event_sends_only_the_rest(server: LiveServer, sid: str, how: str) -> None:
    evs = send(server, sid, {"content": "Hi"})
    after = evs[2][0]
    assert after is not None
    url = f"{server.url}/v1/sessions/{sid}"
    if how == "after":
        r = httpx.get(url + "/stream", params={"after": after})
    elif how == "last-event-id":
        r = httpx.get(url + "/stream", headers={"Last-Event-ID": after})
    else:  # an SSE client reconnecting to the POST: no second message
        r = httpx.post(url + "/messages", json={"content": "ignored"}, headers={"Last-Event-ID": after})
    rest = events(r)
    assert rest == evs[3:]
    assert len(httpx.get(url).json()["messages"]) == 2


def test_stream_without_a_reply_is_404(server: LiveServer, sid: str) -> None:
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/stream")
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"


def test_cancel_route_aborts_the_running_reply(server: LiveServer, sid: str, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    send(server, sid, LONG, limit=1)  # the SSE client leaves; the turn runs on within the grace
    rid = list(engine.submitted)[-1]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/cancel")
    assert r.json() == {"id": sid, "cancelled": True}
    assert rid in engine.aborted
    assert httpx.post(f"{server.url}/v1/sessions/{sid}/cancel").json()["cancelled"] is False
    last = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"][-1]
    assert last["role"] == "assistant" and last["finish_reason"] == "abort"


def test_an_sse_client_leaving_aborts_after_the_grace_unless_one_resumes(server: LiveServer, sid: str,
                                                                          engine: FakeEngine) -> None:
    engine.step_s = 0.05
    first = send(server, sid, LONG, limit=1)
    rid = list(engine.submitted)[-1]
    assert not wait_for(lambda: rid in engine.aborted, timeout=GRACE_S / 2)
    assert wait_for(lambda: rid in engine.aborted, timeout=GRACE_S * 3)
    # the aborted turn is stored before the session takes another message
    assert wait_for(lambda: not httpx.get(f"{server.url}/v1/sessions/{sid}").json()["busy"], timeout=5)

    first = send(server, sid, LONG, limit=1)
    rid = list(engine.submitted)[-1]
    with httpx.stream("GET", f"{server.url}/v1/sessions/{sid}/stream",
                      headers={"Last-Event-ID": str(first[0][0])}) as r:
        rest = events(r, limit=int(GRACE_S * 1.5 / 0.05))  # read on past the grace
        assert rid not in engine.aborted and [e["type"] for _, e in rest] == ["delta"] * len(rest)
    httpx.post(f"{server.url}/v1/sessions/{sid}/cancel")


def test_deleting_a_busy_session_cancels_its_reply(server: LiveServer, sid: str, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    send(server, sid, LONG, limit=1)
    rid = list(engine.submitted)[-1]
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").json() == {"id": sid, "deleted": True}
    assert rid in engine.aborted
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 404


def test_kv_picks_out_a_sessions_blocks(server: LiveServer, sid: str, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    send(server, sid, LONG, limit=1)
    rid = list(engine.submitted)[-1]
    kv = httpx.get(server.url + "/v1/kv", params={"session_id": sid}).json()
    assert kv["session"]["id"] == sid and kv["session"]["request_id"] == rid
    assert kv["session"]["blocks"] == kv["requests"][rid]
    assert kv["session"]["persona_blocks"] == kv["pins"]["persona:tutor"] != []
    assert kv["kv_blocks_total"] == 64  # the engine's stats ride along
    httpx.post(f"{server.url}/v1/sessions/{sid}/cancel")
    plain = httpx.get(server.url + "/v1/kv").json()
    assert "session" not in plain and plain["requests"] == {}


def test_kv_of_an_unknown_session_is_404(server: LiveServer) -> None:
    r = httpx.get(server.url + "/v1/kv", params={"session_id": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_kv_stream_sends_kv_events(server: LiveServer, sid: str) -> None:
    with httpx.stream("GET", server.url + "/v1/kv/stream", params={"session_id": sid}) as r:
        lines = iter(r.iter_lines())
        assert next(line for line in lines if line.startswith("event:")) == "event: kv"
        data = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
    assert data["session"]["id"] == sid and data["session"]["blocks"] == []


def fill(redis_url: str, sid: str, turns: int, owner: str | None = None) -> str:
    """``turns`` stored turns in session ``sid`` (a new session of ``owner`` when given), through the store."""
    import asyncio

    from chatsvc.store import Store

    async def run() -> str:
        store = Store.from_url(redis_url)
        try:
            nonlocal sid
            if owner is not None:
                sid = (await store.create_session(owner, "tutor", "sys")).id
            for turn in range(1, turns + 1):
                assert await store.begin_turn(sid, {"role": "user", "content": f"u{turn}"}) == turn
                await store.end_turn(sid, turn, {"role": "assistant", "content": f"a{turn}"})
            return sid
        finally:
            await store.close()
    return asyncio.run(run())


def test_a_session_shows_its_newest_messages_and_pages_older_ones(server: LiveServer, sid: str,
                                                                 redis_proc) -> None:  # noqa: F811
    fill(redis_proc.url, sid, 55)
    view = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert len(view["messages"]) == 100 and view["messages"][-1]["content"] == "a55"
    assert (view["first_index"], view["has_more"], view["message_count"], view["trimmed_messages"]) == (10, True, 110, 0)
    small = httpx.get(f"{server.url}/v1/sessions/{sid}", params={"limit": 3}).json()
    assert [m["content"] for m in small["messages"]] == ["a54", "u55", "a55"] and small["first_index"] == 107
    older = httpx.get(f"{server.url}/v1/sessions/{sid}/messages", params={"before": 10, "limit": 1000}).json()
    assert [m["content"] for m in older["messages"]][:3] == ["u1", "a1", "u2"] and len(older["messages"]) == 10
    assert (older["first_index"], older["has_more"]) == (0, False)
    newest = httpx.get(f"{server.url}/v1/sessions/{sid}/messages").json()
    assert newest["messages"] == view["messages"]


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 1001}, {"limit": "x"}, {"before": -1}, {"before": "١"}])
def test_a_bad_page_is_a_400(server: LiveServer, sid: str, query: dict[str, Any]) -> None:
    r = httpx.get(f"{server.url}/v1/sessions/{sid}/messages", params=query)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(query))
    if "limit" in query:
        assert httpx.get(f"{server.url}/v1/sessions/{sid}", params=query).status_code == 400


def test_another_owners_messages_are_not_found(server: LiveServer, redis_proc) -> None:  # noqa: F811
    other = fill(redis_proc.url, "", 2, owner="someone-else")
    r = httpx.get(f"{server.url}/v1/sessions/{other}/messages")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_a_session_whose_prompt_was_evicted_still_reads_but_refuses_a_turn(server: LiveServer, sid: str,
                                                                           redis_proc) -> None:  # noqa: F811
    """Under a Redis memory policy the shared prompt copy may go: the session's messages still read, and a new
    turn (which could not be built as the earlier ones were) is a clear 410, not a 500."""
    assert [e["type"] for _, e in send(server, sid, {"content": "hi"})][-1] == "done"
    r = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    assert r.delete(prompt_key(r.hget(session_key(sid), "prompt_sha"))) == 1
    view = httpx.get(f"{server.url}/v1/sessions/{sid}")
    assert view.status_code == 200 and view.json()["system_prompt_lost"] is True
    assert [m["role"] for m in view.json()["messages"]] == ["user", "assistant"]
    refused = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": "more"})
    assert refused.status_code == 410 and refused.json()["error"]["code"] == "system_prompt_lost"
    assert len(httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"]) == 2  # nothing stored
    assert "system_prompt_lost" not in httpx.get(f"{server.url}/v1/sessions/{fresh_session(server)}").json()


def fresh_session(server: LiveServer) -> str:
    return str(httpx.post(f"{server.url}/v1/sessions", json={}).json()["id"])
