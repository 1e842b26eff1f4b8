"""Per-key quotas: concurrent generations, new sessions a minute, open WebSockets (429 + Retry-After, or a
WS error frame); WebSockets that do not authenticate, sit idle or flood frames are closed or throttled."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
import websockets
from fake_engine import FakeEngine, tiny_tokenizer
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from websockets.sync.client import connect

from chatsvc.app import create_app
from chatsvc.settings import Settings
from chatsvc.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
KA, KB = "key-a", "key-b"
A, B = ({"Authorization": f"Bearer {k}"} for k in (KA, KB))
SETTINGS = Settings(api_keys=(KA, KB), web_dir=Path("/nonexistent"), max_pinned_fraction=1.0,
                    max_streams_per_key=2, max_sessions_per_minute=4, max_sockets_per_key=2, ws_auth_timeout_s=0.5,
                    ws_idle_timeout_s=1.5, ws_frames_per_second=5, max_readers_per_reply=2)


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    engine = FakeEngine(tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), SETTINGS)
    with LiveServer(app) as live:
        live.engine = engine  # type: ignore[attr-defined]
        live.gw = app.state.gateway  # type: ignore[attr-defined]
        yield live


def _open_stream(stack: ExitStack, server: LiveServer, headers: dict[str, str]) -> httpx.Response:
    r = stack.enter_context(httpx.stream("POST", server.url + "/v1/chat/completions", headers=headers, timeout=30,
                                         json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                               "max_tokens": 200, "ignore_eos": True}))
    if r.status_code == 200:
        lines = r.iter_lines()
        next(lines)  # generating
        stack.callback(lines.close)  # held open: a dropped line iterator would close the response
    return r


def test_concurrent_generations_per_key(server: LiveServer) -> None:
    server.engine.step_s = 0.05  # type: ignore[attr-defined]
    try:
        with ExitStack() as stack:
            assert all(_open_stream(stack, server, A).status_code == 200 for _ in range(2))
            third = _open_stream(stack, server, A)
            assert third.status_code == 429 and third.headers["retry-after"].isdigit()
            third.read()
            assert json.loads(third.text)["error"]["code"] == "quota_exceeded"
            assert _open_stream(stack, server, B).status_code == 200  # another key's own quota
            sid = httpx.post(server.url + "/v1/sessions", json={}, headers=A).json()["id"]
            r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": "hi"}, headers=A)
            assert r.status_code == 429  # session turns count too
            assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=A).json()["messages"] == []
        deadline = time.monotonic() + 10
        while server.gw.quotas.streams and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        assert not server.gw.quotas.streams  # type: ignore[attr-defined]
    finally:
        server.engine.reset()  # type: ignore[attr-defined]
    ok = httpx.post(server.url + "/v1/chat/completions", headers=A, timeout=30,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_new_sessions_per_minute(server: LiveServer) -> None:
    server.gw.quotas.sessions.clear()  # type: ignore[attr-defined]
    for _ in range(4):
        assert httpx.post(server.url + "/v1/sessions", json={}, headers=B).status_code == 201
    r = httpx.post(server.url + "/v1/sessions", json={}, headers=B)
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 61
    with connect(server.ws_url + "/v1/ws", additional_headers=B) as ws:
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=10))["code"] == "quota_exceeded"
    assert httpx.post(server.url + "/v1/sessions", json={}, headers=A).status_code == 201
    server.gw.quotas.sessions.clear()  # type: ignore[attr-defined]


def test_open_websockets_per_key(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws", additional_headers=A), \
            connect(server.ws_url + "/v1/ws", additional_headers=A):
        with connect(server.ws_url + "/v1/ws", additional_headers=A) as third:
            assert json.loads(third.recv(timeout=10))["code"] == "quota_exceeded"
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                third.recv(timeout=10)
        with connect(server.ws_url + "/v1/ws") as late:  # a key given in hello counts the same
            late.send(json.dumps({"type": "hello", "api_key": KA}))
            assert json.loads(late.recv(timeout=10))["code"] == "quota_exceeded"
        with connect(server.ws_url + "/v1/ws", additional_headers=B) as other:
            other.send(json.dumps({"type": "cancel"}))
            assert json.loads(other.recv(timeout=10))["code"] == "no_session"
    time.sleep(0.2)
    with connect(server.ws_url + "/v1/ws", additional_headers=A) as again:
        again.send(json.dumps({"type": "cancel"}))
        assert json.loads(again.recv(timeout=10))["code"] == "no_session"


def test_unauthenticated_websocket_is_closed(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws") as ws:
        t0 = time.monotonic()
        with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert time.monotonic() - t0 < 5 and e.value.rcvd is not None and e.value.rcvd.code == 1008


def test_idle_websocket_is_closed(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws", additional_headers=A) as ws:
        ws.send(json.dumps({"type": "cancel"}))
        assert json.loads(ws.recv(timeout=10))["code"] == "no_session"
        with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1000


def test_frame_flood_is_throttled(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws", additional_headers=A) as ws:
        for _ in range(30):
            ws.send(json.dumps({"type": "cancel"}))
        codes = [json.loads(ws.recv(timeout=10))["code"] for _ in range(30)]
        assert codes.count("rate_limited") >= 15 and "no_session" in codes
        time.sleep(0.5)  # the bucket refills: the socket is still usable
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session"


def test_readers_of_one_reply(server: LiveServer) -> None:
    server.gw.quotas.sessions.clear()  # type: ignore[attr-defined]
    server.engine.step_s = 0.05  # type: ignore[attr-defined]
    try:
        sid = httpx.post(server.url + "/v1/sessions", json={}, headers=B).json()["id"]
        with ExitStack() as stack:
            first = stack.enter_context(httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", headers=B,
                                                     json={"content": "hi", "max_tokens": 100, "ignore_eos": True},
                                                     timeout=30))
            lines = first.iter_lines()
            next(lines)
            stack.callback(lines.close)
            second = stack.enter_context(httpx.stream("GET", f"{server.url}/v1/sessions/{sid}/stream", headers=B,
                                                      timeout=30))
            assert second.status_code == 200
            third = httpx.get(f"{server.url}/v1/sessions/{sid}/stream", headers=B, timeout=30)
            assert third.status_code == 429 and third.json()["error"]["code"] == "quota_exceeded"
    finally:
        server.engine.reset()  # type: ignore[attr-defined]


def _stalled_request(port: int, path: str, body: dict[str, object], headers: dict[str, str]) -> socket.socket:
    """Send a request and never read the reply; a tiny receive buffer makes the TCP window fill fast."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n{head}\r\n".encode() + raw)
    return sock


@pytest.fixture(scope="module")
def stall_server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    engine = FakeEngine(tiny_tokenizer(tmp_path_factory.mktemp("tok")), max_model_len=16384)
    settings = Settings(api_keys=(KA,), web_dir=Path("/nonexistent"), max_pinned_fraction=1.0, sse_send_timeout_s=1.0,
                        abort_grace_s=0.5)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), settings)
    with LiveServer(app) as live:
        live.engine = engine  # type: ignore[attr-defined]
        live.gw = app.state.gateway  # type: ignore[attr-defined]
        yield live


def test_a_reader_that_stops_reading_is_detached(stall_server: LiveServer) -> None:
    """A client whose TCP window stays full does not keep its generation (and the server's buffers) alive:
    after the send timeout the stream ends and the request is aborted, its quota given back."""
    engine = stall_server.engine  # type: ignore[attr-defined]
    engine.step_s = 0.0005
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 8, "max_tokens": 12000,
                "ignore_eos": True}
        sock = _stalled_request(stall_server.port, "/v1/chat/completions", body, A)
        try:
            deadline = time.monotonic() + 60
            while not engine.aborted and time.monotonic() < deadline:
                time.sleep(0.1)
            assert engine.aborted, "the stalled stream's request was never aborted"
            assert not engine.running
            assert not stall_server.gw.quotas.streams  # type: ignore[attr-defined]
        finally:
            sock.close()
    finally:
        engine.reset()
