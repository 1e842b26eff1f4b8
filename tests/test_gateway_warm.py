"""Warm on intent (chatsvc.warm): opening a session asks the engine to bring its history's KV blocks up the
tiers, with exactly the tokens its next prompt starts with; a new or empty session asks nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fake_engine import FakeEngine, engine_fixture, fake_gateway, wait_for  # noqa: F401
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from websockets.sync.client import connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok")) as live:
        yield live


def _session_with_a_turn(server: LiveServer) -> str:
    sid = str(httpx.post(server.url + "/v1/sessions", json={"persona": "tutor"}).json()["id"])
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", json={"content": "Hi there"},
                      timeout=30) as r:
        assert r.status_code == 200
        r.read()
    return sid


def _warms_of(engine: FakeEngine, sid: str) -> list[list[int]]:
    return [ids for key, ids in engine.warms if key == sid]


def test_get_warms_exactly_the_prefix_of_the_next_prompt(server: LiveServer, engine: FakeEngine) -> None:
    sid = _session_with_a_turn(server)
    assert _warms_of(engine, sid) == []  # a message is no intent to come back: its blocks are in use
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 200
    wait_for(lambda: bool(_warms_of(engine, sid)), timeout=10)
    warmed = _warms_of(engine, sid)[0]
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", json={"content": "And then?"},
                      timeout=30) as r:
        r.read()
    prompt = [s.prompt_token_ids for rid, s in engine.submitted.items() if rid.startswith(sid)][-1]
    assert len(warmed) > 0 and prompt[: len(warmed)] == warmed and len(prompt) > len(warmed)


def test_ws_hello_of_an_existing_session_warms_it(server: LiveServer, engine: FakeEngine) -> None:
    sid = _session_with_a_turn(server)
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello", "session_id": sid}))
        assert json.loads(ws.recv())["id"] == sid
    wait_for(lambda: bool(_warms_of(engine, sid)), timeout=10)


def test_new_and_empty_sessions_are_not_warmed(server: LiveServer, engine: FakeEngine) -> None:
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello"}))
        new = json.loads(ws.recv())["id"]
    empty = str(httpx.post(server.url + "/v1/sessions", json={}).json()["id"])
    assert httpx.get(f"{server.url}/v1/sessions/{empty}").status_code == 200
    sid = _session_with_a_turn(server)
    httpx.get(f"{server.url}/v1/sessions/{sid}")
    wait_for(lambda: bool(_warms_of(engine, sid)), timeout=10)  # started after the others'
    assert _warms_of(engine, new) == [] and _warms_of(engine, empty) == []
    assert httpx.get(f"{server.url}/v1/sessions/not-a-session").status_code in (400, 404)
