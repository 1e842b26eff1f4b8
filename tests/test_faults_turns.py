"""Turns survive what breaks them: ``kill -9`` of the gateway mid-reply (a real ``chatsvc serve`` on a
real Redis, restarted on the same port), a browser reload (WebSocket close 1001), a repeated resume,
and requests that arrive between a message and its first token."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, engine_fixture, fake_gateway, wait_for  # noqa: F401
from gateway_fixtures import LiveServer, default_model_path, free_port, redis_proc  # noqa: F401
from serve_process import PersistentRedis, Serve, assert_alternating, sse_json
from websockets.sync.client import ClientConnection, connect

from chatsvc.store import session_key
from chatsvc.store.keys import stream_key

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
GRACE_S = 1.5


def model_for(kind: str, tmp: Path) -> tuple[str, list[str], int]:
    """(model path, extra serve args, max_tokens of a reply long enough to be killed in the middle)."""
    if kind == "tiny":
        from tiny_model import make_tiny_model_dir

        model = make_tiny_model_dir(tmp / "tiny", max_position_embeddings=4096)
        return str(model), ["--max-model-len", "4096", "--num-kv-blocks", "320"], 3000
    return default_model_path(), ["--max-model-len", "1024", "--num-kv-blocks", "96"], 700


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["tiny", "real"])
def test_kill_9_mid_reply_then_restart_recovers_the_turn(kind: str, tmp_path: Path) -> None:
    model, extra, max_tokens = model_for(kind, tmp_path)
    (tmp_path / "redis").mkdir()
    red = PersistentRedis(free_port(), tmp_path / "redis").start()
    port = free_port()
    first = Serve(model, port, red.url, *extra)
    second = Serve(model, port, red.url, *extra)
    try:
        first.start()
        base = first.url
        sid = httpx.post(base + "/v1/sessions", json={}, timeout=10).json()["id"]
        seen: list[str] = []
        msg = {"content": "Tell me a very long story.", "max_tokens": max_tokens, "ignore_eos": True,
               "temperature": 0}
        with contextlib.suppress(httpx.HTTPError), \
                httpx.stream("POST", f"{base}/v1/sessions/{sid}/messages", json=msg, timeout=60) as r:
            assert r.status_code == 200
            for ev in sse_json(r):
                assert ev["type"] == "delta", ev  # the reply must still be running when it is killed
                seen.append(ev["text"])
                if len(seen) == 5:
                    first.kill9()
                    break
        assert len(seen) == 5

        second.start()  # same port, same Redis: the same instance name, a new nonce
        view = httpx.get(f"{base}/v1/sessions/{sid}", timeout=10).json()
        assert view["busy"] is False
        msgs = view["messages"]
        assert_alternating(msgs)
        assert msgs[1]["finish_reason"] == "interrupted"
        assert msgs[1]["content"].startswith("".join(seen)) and msgs[1]["tokens"] >= 5
        # A client resuming the killed reply hears that it ended.
        with httpx.stream("GET", f"{base}/v1/sessions/{sid}/stream", timeout=30) as r:
            ended = list(sse_json(r))[-1]
        assert ended["type"] == "done" and ended["finish_reason"] == "interrupted"

        # The session takes a new message at once (no 409) and its history stays well-formed.
        with httpx.stream("POST", f"{base}/v1/sessions/{sid}/messages", json={"content": "And then?", "max_tokens": 4},
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            done = list(sse_json(r))[-1]
        assert done["type"] == "done" and done["finish_reason"] in ("stop", "length")
        msgs = httpx.get(f"{base}/v1/sessions/{sid}", timeout=10).json()["messages"]
        assert_alternating(msgs)
        assert len(msgs) == 4 and msgs[3]["finish_reason"] == done["finish_reason"]
        assert not red.client().exists(session_key(sid) + ":lock")
    finally:
        first.kill9()
        second.stop()
        red.kill()


# -- WebSocket and early requests, over the fake engine (fast) and a real Redis ----------------------------
@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok"), abort_grace_s=GRACE_S) as live:
        yield live


def recv(ws: ClientConnection, timeout: float = 10) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=timeout))  # type: ignore[no-any-return]


def ask(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    ws.send(json.dumps(frame))
    return recv(ws)


@pytest.mark.timeout(60)
def test_a_turn_is_busy_and_cancellable_before_its_first_token(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 3.0  # the first token is 3 s away
    with connect(server.ws_url + "/v1/ws") as ws:
        sid = ask(ws, {"type": "hello"})["id"]
        ws.send(json.dumps({"type": "message", "content": "slow start", "max_tokens": 3}))
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["busy"] is True
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/cancel", timeout=5)
        assert r.json()["cancelled"] is True
        done = recv(ws)
        assert time.monotonic() - t0 < 2.0
    assert done["type"] == "done" and done["finish_reason"] == "abort"
    assert list(engine.submitted)[-1] in engine.aborted
    msgs = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["messages"]
    assert [(m["role"], m.get("finish_reason")) for m in msgs] == [("user", None), ("assistant", "abort")]
    # DELETE right after a message also works at once (cancel, then the session is gone).
    engine.step_s = 3.0
    with connect(server.ws_url + "/v1/ws") as ws:
        sid = ask(ws, {"type": "hello"})["id"]
        ws.send(json.dumps({"type": "message", "content": "slow start", "max_tokens": 3}))
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.delete(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["deleted"] is True
        assert recv(ws)["finish_reason"] == "abort" and time.monotonic() - t0 < 2.0
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).status_code == 404


@pytest.mark.timeout(60)
def test_close_1001_gets_the_grace_and_the_reply_resumes(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    with connect(server.ws_url + "/v1/ws") as ws:
        sid = ask(ws, {"type": "hello"})["id"]
        ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 80, "ignore_eos": True}))
        first = recv(ws)
        assert first["type"] == "delta"
        rid = list(engine.submitted)[-1]
        ws.close(code=1001, reason="page reload")  # what a browser sends on reload or navigation
    assert not wait_for(lambda: rid in engine.aborted, timeout=GRACE_S / 2)  # not aborted at once

    with connect(server.ws_url + "/v1/ws") as ws:
        assert ask(ws, {"type": "hello", "session_id": sid})["busy"] is True
        ws.send(json.dumps({"type": "resume", "after": first["id"]}))
        frames = [recv(ws)]
        while frames[-1]["type"] == "delta":
            frames.append(recv(ws))
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert rid not in engine.aborted
    assert first["text"] + "".join(f["text"] for f in frames[:-1]) == done["message"]["content"]


@pytest.mark.timeout(60)
def test_a_repeated_resume_on_the_same_socket_is_idempotent(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    with connect(server.ws_url + "/v1/ws") as ws:
        ask(ws, {"type": "hello"})
        ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 60, "ignore_eos": True}))
        frames = [recv(ws)]
        # The page (or a flaky client) asks to resume while it is already following: nothing is sent twice,
        # and the reply is not left reader-less (aborted after the grace) while it is being read.
        ws.send(json.dumps({"type": "resume"}))
        ws.send(json.dumps({"type": "resume", "after": frames[0]["id"]}))
        while frames[-1]["type"] == "delta":
            frames.append(recv(ws))
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    ids = [f["id"] for f in frames]
    assert len(ids) == len(set(ids)), "an event was sent twice"
    assert "".join(f["text"] for f in frames[:-1]) == done["message"]["content"]


@pytest.mark.timeout(60)
def test_a_ws_message_while_the_engine_restarts_is_an_error_frame(server: LiveServer, engine: FakeEngine) -> None:
    with connect(server.ws_url + "/v1/ws") as ws:
        sid = ask(ws, {"type": "hello"})["id"]
        engine._running = False  # what a restarting engine answers: EngineDeadError
        try:
            err = ask(ws, {"type": "message", "content": "hello?"})
        finally:
            engine._running = True
        assert err["type"] == "error" and err["code"] == "engine_unavailable"
        # The socket is still usable, and the refused turn left nothing behind.
        ws.send(json.dumps({"type": "message", "content": "again", "max_tokens": 3}))
        while (frame := recv(ws))["type"] == "delta":
            pass
        assert frame["type"] == "done"
    msgs = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["messages"]
    assert [(m["role"], m["content"]) for m in msgs][0] == ("user", "again") and len(msgs) == 2


@pytest.mark.timeout(60)
def test_the_keepalive_recovers_a_dead_instances_turn_and_refreshes_its_own_locks(
        server: LiveServer, engine: FakeEngine, redis_proc) -> None:  # noqa: F811
    import asyncio

    import redis as sync_redis

    from chatsvc.store import Store
    from chatsvc.turns import HEARTBEAT_S

    r = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)
    sid = httpx.post(f"{server.url}/v1/sessions", json={}, timeout=5).json()["id"]

    async def ghost_turn() -> None:  # another gateway took a turn and wrote part of its reply
        ghost = Store.from_url(redis_proc.url, instance="ghost:1")
        await ghost.heartbeat()
        assert await ghost.begin_turn(sid, {"role": "user", "content": "hi"}) == 1
        await ghost.append_events([(stream_key(sid, 1), json.dumps({"type": "delta", "text": "part", "tokens": 1}))])
        await ghost.close()

    asyncio.run(ghost_turn())
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["busy"] is True
    r.delete("chatsvc:instance:ghost:1")  # its heartbeat key expired: it is dead
    assert wait_for(lambda: not httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["busy"], 1.0)
    assert wait_for(lambda: len(httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["messages"]) == 2,
                    HEARTBEAT_S + 3)
    msgs = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=5).json()["messages"]
    assert (msgs[1]["content"], msgs[1]["finish_reason"]) == ("part", "interrupted")
    assert r.get(session_key(sid) + ":lock") is None

    # This instance's own running turn keeps its lock alive.
    engine.step_s = 0.05
    with connect(server.ws_url + "/v1/ws") as ws:
        ask(ws, {"type": "hello", "session_id": sid})
        ws.send(json.dumps({"type": "message", "content": "long", "max_tokens": 200, "ignore_eos": True}))
        assert recv(ws)["type"] == "delta"
        lock = session_key(sid) + ":lock"
        r.pexpire(lock, 1500)
        time.sleep(HEARTBEAT_S + 1)
        assert r.pttl(lock) > 10_000
        ws.send(json.dumps({"type": "cancel"}))
        while recv(ws)["type"] == "delta":
            pass
    assert r.get(lock) is None
