"""The WebSocket transport (chatsvc.ws) served by uvicorn over the fake engine and a real Redis."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import REPLY, FakeEngine, engine_fixture, fake_gateway, wait_for  # noqa: F401
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from websockets.sync.client import ClientConnection, connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GRACE_S = 1.5


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok"), abort_grace_s=GRACE_S) as live:
        yield live


@pytest.fixture
def ws(server: LiveServer) -> Iterator[ClientConnection]:
    with connect(server.ws_url + "/v1/ws") as conn:
        yield conn


def ask(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    ws.send(json.dumps(frame))
    return recv(ws)


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=10))  # type: ignore[no-any-return]


def until_done(ws: ClientConnection) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    deltas = []
    while (frame := recv(ws))["type"] == "delta":
        deltas.append(frame)
    return deltas, frame


def test_hello_creates_a_session_of_the_persona(ws: ClientConnection) -> None:
    session = ask(ws, {"type": "hello", "persona": "pirate"})
    assert session["type"] == "session" and session["persona"] == "pirate"
    assert session["messages"] == [] and session["busy"] is False


def test_a_message_streams_deltas_then_done_and_is_stored(server: LiveServer, ws: ClientConnection) -> None:
    sid = ask(ws, {"type": "hello"})["id"]
    ws.send(json.dumps({"type": "message", "content": "Hi there", "max_tokens": 50}))
    deltas, done = until_done(ws)
    assert "".join(d["text"] for d in deltas) == REPLY
    assert all(d["id"].startswith("1:") for d in deltas) and done["id"].startswith("1:")
    assert done["finish_reason"] == "stop" and done["message"]["content"] == REPLY
    assert done["usage"]["completion_tokens"] == len(deltas)
    with connect(server.ws_url + "/v1/ws") as again:
        view = ask(again, {"type": "hello", "session_id": sid})
    assert [(m["role"], m["content"]) for m in view["messages"]] == [("user", "Hi there"), ("assistant", REPLY)]


def test_the_prompt_is_the_persona_and_the_history(server: LiveServer, ws: ClientConnection,
                                                   engine: FakeEngine) -> None:
    ask(ws, {"type": "hello", "persona": "tutor"})
    ws.send(json.dumps({"type": "message", "content": "one"}))
    until_done(ws)
    ws.send(json.dumps({"type": "message", "content": "two"}))
    until_done(ws)
    prompt = engine.tokenizer.decode(list(engine.submitted.values())[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.index("patient tutor") < prompt.index("one") < prompt.index(REPLY) < prompt.index("two")


def test_resume_after_an_event_id_sends_only_the_rest(server: LiveServer, ws: ClientConnection) -> None:
    sid = ask(ws, {"type": "hello"})["id"]
    ws.send(json.dumps({"type": "message", "content": "Hi"}))
    deltas, done = until_done(ws)
    with connect(server.ws_url + "/v1/ws") as other:
        ask(other, {"type": "hello", "session_id": sid})
        other.send(json.dumps({"type": "resume", "after": deltas[2]["id"]}))
        rest, done_again = until_done(other)
    assert [d["id"] for d in rest] == [d["id"] for d in deltas[3:]]
    assert "".join(d["text"] for d in deltas[:3] + rest) == REPLY
    assert done_again == done


def test_resume_without_a_reply_is_stream_not_found(ws: ClientConnection) -> None:
    ask(ws, {"type": "hello"})
    assert ask(ws, {"type": "resume"})["code"] == "stream_not_found"


def test_cancel_ends_the_reply_as_aborted(ws: ClientConnection, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    ask(ws, {"type": "hello"})
    ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 200, "ignore_eos": True}))
    assert recv(ws)["type"] == "delta"
    rid = list(engine.submitted)[-1]
    ws.send(json.dumps({"type": "cancel"}))
    deltas, done = until_done(ws)
    assert done["finish_reason"] == "abort" and len(deltas) < 100
    assert rid in engine.aborted


def test_a_second_message_while_busy_is_refused(ws: ClientConnection, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    ask(ws, {"type": "hello"})
    ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 200, "ignore_eos": True}))
    assert recv(ws)["type"] == "delta"
    ws.send(json.dumps({"type": "message", "content": "again"}))
    while (frame := recv(ws))["type"] == "delta":
        pass
    assert frame["code"] == "session_busy"
    ws.send(json.dumps({"type": "cancel"}))


def test_a_clean_close_aborts_at_once(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    with connect(server.ws_url + "/v1/ws") as ws:
        ask(ws, {"type": "hello"})
        ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 200, "ignore_eos": True}))
        assert recv(ws)["type"] == "delta"
        rid = list(engine.submitted)[-1]
    assert wait_for(lambda: rid in engine.aborted, timeout=GRACE_S / 2)


def test_a_clean_close_while_deltas_stream_aborts_at_once(server: LiveServer, engine: FakeEngine) -> None:
    # Deltas as fast as the engine makes them, read by a client that keeps reading (unbounded queue): the
    # server's pump is mid-send when the close comes, and losing that race must not turn it into a grace.
    engine.step_s = 0.001
    aborted = []
    for _ in range(10):
        with connect(server.ws_url + "/v1/ws", max_queue=None) as ws:
            ask(ws, {"type": "hello"})
            ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 300, "ignore_eos": True}))
            for _ in range(20):
                frame = recv(ws)
                assert frame["type"] == "delta", frame
            rid = list(engine.submitted)[-1]
        aborted.append(wait_for(lambda rid=rid: rid in engine.aborted, timeout=GRACE_S / 2))
    assert all(aborted), aborted


def test_a_dropped_connection_aborts_after_the_grace_unless_resumed(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 0.05

    def start_and_drop() -> tuple[str, str, str]:
        with connect(server.ws_url + "/v1/ws") as ws:
            sid = ask(ws, {"type": "hello"})["id"]
            ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 200, "ignore_eos": True}))
            first = recv(ws)
            ws.socket.shutdown(socket.SHUT_RDWR)  # no close frame: a dropped connection (1006)
        return sid, list(engine.submitted)[-1], first["id"]

    _, rid, _ = start_and_drop()
    assert not wait_for(lambda: rid in engine.aborted, timeout=GRACE_S / 2)
    assert wait_for(lambda: rid in engine.aborted, timeout=GRACE_S * 3)

    sid, rid, first_id = start_and_drop()
    with connect(server.ws_url + "/v1/ws") as ws:
        ask(ws, {"type": "hello", "session_id": sid})
        ws.send(json.dumps({"type": "resume", "after": first_id}))
        time.sleep(GRACE_S * 1.5)
        assert rid not in engine.aborted  # a reader came back within the grace
        ws.send(json.dumps({"type": "cancel"}))
        _, done = until_done(ws)
    assert done["finish_reason"] == "abort"


@pytest.mark.parametrize(("frames", "code"), [
    ([{"type": "message", "content": "x"}], "no_session"),
    ([{"type": "shout"}], "invalid_frame"),
    ([{"type": "hello", "session_id": "nope"}], "session_not_found"),
    ([{"type": "hello", "persona": "nobody"}], "persona_not_found"),
    ([{"type": "hello", "session_id": 5}], "invalid_value"),
    ([{"type": "hello"}, {"type": "message", "content": " "}], "invalid_value"),
    ([{"type": "hello"}, {"type": "message", "content": "x", "temperature": 9}], "invalid_value"),
    ([{"type": "hello"}, {"type": "resume", "after": 3}], "invalid_value"),
])
def test_bad_frames_get_an_error_frame_and_the_socket_stays_open(ws: ClientConnection,
                                                                  frames: list[dict[str, Any]], code: str) -> None:
    for frame in frames[:-1]:
        ask(ws, frame)
    err = ask(ws, frames[-1])
    assert err["type"] == "error" and err["code"] == code
    assert ask(ws, {"type": "hello"})["type"] == "session"


def test_hello_shows_the_newest_messages_up_to_its_limit(ws: ClientConnection) -> None:
    sid = ask(ws, {"type": "hello"})["id"]
    for _ in range(2):
        ws.send(json.dumps({"type": "message", "content": "Hi there", "max_tokens": 50}))
        until_done(ws)
    session = ask(ws, {"type": "hello", "session_id": sid, "limit": 3})
    assert [m["role"] for m in session["messages"]] == ["assistant", "user", "assistant"]
    assert (session["first_index"], session["has_more"], session["message_count"]) == (1, True, 4)
    assert len(ask(ws, {"type": "hello", "session_id": sid})["messages"]) == 4
    assert ask(ws, {"type": "hello", "session_id": sid, "limit": 0})["code"] == "invalid_value"
