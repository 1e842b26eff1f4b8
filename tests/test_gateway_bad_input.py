"""Bad input, table-driven: each case gets its status, an OpenAI-shaped error body, stores nothing and
leaves no KV block held. Runs against a tiny random model with API keys on, so it is fast."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
import websockets
from gateway_fixtures import LiveServer, free_port, redis_proc, wait_personas_pinned  # noqa: F401
from websockets.sync.client import connect

from chatsvc.app import create_app
from chatsvc.settings import Settings
from chatsvc.store import Store, session_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
KEY_A, KEY_B = "key-a", "key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}


def tiny_engine(tmp: Path, **kw: Any) -> Any:
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(model=str(make_tiny_model_dir(tmp)), num_kv_blocks=64, max_model_len=256, **kw)


SETTINGS = Settings(api_keys=(KEY_A, KEY_B), max_body_bytes=12_000, max_message_chars=2000, max_ws_frame_bytes=1024,
                    max_n=4, abort_grace_s=0.2, max_pinned_fraction=1.0)  # the tiny tokenizer's personas are long


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    engine = tiny_engine(tmp_path_factory.mktemp("tiny"))
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), SETTINGS)
    with LiveServer(app, ws_max_size=8 * 1024) as live:
        wait_personas_pinned(app)
        live.redis = sync_redis.Redis.from_url(redis_proc.url)  # type: ignore[attr-defined]
        live.engine = engine  # type: ignore[attr-defined]
        yield live


@pytest.fixture(scope="module")
def foreign_sid(server: LiveServer) -> str:
    r = httpx.post(server.url + "/v1/sessions", json={"persona": "assistant"}, headers=A)
    assert r.status_code == 201
    return str(r.json()["id"])


@pytest.fixture(scope="module")
def expired_sid(server: LiveServer) -> str:
    sid = str(httpx.post(server.url + "/v1/sessions", json={}, headers=A).json()["id"])
    server.redis.pexpire(session_key(sid), 1)  # type: ignore[attr-defined]
    time.sleep(0.01)
    # Reading an expired key deletes it, so the key count is settled before the table measures it.
    assert not server.redis.exists(session_key(sid))  # type: ignore[attr-defined]
    return sid


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


LONG = "hello world " * 300  # ~600+ tokens with the tiny tokenizer: over max_model_len 256
# (id, method, path, json body or raw bytes, headers, status, error code or None)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str | None]] = [
    ("malformed-json", "POST", "/v1/chat/completions", b"{not json", A, 400, "invalid_json"),
    ("not-an-object", "POST", "/v1/chat/completions", b"[1, 2]", A, 400, "invalid_json"),
    ("wrong-types", "POST", "/v1/chat/completions", {"messages": "hi"}, A, 400, "invalid_value"),
    ("missing-messages", "POST", "/v1/chat/completions", {"model": "x"}, A, 400, "invalid_value"),
    ("empty-messages", "POST", "/v1/chat/completions", {"messages": []}, A, 400, "invalid_value"),
    ("empty-content", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": ""}]), A, 400,
     "invalid_value"),
    ("unknown-role", "POST", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), A, 400,
     "invalid_value"),
    ("prompt-too-long", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG}]), A,
     400, "context_length_exceeded"),
    ("completion-prompt-too-long", "POST", "/v1/completions", {"prompt": LONG}, A, 400, "context_length_exceeded"),
    ("max-tokens-0", "POST", "/v1/chat/completions", chat(max_tokens=0), A, 400, "invalid_value"),
    ("max-tokens-huge", "POST", "/v1/chat/completions", chat(max_tokens=10**9), A, 400, "context_length_exceeded"),
    ("temperature-negative", "POST", "/v1/chat/completions", chat(temperature=-0.5), A, 400, "invalid_value"),
    ("top-p-0", "POST", "/v1/chat/completions", chat(top_p=0), A, 400, "invalid_value"),
    ("top-p-over-1", "POST", "/v1/chat/completions", chat(top_p=1.5), A, 400, "invalid_value"),
    ("n-0", "POST", "/v1/chat/completions", chat(n=0), A, 400, "invalid_value"),
    ("n-too-big", "POST", "/v1/chat/completions", chat(n=50), A, 400, "invalid_value"),
    ("unknown-model", "POST", "/v1/chat/completions", chat(model="gpt-17"), A, 404, "model_not_found"),
    ("token-id-out-of-range", "POST", "/v1/completions", {"prompt": [10**7]}, A, 400, "invalid_value"),
    ("oversized-body", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 13_000}]),
     A, 413, "body_too_large"),
    ("missing-key", "POST", "/v1/chat/completions", chat(), {}, 401, "missing_api_key"),
    ("wrong-key", "POST", "/v1/chat/completions", chat(), {"Authorization": "Bearer nope"}, 401,
     "invalid_api_key"),
    ("missing-key-sessions", "GET", "/v1/sessions", None, {}, 401, "missing_api_key"),
    ("unknown-persona", "POST", "/v1/sessions", {"persona": "nobody"}, A, 404, "persona_not_found"),
    ("bad-persona-name", "PUT", "/v1/personas/bad name!", {"system_prompt": "x"}, A, 400, "invalid_value"),
    ("persona-empty-prompt", "PUT", "/v1/personas/new", {"system_prompt": ""}, A, 400, "invalid_value"),
    ("unknown-session", "GET", "/v1/sessions/doesnotexist", None, A, 404, "session_not_found"),
    ("unknown-session-message", "POST", "/v1/sessions/doesnotexist/messages", {"content": "hi"}, A, 404,
     "session_not_found"),
    ("unknown-route", "GET", "/v1/nothing-here", None, A, 404, None),
    # JSON that Python's parser rejects or overflows on, and numbers no field can hold.
    ("huge-int", "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": '
     + b"9" * 5000 + b"}", A, 400, "invalid_value"),
    ("deep-nesting", "POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", A, 400,
     "invalid_json"),
    ("lone-surrogate-content", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', A, 400, "invalid_value"),
    ("lone-surrogate-title", "POST", "/v1/sessions", b'{"title": "\\udc00"}', A, 400, "invalid_value"),
    ("lone-surrogate-persona", "PUT", "/v1/personas/x", b'{"system_prompt": "a\\ud800b"}', A, 400,
     "invalid_value"),
    *[(f"non-finite-{field}-{lit.decode()}", "POST", "/v1/chat/completions",
       b'{"messages": [{"role": "user", "content": "hi"}], "' + field.encode() + b'": ' + lit + b"}", A, 400,
       "invalid_value")
      for field in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "max_tokens", "min_tokens", "n", "top_logprobs")
      for lit in (b"Infinity", b"-Infinity", b"NaN", b"1e999", b"-1e999")],
    ("completion-prompt-huge-token", "POST", "/v1/completions", b'{"prompt": [' + b"1" * 30 + b"]}", A, 400,
     "invalid_value"),
    ("repetition-penalty-huge", "POST", "/v1/chat/completions", chat(repetition_penalty=1e300), A, 400,
     "invalid_value"),
    ("repetition-penalty-tiny", "POST", "/v1/chat/completions", chat(repetition_penalty=1e-300), A, 400,
     "invalid_value"),
    ("seed-over-64-bits", "POST", "/v1/chat/completions", chat(seed=2**64), A, 400, "invalid_value"),
    ("stop-token-id-huge", "POST", "/v1/chat/completions", chat(stop_token_ids=[2**40]), A, 400, "invalid_value"),
    ("stop-string-too-long", "POST", "/v1/chat/completions", chat(stop=["x" * 257]), A, 400, "invalid_value"),
    ("logit-bias", "POST", "/v1/chat/completions", chat(logit_bias={"5": 100}), A, 400, "unsupported_parameter"),
    ("response-format-type", "POST", "/v1/chat/completions", chat(response_format={"type": "yaml"}), A, 400,
     "invalid_value"),
    ("response-format-bad-schema", "POST", "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}}),
     A, 400, "invalid_value"),
    ("response-format-schema-not-object", "POST", "/v1/completions", {"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, A, 400, "invalid_value"),
    ("tools-on-completions", "POST", "/v1/completions",
     {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, A, 400, "unsupported_parameter"),
    ("tools-same-name", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), A, 400, "invalid_value"),
    ("tool-choice-without-tools", "POST", "/v1/chat/completions", chat(tool_choice="required"), A, 400,
     "invalid_value"),
    ("best-of", "POST", "/v1/completions", {"prompt": "hi", "best_of": 3}, A, 400, "unsupported_parameter"),
    ("session-id-with-suffix", "GET", "/v1/sessions/abc:messages", None, A, 404, "session_not_found"),
    ("session-id-path-chars", "POST", "/v1/sessions/a.b/cancel", None, A, 404, "session_not_found"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_http_input(server: LiveServer, case: tuple[Any, ...]) -> None:
    _id, method, path, body, headers, status, code = case
    _check(server, lambda: _send(server, method, path, body, headers), status, code)


@pytest.mark.parametrize("who", ["foreign", "expired"])
@pytest.mark.parametrize("action", ["get", "message", "delete", "stream"])
def test_foreign_or_expired_session(server: LiveServer, foreign_sid: str, expired_sid: str, who: str,
                                    action: str) -> None:
    sid, headers = (foreign_sid, B) if who == "foreign" else (expired_sid, A)
    method, path, body = {"get": ("GET", f"/v1/sessions/{sid}", None),
                          "message": ("POST", f"/v1/sessions/{sid}/messages", {"content": "hi"}),
                          "delete": ("DELETE", f"/v1/sessions/{sid}", None),
                          "stream": ("GET", f"/v1/sessions/{sid}/stream", None)}[action]
    _check(server, lambda: _send(server, method, path, body, headers), 404, "session_not_found")
    if who == "foreign":  # still there for its owner
        assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=A).status_code == 200


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"content": ""}, 400, "invalid_value"),
    ({"content": "   "}, 400, "invalid_value"),
    ({"content": "x" * 2500}, 413, "message_too_large"),
    ({"content": LONG[:1900]}, 400, "context_length_exceeded"),
    ({"content": "hi", "temperature": -1}, 400, "invalid_value"),
    ({"content": "hi", "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ({}, 400, "invalid_value"),
    ({"role": "tool", "tool_call_id": "call_none", "content": "21 C"}, 400, "invalid_value"),
    ({"role": "tool", "content": "21 C"}, 400, "invalid_value"),
    ({"content": "hi", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
     400, "invalid_value"),
])
def test_bad_session_message_stores_nothing(server: LiveServer, foreign_sid: str, body: dict[str, Any],
                                            status: int, code: str) -> None:
    _check(server, lambda: _send(server, "POST", f"/v1/sessions/{foreign_sid}/messages", body, A), status, code)
    view = httpx.get(f"{server.url}/v1/sessions/{foreign_sid}", headers=A).json()
    assert view["messages"] == [] and view["turns"] == 0 and view["busy"] is False


def _send(server: LiveServer, method: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    kw: dict[str, Any] = {"headers": {**headers}}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"]["content-type"] = "application/json"
    elif body is not None:
        kw["json"] = body
    return httpx.request(method, server.url + path, timeout=30, **kw)


def _check(server: LiveServer, do: Any, status: int, code: str | None) -> None:
    r_before = server.redis.dbsize()  # type: ignore[attr-defined]
    free_before = server.engine.stats().kv_blocks_free  # type: ignore[attr-defined]
    resp = do()
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    assert server.redis.dbsize() == r_before  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while server.engine.stats().kv_blocks_free != free_before and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert server.engine.stats().kv_blocks_free == free_before  # type: ignore[attr-defined]
    assert server.engine.stats().requests_running == 0  # type: ignore[attr-defined]


# -- WebSocket ---------------------------------------------------------------------------------------
def test_ws_bad_frames(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws", subprotocols=["chatsvc", f"chatsvc.key.{KEY_A}"],  # type: ignore[list-item]
                 max_size=None) as ws:
        assert ws.subprotocol == "chatsvc"
        for frame, code in ((b"\x01\x02", "binary_frame"), ("y" * 2000, "frame_too_large"), ("{", "invalid_json"),
                            (json.dumps({"type": "message", "content": "x"}), "no_session"),
                            (json.dumps({"type": "hello", "session_id": "nope"}), "session_not_found")):
            ws.send(frame)
            got = json.loads(ws.recv())
            assert got == {"type": "error", "code": code, "message": got["message"]}
        ws.send(json.dumps({"type": "hello"}))
        session = json.loads(ws.recv())
        assert session["type"] == "session"
        ws.send(json.dumps({"type": "message", "content": ""}))
        assert json.loads(ws.recv())["code"] == "invalid_value"
        ws.send(json.dumps({"type": "message", "content": LONG[:960]}))
        assert json.loads(ws.recv())["code"] == "context_length_exceeded"
        assert httpx.get(f"{server.url}/v1/sessions/{session['id']}", headers=A).json()["messages"] == []


def test_ws_keys(server: LiveServer) -> None:
    # No key at the handshake: the hello must carry it.
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "message", "content": "x"}))
        assert json.loads(ws.recv())["code"] == "missing_api_key"
        ws.send(json.dumps({"type": "hello", "api_key": "wrong"}))
        assert json.loads(ws.recv())["code"] == "invalid_api_key"
        ws.send(json.dumps({"type": "hello", "api_key": KEY_B}))
        assert json.loads(ws.recv())["type"] == "session"
    for kw in ({"subprotocols": ["chatsvc.key.wrong"]}, {"additional_headers": {"Authorization": "Bearer no"}},
               {"origin": "https://evil.example"}):
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            connect(server.ws_url + "/v1/ws", **kw)  # type: ignore[arg-type]
        assert e.value.response.status_code == 403


def test_ws_foreign_session(server: LiveServer, foreign_sid: str) -> None:
    with connect(server.ws_url + "/v1/ws", additional_headers=B) as ws:
        ws.send(json.dumps({"type": "hello", "session_id": foreign_sid}))
        assert json.loads(ws.recv())["code"] == "session_not_found"


def test_public_routes_need_no_key(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


# -- capacity and Redis outages -------------------------------------------------------------------------
async def test_full_queue_is_429_with_retry_after(redis_proc, tmp_path: Path) -> None:  # noqa: F811
    engine = tiny_engine(tmp_path, max_num_seqs=1, max_waiting=1)
    app = create_app(engine, Store.from_url(redis_proc.url), Settings(max_pinned_fraction=1.0))
    with LiveServer(app) as live:
        # The default personas' pins queue in the engine at start-up: on a loaded machine one would
        # still hold the one waiting slot and every request below would be refused.
        await asyncio.to_thread(wait_personas_pinned, app)
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
            body = chat(max_tokens=200, ignore_eos=True)
            rs = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(12)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 1 and 429 in codes
        limited = next(r for r in rs if r.status_code == 429)
        assert limited.headers["retry-after"].isdigit() and limited.json()["error"]["code"] == "queue_full"


def test_redis_unreachable(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    app = create_app(engine, Store.from_url(f"redis://127.0.0.1:{free_port()}/0"), Settings())
    with LiveServer(app) as live:
        for method, path, body in (("GET", "/v1/sessions", None), ("POST", "/v1/sessions", {}),
                                   ("GET", "/v1/personas", None), ("GET", "/v1/sessions/abc", None)):
            r = httpx.request(method, live.url + path, json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable", (path, r.text)
        assert httpx.get(live.url + "/ready").status_code == 503
        assert httpx.get(live.url + "/health").status_code == 200
        ok = httpx.post(live.url + "/v1/chat/completions", json=chat(), timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        with connect(live.ws_url + "/v1/ws") as ws:
            ws.send(json.dumps({"type": "hello"}))
            assert json.loads(ws.recv())["code"] == "redis_unavailable"


@pytest.fixture(scope="module")
def replied_sid(server: LiveServer) -> str:
    """A session with one finished turn: its messages list and reply stream exist in Redis."""
    sid = str(httpx.post(server.url + "/v1/sessions", json={}, headers=A).json()["id"])
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": "hi", "max_tokens": 3}, headers=A,
                   timeout=60)
    assert r.status_code == 200 and "done" in r.text
    # The engine frees the reply's blocks a moment after its last event: settle before tables measure them.
    deadline, last = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        stats = server.engine.stats()  # type: ignore[attr-defined]
        if stats.requests_running == 0 and stats.kv_blocks_free == last:
            break
        last = stats.kv_blocks_free
        time.sleep(0.3)
    return sid


@pytest.mark.parametrize("suffix", [":messages", ":lock", ":turn:1"])
def test_session_id_with_key_suffix_is_404(server: LiveServer, replied_sid: str, suffix: str) -> None:
    """``<id>:messages`` names another Redis key of the session: a 404, not a false store outage."""
    for method, path in (("GET", ""), ("GET", "/stream"), ("POST", "/cancel"), ("DELETE", "")):
        url = f"/v1/sessions/{replied_sid}{suffix}{path}"
        _check(server, lambda m=method, u=url: _send(server, m, u, None, A), 404,
               "session_not_found")


@pytest.mark.parametrize("event_id", ["garbage", "1:abc", "x:1-0", "1:1-0-0", "1" * 40, "-1"])
def test_malformed_event_id_is_400(server: LiveServer, replied_sid: str, event_id: str) -> None:
    base = f"/v1/sessions/{replied_sid}"
    _check(server, lambda: _send(server, "GET", f"{base}/stream?after={event_id}", None, A), 400, "invalid_value")
    _check(server, lambda: _send(server, "GET", f"{base}/stream", None, {**A, "Last-Event-ID": event_id}), 400,
           "invalid_value")
    _check(server, lambda: _send(server, "POST", f"{base}/messages", {"content": "x"},
                                 {**A, "Last-Event-ID": event_id}), 400, "invalid_value")
