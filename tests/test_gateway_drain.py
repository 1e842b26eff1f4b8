"""SIGTERM drains a real ``chatsvc serve`` process: a reply in flight finishes and is stored once, a new turn
meanwhile gets 503 with Retry-After, /health says draining, a reply still running at ``--drain-timeout`` is
stored once as interrupted, and the process exits 0. The tiny model (as the other process fault tests): the
drain is the gateway's and the same for any model, and the tiny one starts in seconds."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_fixtures import free_port, redis_proc  # noqa: F401
from serve_process import Serve
from timing import scaled

from chatsvc.store.keys import messages_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
DRAIN_S = 3.0  # on the reference machine: the short reply finishes well inside it, the long one cannot
# Tokens: still running when the drain times out, however far the limits scale (the tiny model writes a token
# in a few milliseconds: 3,500 could finish inside a drain scaled up on a busy machine).
LONG = 16_000


class Reply(threading.Thread):
    """One session turn read as it streams: ``started`` once its first delta is in; ``events`` all of them."""

    def __init__(self, url: str, sid: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.sid, self.max_tokens = url, sid, max_tokens
        self.started = threading.Event()
        self.events: list[dict[str, Any]] = []

    def run(self) -> None:
        body = {"content": "Tell me a long story about a lighthouse.", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/sessions/{self.sid}/messages", json=body,
                              timeout=scaled(120)) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(json.loads(line[5:]))
                        self.started.set()
        except httpx.HTTPError:
            pass  # the long reply's connection is cut at shutdown: what was stored is checked instead
        finally:
            self.started.set()


def stored(redis_url: str, sid: str) -> list[dict[str, Any]]:
    raw = redis.Redis.from_url(redis_url, decode_responses=True).lrange(messages_key(sid), 0, -1)
    return [json.loads(m) for m in raw]


def test_sigterm_drains_in_flight_turns_then_exits_0(redis_proc, tmp_path: Path) -> None:  # noqa: F811
    from tiny_model import make_tiny_model_dir

    redis.Redis.from_url(redis_proc.url).flushdb()
    model = make_tiny_model_dir(tmp_path, max_position_embeddings=16_384)
    srv = Serve(str(model), free_port(), redis_proc.url, "--max-model-len", "16384", "--num-kv-blocks", "1100",
                "--drain-timeout", str(scaled(DRAIN_S)))
    srv.start()
    try:
        sids = [httpx.post(srv.url + "/v1/sessions", json={"persona": "tutor"}).json()["id"] for _ in range(3)]
        short, long = Reply(srv.url, sids[0], 24), Reply(srv.url, sids[1], LONG)
        for reply in (short, long):
            reply.start()
            assert reply.started.wait(scaled(60)) and reply.events, srv.output()
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        health = httpx.get(srv.url + "/health")
        while health.json()["status"] != "draining":  # the signal is handled between two of the loop's steps
            health = httpx.get(srv.url + "/health")
        assert health.status_code == 200 and httpx.get(srv.url + "/ready").status_code == 503
        refused = [httpx.post(f"{srv.url}/v1/sessions/{sids[2]}/messages", json={"content": "hi"}),
                   httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})]
        for r in refused:
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "draining"
        short.join(scaled(60))
        assert short.events[-1]["type"] == "done" and short.events[-1]["finish_reason"] == "length"
        assert srv.proc.wait(scaled(DRAIN_S) + scaled(60)) == 0, srv.output()
    finally:
        srv.stop()
    done = [m for m in stored(redis_proc.url, sids[0]) if m["role"] == "assistant"]
    assert len(done) == 1 and done[0]["finish_reason"] == "length" and done[0]["tokens"] == 24
    cut = [m for m in stored(redis_proc.url, sids[1]) if m["role"] == "assistant"]
    assert len(cut) == 1 and cut[0]["finish_reason"] == "interrupted", cut
    assert 0 < cut[0]["tokens"] < LONG
    assert stored(redis_proc.url, sids[2]) == []  # the refused turn stored nothing
