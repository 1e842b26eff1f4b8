"""Persona and session routes over HTTP against a tiny random model (fast) and a real Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

from chatsvc.app import create_app
from chatsvc.settings import Settings
from chatsvc.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    model = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))
    engine = AsyncEngine.from_args(model=str(model), num_kv_blocks=128, max_model_len=512)
    app = create_app(engine, Store.from_url(redis_proc.url), Settings(web_dir=Path("/nonexistent"),
                                                                              max_pinned_fraction=1.0))
    with LiveServer(app) as live:
        deadline = time.monotonic() + 30
        while len(app.state.gateway.personas.pinned) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield live


def pinned_blocks(server: LiveServer) -> int:
    # The engine refreshes its snapshot once someone asks for it: ask, let it refresh, ask again.
    httpx.get(server.url + "/v1/kv")
    time.sleep(0.3)
    return int(httpx.get(server.url + "/v1/kv").json()["state"].count("pinned"))


def sse(resp: httpx.Response) -> list[tuple[str | None, dict]]:
    out, eid = [], None
    for line in resp.iter_lines():
        if line.startswith("id:"):
            eid = line[3:].strip()
        elif line.startswith("data:"):
            out.append((eid, json.loads(line[5:])))
    return out


def test_persona_crud_pins_and_unpins(server: LiveServer) -> None:
    base = pinned_blocks(server)
    prompt = "You are a very precise librarian who answers with exact references and dates. " * 3
    r = httpx.put(server.url + "/v1/personas/librarian", json={"system_prompt": prompt, "description": "books"})
    assert r.status_code == 201 and r.json()["pinned_tokens"] >= 16
    added = pinned_blocks(server) - base
    assert added == r.json()["pinned_tokens"] // 16
    assert httpx.get(server.url + "/v1/personas/librarian").json()["description"] == "books"
    assert "librarian" in [p["name"] for p in httpx.get(server.url + "/v1/personas").json()["data"]]
    r2 = httpx.put(server.url + "/v1/personas/librarian", json={"system_prompt": "Short.", "description": ""})
    assert r2.status_code == 200
    deadline = time.monotonic() + 5
    while pinned_blocks(server) != base and time.monotonic() < deadline:  # unpinning is applied between steps
        time.sleep(0.05)
    assert pinned_blocks(server) == base  # "Short." fills no block
    assert httpx.delete(server.url + "/v1/personas/librarian").status_code == 200
    assert httpx.get(server.url + "/v1/personas/librarian").status_code == 404
    assert httpx.delete(server.url + "/v1/personas/librarian").status_code == 404


def test_sessions_list_newest_first_and_delete(server: LiveServer) -> None:
    ids = [httpx.post(server.url + "/v1/sessions", json={"persona": "tutor", "title": f"t{i}"}).json()["id"]
           for i in range(3)]
    listed = [s["id"] for s in httpx.get(server.url + "/v1/sessions").json()["data"]]
    assert listed[:3] == ids[::-1]
    assert httpx.delete(f"{server.url}/v1/sessions/{ids[0]}").status_code == 200
    assert httpx.get(f"{server.url}/v1/sessions/{ids[0]}").status_code == 404
    assert ids[0] not in [s["id"] for s in httpx.get(server.url + "/v1/sessions").json()["data"]]


def test_session_reply_stream_and_replay_by_last_event_id(server: LiveServer) -> None:
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages",
                      json={"content": "hello there", "max_tokens": 6, "ignore_eos": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert [e["type"] for _, e in events] == ["delta"] * 6 + ["done"]
    assert all(eid and eid.startswith("1:") for eid, _ in events)
    # A finished reply can still be replayed from any event while its stream lives (POST + Last-Event-ID too).
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", headers={"Last-Event-ID": events[2][0]},
                      json={}, timeout=30) as r:
        tail = sse(r)
    assert tail == events[3:]
    view = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert view["turns"] == 1 and view["messages"][1]["content"] == "".join(e.get("text", "") for _, e in events)
    assert view["messages"][0]["tokens"] > 0 and view["messages"][0]["created"] <= view["messages"][1]["created"]


def test_no_web_dir_means_no_ui_route(server: LiveServer) -> None:
    assert httpx.get(server.url + "/").status_code == 404


def without_pings(raw: bytes) -> bytes:
    """The stream minus keep-alive comments, which depend on timing."""
    return b"".join(e + b"\r\n\r\n" for e in raw.split(b"\r\n\r\n") if e and not e.startswith(b":"))


def test_concurrent_replies_batched_together_replay_identically_from_redis(server: LiveServer) -> None:
    """Replies running at once share Redis writes; what each live reader saw (from the turn's log) is exactly
    what a later replay reads back from its Redis stream: same ids, same bytes, nothing missing or repeated."""
    import concurrent.futures

    def one(i: int) -> tuple[str, bytes, list[tuple[str | None, dict]]]:
        sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
        with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages",
                          json={"content": f"count to {i}", "max_tokens": 12, "ignore_eos": True}, timeout=60) as r:
            raw = without_pings(r.read())
        return sid, raw, sse(httpx.Response(200, content=raw))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for sid, raw, events in results:
        assert [e["type"] for _, e in events] == ["delta"] * 12 + ["done"]
        ids = [eid for eid, _ in events]
        keys = [tuple(int(p) for p in str(eid).split(":")[1].split("-")) for eid in ids]
        assert keys == sorted(set(keys))  # strictly increasing: no duplicate, no reordering
        text = "".join(e.get("text", "") for _, e in events)
        assert events[-1][1]["message"]["content"] == text
        # Now the turn is over: the same request reads Redis, and must get the same bytes.
        with httpx.stream("GET", f"{server.url}/v1/sessions/{sid}/stream", headers={"Last-Event-ID": "1:0"},
                          timeout=30) as r:
            assert without_pings(r.read()) == raw
        with httpx.stream("GET", f"{server.url}/v1/sessions/{sid}/stream", headers={"Last-Event-ID": ids[4]},
                          timeout=30) as r:
            assert sse(httpx.Response(200, content=r.read())) == events[5:]
