"""Redis going away mid-reply, under a real ``chatsvc serve`` (tiny model): paused for writes longer than
the client's socket timeout, killed then restarted, and refusing writes (out of memory, or short of replicas as
an old master during a failover) when the finished reply is stored. The reply is kept in memory and stored exactly once when Redis is back, no lock is left behind, and
the OpenAI routes (no Redis) keep serving."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_fixtures import free_port
from serve_process import LongReply, PersistentRedis, Serve, assert_alternating, sse_json

from chatsvc.store import session_key

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
MAX_TOKENS = 3500  # long enough that the reply is still running when Redis goes away (1500 once ended first)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, PersistentRedis]]:
    from tiny_model import make_tiny_model_dir

    tmp = tmp_path_factory.mktemp("faults-redis")
    model = make_tiny_model_dir(tmp / "tiny", max_position_embeddings=4096)
    (tmp / "redis").mkdir()
    red = PersistentRedis(free_port(), tmp / "redis").start()
    srv = Serve(str(model), free_port(), red.url, "--max-model-len", "4096", "--num-kv-blocks", "320")
    try:
        srv.start()
        yield srv, red
    finally:
        srv.stop()
        red.kill()


def openai_serves(srv: Serve) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"


def reply_through_outage(srv: Serve, red: PersistentRedis, outage: Callable[[], None]) -> None:
    """Start a long session reply, run ``outage`` once it streams, then check the reply was stored once."""
    sid = httpx.post(srv.url + "/v1/sessions", json={}, timeout=10).json()["id"]
    reply = LongReply(srv.url, sid, MAX_TOKENS)
    reply.wait_streaming()
    outage()
    assert reply.still_streaming(), "the reply ended before Redis went away: nothing was tested"
    reply.join(150)
    events = reply.events
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert done["usage"]["completion_tokens"] == MAX_TOKENS  # it ran to the end, not cut by the outage
    msgs = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
    assert_alternating(msgs)
    assert len(msgs) == 2 and msgs[1] == done["message"]  # stored exactly once, the whole reply
    assert msgs[1]["tokens"] == MAX_TOKENS
    assert not red.client().exists(session_key(sid) + ":lock")
    view = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()
    assert view["busy"] is False
    with httpx.stream("POST", f"{srv.url}/v1/sessions/{sid}/messages", json={"content": "more", "max_tokens": 3},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert list(sse_json(r))[-1]["type"] == "done"
    assert_alternating(httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["messages"])


def test_redis_paused_for_writes_longer_than_the_socket_timeout(stack: tuple[Serve, PersistentRedis]) -> None:
    srv, red = stack

    def pause() -> None:
        red.client().execute_command("CLIENT", "PAUSE", 13_000, "WRITE")  # the gateway's timeout is 10 s
        t0 = time.monotonic()
        openai_serves(srv)
        assert time.monotonic() - t0 < 10  # served while Redis was still paused

    reply_through_outage(srv, red, pause)


def test_redis_killed_and_restarted_mid_reply(stack: tuple[Serve, PersistentRedis], tmp_path: Path) -> None:
    srv, red = stack

    def restart() -> None:
        red.kill()
        t0 = time.monotonic()
        openai_serves(srv)
        assert httpx.get(srv.url + "/ready", timeout=5).json()["redis"] is False
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        red.start()

    reply_through_outage(srv, red, restart)


def engine_idle(srv: Serve) -> bool:
    metrics = httpx.get(srv.url + "/metrics", timeout=5).text
    return "chatsvc_requests_running 0.0" in metrics.splitlines()


@pytest.mark.parametrize("refusal", ["out of memory", "no replicas"])
def test_redis_refusing_writes_when_the_finished_reply_is_stored(stack: tuple[Serve, PersistentRedis],
                                                                 refusal: str) -> None:
    srv, red = stack
    # OOM with every write over maxmemory; NOREPLICAS from a master with min-replicas-to-write and no replica.
    # Reads go on in both.
    setting, refusing, normal = (("maxmemory", 1, 0) if refusal == "out of memory"
                                 else ("min-replicas-to-write", 1, 0))

    def refuse_writes() -> None:
        client = red.client()
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set(setting, refusing)
        try:
            deadline = time.monotonic() + 150
            while not engine_idle(srv):  # the reply ends while Redis refuses its final writes
                assert time.monotonic() < deadline, "the reply never ended"
                time.sleep(0.2)
            time.sleep(3.0)  # its store is tried, and refused, for a while
        finally:
            client.config_set(setting, normal)

    reply_through_outage(srv, red, refuse_writes)
