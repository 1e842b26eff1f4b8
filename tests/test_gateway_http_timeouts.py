"""Read deadlines against real sockets: a client trickling its headers or its body a byte at a time is
answered 408 and closed within the limit, on both HTTP parsers, while ordinary requests, a reply that
streams for longer than both limits, a kept-alive connection and a WebSocket are unaffected."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from fake_engine import FakeEngine, tiny_tokenizer
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from timing import scaled
from websockets.sync.client import connect

from chatsvc.app import create_app
from chatsvc.http_timeouts import LINGER_S, read_deadline_protocol
from chatsvc.settings import Settings
from chatsvc.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
HEADER_S, BODY_S = 1.0, 1.5
TRICKLE_S = 0.1  # between bytes: well inside uvicorn's keep-alive timeout, which every byte resets


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest, redis_proc,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    redis.Redis.from_url(redis_proc.url).flushdb()
    engine = FakeEngine(tiny_tokenizer(tmp_path_factory.mktemp("tok")), step_s=0.05)
    app = create_app(engine, Store.from_url(redis_proc.url), Settings(web_dir=Path("/nonexistent")))
    with LiveServer(app, http=read_deadline_protocol(request.param, HEADER_S, BODY_S)) as live:
        yield live


def trickle(server: LiveServer, payload: bytes, head: bytes = b"") -> tuple[bytes, float]:
    """Send ``head`` at once, then ``payload`` a byte at a time until the server answers or closes; (what it
    answered, seconds from the head until it closed)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(scaled(10))
    sock.sendall(head)
    start = time.monotonic()
    try:
        for byte in payload:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(TRICKLE_S)
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK) is not None:
                    break  # answered (or closed: b"")
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer, time.monotonic() - start
    finally:
        sock.close()


def test_trickled_headers_are_cut_at_the_header_timeout(server: LiveServer) -> None:
    headers = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    answer, took = trickle(server, headers)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert HEADER_S * 0.9 <= took < HEADER_S + scaled(2)


def test_a_client_still_sending_after_the_408_reads_it_to_a_clean_close(server: LiveServer) -> None:
    """The bytes a client sends after its 408 are read and dropped: it reads the whole answer and then the
    server's FIN, never a reset (which could discard the answer before the client reads it)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(scaled(10))
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert sock.recv(1, socket.MSG_PEEK) == b"H"  # the 408 is out
        for _ in range(5):
            sock.sendall(b"aaaa")
            time.sleep(0.05)
        answer = b""
        while chunk := sock.recv(4096):  # ConnectionResetError here is the failure
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and answer.endswith(b"request timeout\n"), answer
    finally:
        sock.close()


def test_a_client_that_never_stops_sending_is_closed_after_the_linger(server: LiveServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(scaled(10))
    start = time.monotonic()
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert sock.recv(1, socket.MSG_PEEK) == b"H"
        with pytest.raises(OSError):  # a reset or a broken pipe, once the server has closed
            while time.monotonic() - start < HEADER_S + LINGER_S + scaled(5):
                sock.sendall(b"a")
                time.sleep(0.05)
        assert HEADER_S + LINGER_S * 0.9 <= time.monotonic() - start < HEADER_S + LINGER_S + scaled(2)
    finally:
        sock.close()


def test_a_silent_connection_is_cut_at_the_header_timeout(server: LiveServer) -> None:
    answer, took = trickle(server, b"")
    assert answer.startswith(b"HTTP/1.1 408") and took < HEADER_S + scaled(2)


def test_a_trickled_body_is_cut_at_the_body_timeout(server: LiveServer) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 300}]}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    answer, took = trickle(server, body, head)  # the headers at once: only the body trickles
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert BODY_S * 0.9 <= took < BODY_S + scaled(2)


def test_ordinary_clients_and_long_streams_are_unaffected(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=scaled(30)) as client:
        assert client.get("/health").status_code == 200
        time.sleep(HEADER_S + 0.2)  # an idle kept-alive connection between requests is keep-alive's business
        # A reply streaming for longer than both limits together is never cut: its request was read in time.
        start = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start > HEADER_S + BODY_S
        assert lines[-1] == "data: [DONE]"
        assert client.get("/health").status_code == 200  # the same connection, after the long reply


def test_a_websocket_outlives_both_limits(server: LiveServer) -> None:
    with connect(f"{server.ws_url}/v1/ws", subprotocols=["chatsvc"]) as ws:  # type: ignore[list-item]
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=scaled(10)))["type"] == "session"
        time.sleep(HEADER_S + BODY_S + 0.5)
        ws.send(json.dumps({"type": "message", "content": "hi", "max_tokens": 3}))
        while (frame := json.loads(ws.recv(timeout=scaled(10))))["type"] == "delta":
            pass
        assert frame["type"] == "done"
