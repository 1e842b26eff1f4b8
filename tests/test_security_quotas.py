"""Per-key quotas: concurrent generations, new sessions a minute, open WebSockets (429 + Retry-After, or a
WS error frame); WebSockets that do not authenticate, sit idle or flood frames are closed or throttled."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
import websockets
from fake_engine import FakeEngine, fake_gateways, tiny_tokenizer
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
                    ws_idle_timeout_s=1.5, ws_frames_per_second=5, max_readers_per_reply=2,
                    max_kv_streams_per_key=2)


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    engine = FakeEngine(tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), SETTINGS)
    with LiveServer(app) as live:
        live.engine = engine  # type: ignore[attr-defined]
        live.gw = app.state.gateway  # type: ignore[attr-defined]
        live.redis_url = redis_proc.url  # type: ignore[attr-defined]
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
        while _held(server.redis_url) and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        assert not _held(server.redis_url)  # type: ignore[attr-defined]
    finally:
        server.engine.reset()  # type: ignore[attr-defined]
    ok = httpx.post(server.url + "/v1/chat/completions", headers=A, timeout=30,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_new_sessions_per_minute(server: LiveServer) -> None:
    _clear_session_windows(server.redis_url)  # type: ignore[attr-defined]
    for _ in range(4):
        assert httpx.post(server.url + "/v1/sessions", json={}, headers=B).status_code == 201
    r = httpx.post(server.url + "/v1/sessions", json={}, headers=B)
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 61
    with connect(server.ws_url + "/v1/ws", additional_headers=B) as ws:
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=10))["code"] == "quota_exceeded"
    assert httpx.post(server.url + "/v1/sessions", json={}, headers=A).status_code == 201
    _clear_session_windows(server.redis_url)  # type: ignore[attr-defined]


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
    _clear_session_windows(server.redis_url)  # type: ignore[attr-defined]
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


def test_kv_streams_per_key(server: LiveServer) -> None:
    """Each /v1/kv/stream connection holds a send loop: at most the key's cap are open at once."""
    with ExitStack() as stack:
        for _ in range(2):
            r = stack.enter_context(httpx.stream("GET", server.url + "/v1/kv/stream", headers=A, timeout=30))
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("event: kv")
            stack.callback(lines.close)
        third = httpx.get(server.url + "/v1/kv/stream", headers=A, timeout=30)
        assert third.status_code == 429 and third.json()["error"]["code"] == "quota_exceeded"
        other = stack.enter_context(httpx.stream("GET", server.url + "/v1/kv/stream", headers=B, timeout=30))
        assert other.status_code == 200
    deadline = time.monotonic() + 10
    while _held(server.redis_url, "kv_streams") and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert not _held(server.redis_url, "kv_streams")  # type: ignore[attr-defined]


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
        live.redis_url = redis_proc.url  # type: ignore[attr-defined]
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
            wait_until_given_back = time.monotonic() + 10
            while _held(stall_server.redis_url) and time.monotonic() < wait_until_given_back:  # type: ignore[attr-defined]
                time.sleep(0.05)
            assert not _held(stall_server.redis_url)  # type: ignore[attr-defined]
        finally:
            sock.close()
    finally:
        engine.reset()


def _clear_session_windows(url: str) -> None:
    r = sync_redis.Redis.from_url(url)
    for key in r.scan_iter("chatsvc:owner:*:quota:sessions"):
        r.delete(key)


def _held(url: str, kind: str = "generations") -> int:
    r = sync_redis.Redis.from_url(url)
    return sum(int(r.zcard(key)) for key in r.scan_iter(f"chatsvc:owner:*:quota:{kind}"))


FAIR = Settings(api_keys=(KA, KB), web_dir=Path("/nonexistent"), max_pinned_fraction=1.0, max_streams_per_key=8,
                max_sequences_per_key=16, max_sessions_per_minute=100, max_personas_per_key=4,
                max_live_sessions_per_key=30)


@pytest.fixture(scope="module")
def gateways(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:  # noqa: F811
    """Two gateways, each with its own engine, on one Redis (a database of their own): every per-key quota
    is shared between them."""
    url = redis_proc.url.rsplit("/", 1)[0] + "/1"
    with fake_gateways(url, tmp_path_factory.mktemp("tok-fair"), FAIR, max_model_len=4096) as lives:
        for live in lives:
            live.redis_url = url  # type: ignore[attr-defined]
        yield lives


class _Held:
    """Requests sent at once from threads, each held open once admitted until :meth:`close`."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.stack = ExitStack()
        self.lock = threading.Lock()

    def send(self, method: str, url: str, headers: dict[str, str], body: dict[str, object]) -> None:
        r = self.stack.enter_context(httpx.stream(method, url, headers=headers, json=body, timeout=30))
        if r.status_code == 200:
            lines = r.iter_lines()
            next(lines)
            self.stack.callback(lines.close)
        else:
            r.read()
        with self.lock:
            self.statuses.append(r.status_code)

    def burst(self, calls: list[tuple[str, str, dict[str, str], dict[str, object]]]) -> list[int]:
        threads = [threading.Thread(target=self.send, args=c) for c in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return sorted(self.statuses)

    def close(self) -> None:
        self.stack.close()


def _slow(gws: list[LiveServer]) -> None:
    for g in gws:
        g.engine.step_s = 0.05  # type: ignore[attr-defined]


def _url(gws: list[LiveServer]) -> str:
    return str(gws[0].redis_url)  # type: ignore[attr-defined]


def _reset(gws: list[LiveServer]) -> None:
    url = _url(gws)
    for g in gws:
        g.engine.reset()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while _held(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held(url) == 0, "a quota place was not given back"


LONG = {"content": "hi", "max_tokens": 400, "ignore_eos": True}


def test_a_burst_of_turns_on_many_sessions_cannot_walk_past_the_limit(gateways: list[LiveServer],) -> None:
    """24 messages sent at once to 24 sessions of one key on one gateway: the limit's 8 start, 16 get 429."""
    g = gateways[0]
    _clear_session_windows(_url(gateways))
    sids = [httpx.post(g.url + "/v1/sessions", json={}, headers=A).json()["id"] for _ in range(24)]
    held = _Held()
    _slow(gateways)
    try:
        statuses = held.burst([("POST", f"{g.url}/v1/sessions/{sid}/messages", A, LONG) for sid in sids])
        assert statuses == [200] * 8 + [429] * 16
        assert _held(_url(gateways)) == 8
        refused = [sid for sid in sids if not httpx.get(f"{g.url}/v1/sessions/{sid}", headers=A).json()["busy"]]
        assert len(refused) == 16
        assert all(httpx.get(f"{g.url}/v1/sessions/{sid}", headers=A).json()["messages"] == [] for sid in refused)
    finally:
        held.close()
        _reset(gateways)


def test_two_gateways_share_one_quota_per_key(gateways: list[LiveServer]) -> None:
    """Streams of one key spread over two gateways: 8 in all, not 8 each; another key keeps its own."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 400, "ignore_eos": True}
    held = _Held()
    _slow(gateways)
    try:
        statuses = held.burst([("POST", gateways[i % 2].url + "/v1/chat/completions", A, body) for i in range(16)])
        assert statuses == [200] * 8 + [429] * 8
        other = held.burst([("POST", gateways[1].url + "/v1/chat/completions", B, body)])
        assert other.count(200) == 9  # key B still starts
    finally:
        held.close()
        _reset(gateways)


def test_generations_are_weighed_in_sequences(gateways: list[LiveServer]) -> None:
    """n (and best_of) count as that many sequences: two n=8 streams hold a key's 16, a third is refused."""
    g = gateways[0]

    def body(**kw: object) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 400,
                "ignore_eos": True, **kw}

    held = _Held()
    _slow(gateways)
    try:
        assert held.burst([("POST", g.url + "/v1/chat/completions", A, body(n=8)) for _ in range(2)]) == [200, 200]
        third = httpx.post(g.url + "/v1/chat/completions", headers=A, json=body(n=8), timeout=30)
        assert third.status_code == 429 and "sequences" in third.json()["error"]["message"]
        beams = httpx.post(g.url + "/v1/chat/completions", headers=A, timeout=30,
                           json=body(use_beam_search=True, best_of=4, n=1, stream=False, max_tokens=4))
        assert beams.status_code == 429  # a beam search's width counts the same way
        assert _held(_url(gateways)) == 2
    finally:
        held.close()
        _reset(gateways)


def test_persona_writes_count_against_the_key(gateways: list[LiveServer]) -> None:
    """A persona PUT runs a prefill: refused past the key's generations; concurrent PUTs never pass the
    per-key persona limit; a PUT the engine's full queue refuses answers 429 and stores nothing."""
    g = gateways[0]
    engine = g.engine  # type: ignore[attr-defined]
    persona = {"system_prompt": "You are terse. " * 8}
    held = _Held()
    _slow(gateways)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 400,
                "ignore_eos": True}
        assert held.burst([("POST", g.url + "/v1/chat/completions", A, body) for _ in range(8)]) == [200] * 8
        r = httpx.put(g.url + "/v1/personas/busy", headers=A, json=persona)
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded"
    finally:
        held.close()
        _reset(gateways)
    statuses = []
    threads = [threading.Thread(target=lambda i=i: statuses.append(
        httpx.put(f"{g.url}/v1/personas/p{i}", headers=B, json=persona, timeout=30).status_code)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mine = [p for p in httpx.get(g.url + "/v1/personas", headers=B).json()["data"] if p["scope"] == "own"]
    assert len(mine) == statuses.count(201) <= 4 and set(statuses) <= {201, 403, 429}
    engine.max_running = 0  # the engine's queue is full
    try:
        r = httpx.put(g.url + "/v1/personas/full", headers=A, json=persona)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert httpx.get(g.url + "/v1/personas/full", headers=A).status_code == 404
    finally:
        engine.max_running = None
    assert _held(_url(gateways)) == 0


def test_live_sessions_per_key(gateways: list[LiveServer]) -> None:
    """A key holds at most its cap of live sessions, on every gateway together; deleting one frees a place."""
    _clear_session_windows(_url(gateways))
    sids = [httpx.post(gateways[i % 2].url + "/v1/sessions", json={}, headers=B).json()["id"] for i in range(30)]
    r = httpx.post(gateways[0].url + "/v1/sessions", json={}, headers=B)
    assert r.status_code == 429 and "live sessions" in r.json()["error"]["message"]
    with connect(gateways[1].ws_url + "/v1/ws", additional_headers=B) as ws:
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=10))["code"] == "quota_exceeded"
    assert httpx.delete(f"{gateways[1].url}/v1/sessions/{sids[0]}", headers=B).status_code == 200
    assert httpx.post(gateways[0].url + "/v1/sessions", json={}, headers=B).status_code == 201
