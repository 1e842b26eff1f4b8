"""Keys never leak, and browsers on other sites cannot drive the server: no keys in URLs or echoed
subprotocols, Origin and Host checked, JSON bodies need their content type, owner ids are keyed HMACs."""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
import websockets
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from timing import scaled
from websockets.sync.client import connect

from chatsvc.app import create_app
from chatsvc.cli import add_serve_arguments, settings_from_args
from chatsvc.keyring import IDENTITY_KEY, LEGACY_SECRET_KEY, fingerprint
from chatsvc.settings import Settings
from chatsvc.store import Store, session_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
KEY = "key-secret-a"
A = {"Authorization": f"Bearer {KEY}"}


def tiny_engine(tmp: Path) -> Any:
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(model=str(make_tiny_model_dir(tmp)), num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


def serve(redis_url: str, tiny_dir: Path, **kw: Any) -> LiveServer:
    app = create_app(tiny_engine(tiny_dir), Store.from_url(redis_url, 3600, 60), Settings(api_keys=(KEY,), **kw))
    return LiveServer(app)


@pytest.fixture(scope="module")
def server(redis_proc, tiny_dir: Path) -> Iterator[LiveServer]:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    with serve(redis_proc.url, tiny_dir, metrics_key="metrics-token") as live:
        live.redis = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)  # type: ignore[attr-defined]
        live.gw = live.server.config.app.state.gateway  # type: ignore[attr-defined]
        yield live


def test_api_key_in_url_is_refused(server: LiveServer) -> None:
    for path in ("/v1/sessions", "/v1/kv", "/v1/personas"):
        r = httpx.get(f"{server.url}{path}?api_key={KEY}")
        assert r.status_code == 400 and r.json()["error"]["code"] == "api_key_in_url", (path, r.text)
        assert KEY not in r.text


def test_ws_never_echoes_a_key_protocol(server: LiveServer) -> None:
    with connect(server.ws_url + "/v1/ws", subprotocols=[f"chatsvc.key.{KEY}"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol is None
        assert all(KEY not in v for _, v in ws.response.headers.raw_items())
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session"  # the key authenticated the socket
    with connect(server.ws_url + "/v1/ws", subprotocols=["chatsvc", f"chatsvc.key.{KEY}"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "chatsvc"
        assert all(KEY not in v for _, v in ws.response.headers.raw_items())


def test_a_key_traded_for_a_short_lived_token(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/auth/token", headers=A)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    body = r.json()
    token = body["token"]
    assert KEY not in token and body["expires_in"] == 900 and body["token_type"] == "bearer"
    bearer = {"Authorization": f"Bearer {token}"}
    sid = httpx.post(server.url + "/v1/sessions", json={}, headers=bearer).json()["id"]
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=A).status_code == 200  # the key's own session
    # The browser's ways: the WebSocket hello, or a subprotocol (never echoed).
    with connect(server.ws_url + "/v1/ws", subprotocols=["chatsvc", f"chatsvc.key.{token}"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "chatsvc" and all(token not in v for _, v in ws.response.headers.raw_items())
        ws.send(json.dumps({"type": "hello", "session_id": sid}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello", "api_key": token, "session_id": sid}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
    # A token cannot mint tokens (it would never expire), a shorter life may be asked, a longer one not.
    assert httpx.post(server.url + "/v1/auth/token", headers=bearer).status_code == 401
    short = httpx.post(server.url + "/v1/auth/token", headers=A, json={"ttl_s": 10}).json()
    assert short["expires_in"] == 10
    r = httpx.post(server.url + "/v1/auth/token", headers=A, json={"ttl_s": 901})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s"
    # Tampered or expired: 401.
    tampered = token[:-1] + ("0" if token[-1] != "0" else "1")
    r = httpx.get(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {tampered}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    expired, _ = server.gw.auth.issue_token(server.gw.auth.check_key(KEY), 10, now=0.0)  # type: ignore[attr-defined]
    r = httpx.get(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {expired}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "token_expired"
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello", "api_key": expired}))
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "error" and frame["code"] == "token_expired"


def test_ws_origin_defaults_to_the_servers_own(server: LiveServer) -> None:
    for origin in ("http://localhost:5173", "http://127.0.0.1:1", "https://evil.example"):
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            connect(server.ws_url + "/v1/ws", origin=origin, additional_headers=A)  # type: ignore[arg-type]
        assert e.value.response.status_code == 403, origin
    with connect(server.ws_url + "/v1/ws", origin=server.url, additional_headers=A) as ws:  # type: ignore[arg-type]
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session"


def test_host_allow_list(server: LiveServer) -> None:
    """DNS rebinding: a page on evil.example resolving to this server sends Host: evil.example."""
    evil = {**A, "Host": "evil.example"}
    for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/"), ("GET", "/v1/kv")):
        r = httpx.request(method, server.url + path, headers=evil)
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", path
    # Probes address the server by IP; these routes answer any Host.
    assert httpx.get(server.url + "/health", headers={"Host": "10.0.0.7:8000"}).status_code == 200
    assert httpx.get(server.url + "/ready", headers={"Host": "10.0.0.7:8000"}).status_code in (200, 503)
    assert _ws_handshake_status(server, "evil.example") == 403
    assert _ws_handshake_status(server, f"127.0.0.1:{server.port}") == 101
    assert httpx.get(server.url + "/v1/sessions", headers={**A, "Host": f"localhost:{server.port}"}).status_code == 200


def _ws_handshake_status(server: LiveServer, host: str) -> int:
    """The status of a WebSocket handshake sent with this Host (client libraries set Host themselves)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall((f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                      f"Authorization: Bearer {KEY}\r\n\r\n").encode())
        return int(sock.recv(1024).split(b" ", 2)[1])


def test_json_posts_need_the_json_content_type(server: LiveServer) -> None:
    before = server.redis.dbsize()  # type: ignore[attr-defined]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {**A, **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", ctype
        r = httpx.post(server.url + "/v1/sessions", content=b'{"title": "t"}', headers=headers)
        assert r.status_code == 415, ctype
    assert server.redis.dbsize() == before  # type: ignore[attr-defined]
    ok = httpx.post(server.url + "/v1/chat/completions", content=body,
                    headers={**A, "Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200


def test_state_changing_routes_check_origin(server: LiveServer) -> None:
    before = server.redis.dbsize()  # type: ignore[attr-defined]
    evil = {**A, "Origin": "https://evil.example"}
    assert httpx.post(server.url + "/v1/sessions", json={}, headers=evil).status_code == 403
    assert httpx.put(server.url + "/v1/personas/x", json={"system_prompt": "p"}, headers=evil).status_code == 403
    assert server.redis.dbsize() == before  # type: ignore[attr-defined]
    assert httpx.get(server.url + "/v1/sessions", headers=evil).status_code == 200  # reads: CORS protects them
    r = httpx.post(server.url + "/v1/sessions", json={}, headers={**A, "Origin": server.url})
    assert r.status_code == 201


def test_metrics_key(server: LiveServer) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=A).status_code == 401
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer metrics-token"})
    assert r.status_code == 200 and "chatsvc_kv_blocks_total" in r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_owner_ids_are_keyed_hmacs_that_survive_restarts(redis_proc, tiny_dir: Path) -> None:  # noqa: F811
    r = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)
    r.flushdb()
    with serve(redis_proc.url, tiny_dir) as live:
        sid = httpx.post(live.url + "/v1/sessions", json={}, headers=A).json()["id"]
    secret = r.get(LEGACY_SECRET_KEY)
    owner = r.hget(session_key(sid), "owner")
    assert secret and len(secret) == 64 and owner
    assert KEY not in owner and hashlib.sha256(KEY.encode()).hexdigest()[:24] not in owner
    with serve(redis_proc.url, tiny_dir) as live:  # a second start reuses the secret: the session is still ours
        assert httpx.get(f"{live.url}/v1/sessions/{sid}", headers=A).status_code == 200
    assert r.get(LEGACY_SECRET_KEY) == secret


def _wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + scaled(15)
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_secret_rotation_keeps_owners_and_drops_the_old_tokens(redis_proc, tiny_dir: Path,  # noqa: F811
                                                                tmp_path: Path) -> None:
    """The secret file is re-read while the gateway runs: a new secret accepted beside the old one, then
    the old one dropped. Sessions keep their owner throughout (and after a restart with the new secret
    alone), tokens of the old secret work until it is dropped, and Redis never holds a secret in the clear."""
    old, new = "old-" + "o" * 40, "new-" + "n" * 40
    r = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)
    r.flushdb()
    path = tmp_path / "secrets"
    path.write_text(old + "\n")

    def wrapped_for() -> set[str]:
        return set(r.hkeys(IDENTITY_KEY))

    def token(live: LiveServer) -> dict[str, str]:
        got = httpx.post(live.url + "/v1/auth/token", headers=A)
        assert got.status_code == 200, got.text
        return {"Authorization": f"Bearer {got.json()['token']}"}

    def listed(live: LiveServer, headers: dict[str, str]) -> httpx.Response:
        return httpx.get(live.url + "/v1/sessions", headers=headers)

    with serve(redis_proc.url, tiny_dir, secret_file=path, secret_reload_interval_s=0.1) as live:
        sid = httpx.post(live.url + "/v1/sessions", json={}, headers=A).json()["id"]
        old_token = token(live)
        path.write_text(new + "\n")  # the new secret alone cannot open the identity key: the keys in use stay
        time.sleep(scaled(0.5))
        assert listed(live, old_token).status_code == 200 and wrapped_for() == {fingerprint(old.encode())}
        path.write_text(f"{new}\n{old}\n")  # step 1: the new secret accepted (and signing) beside the old
        _wait_for(lambda: wrapped_for() == {fingerprint(old.encode()), fingerprint(new.encode())}, "re-wrapped")
        new_token = token(live)
        for headers in (A, old_token, new_token):
            got = listed(live, headers)
            assert got.status_code == 200 and [s["id"] for s in got.json()["data"]] == [sid], got.text
        path.write_text(new + "\n")  # step 2: the old secret dropped
        _wait_for(lambda: wrapped_for() == {fingerprint(new.encode())}, "old copy deleted")
        # The reload deletes the old copy in Redis, then swaps the gateway's keys: the refusal follows it.
        _wait_for(lambda: listed(live, old_token).status_code != 200, "old token refused")
        got = listed(live, old_token)
        assert (got.status_code, got.json()["error"]["code"]) == (401, "invalid_api_key")
        assert [s["id"] for s in listed(live, new_token).json()["data"]] == [sid]
    with serve(redis_proc.url, tiny_dir, secret_file=path) as live:  # a restart with the new secret alone
        assert [s["id"] for s in listed(live, A).json()["data"]] == [sid]
    dump = []  # every key, string value and hash field and value
    for key in r.scan_iter():
        dump.append(key)
        if r.type(key) == "string":
            dump.append(r.get(key))
        elif r.type(key) == "hash":
            dump.extend(x for kv in r.hgetall(key).items() for x in kv)
    assert not [x for x in dump if old in x or new in x] and not r.exists(LEGACY_SECRET_KEY)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_cli_refuses_public_listen_without_keys(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("CHATSVC_API_KEYS", raising=False)
    monkeypatch.delenv("CHATSVC_ADMIN_KEYS", raising=False)
    with pytest.raises(SystemExit, match="without API keys"):
        settings_from_args(_args("--host", "0.0.0.0"))
    assert settings_from_args(_args("--host", "127.0.0.1")).api_keys == ()
    assert settings_from_args(_args("--host", "0.0.0.0", "--api-key", "k")).api_keys == ("k",)
    with caplog.at_level("WARNING"):
        settings_from_args(_args("--host", "0.0.0.0", "--insecure-no-auth"))
    assert "WITHOUT API KEYS" in caplog.text


def test_cli_origins_replace_and_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATSVC_API_KEYS", raising=False)
    monkeypatch.setenv("CHATSVC_ADMIN_KEYS", "adm1, adm2")
    s = settings_from_args(_args("--allowed-origins", "https://app.example", "--host", "10.1.2.3",
                                 "--api-key", "k", "--max-pinned-fraction", "0.1"))
    assert s.allowed_origins == ("https://app.example",)
    assert "10.1.2.3" in s.allowed_hosts and "localhost" in s.allowed_hosts
    assert s.admin_keys == ("adm1", "adm2") and s.max_pinned_fraction == 0.1
    assert settings_from_args(_args("--allowed-hosts", "chat.example.com")).allowed_hosts == ("chat.example.com",)
    assert settings_from_args(_args()).allowed_origins == ()
    q = settings_from_args(_args("--max-streams-per-key", "3", "--max-sessions-per-minute", "5",
                                 "--max-sockets-per-key", "7"))
    assert (q.max_streams_per_key, q.max_sessions_per_minute, q.max_sockets_per_key) == (3, 5, 7)
