"""SIGTERM drains a real ``chatsvc serve`` process: a reply in flight finishes and is stored once, a new turn
meanwhile gets 503 with Retry-After, /health says draining, a reply still running at ``--drain-timeout`` is
stored once as interrupted, and the process exits 0. Behind an engine worker (``--engine redis``) with a second
gateway on the same Redis, a reply still running at the drain timeout is handed to that gateway instead: its
client resumes it there and it is stored once, whole. The tiny model (as the other process fault tests): the
drain is the gateway's and the same for any model, and the tiny one starts in seconds."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_fixtures import free_port, redis_proc  # noqa: F401
from scaleout_workers import WorkerProc
from serve_process import Serve, assert_alternating
from timing import scaled

from chatsvc.store.keys import instance_key, messages_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
DRAIN_S = 3.0  # on the reference machine: the short reply finishes well inside it, the long one cannot
# Tokens: still running when the drain times out, however far the limits scale (the tiny model writes a token
# in a few milliseconds: 3,500 could finish inside a drain scaled up on a busy machine).
LONG = 16_000


class Reply(threading.Thread):
    """One session turn read as it streams: ``started`` once its first delta is in; ``events`` all of them, and
    ``last_id`` the id of the last one. With ``last_event_id`` it resumes the turn instead (GET its stream)."""

    def __init__(self, url: str, sid: str, max_tokens: int, last_event_id: str | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.sid, self.max_tokens, self.resume_after = url, sid, max_tokens, last_event_id
        self.started = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.last_id = ""

    def run(self) -> None:
        body = {"content": "Tell me a long story about a lighthouse.", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0}
        if self.resume_after is None:
            request = httpx.stream("POST", f"{self.url}/v1/sessions/{self.sid}/messages", json=body,
                                   timeout=scaled(120))
        else:
            request = httpx.stream("GET", f"{self.url}/v1/sessions/{self.sid}/stream", timeout=scaled(120),
                                   headers={"Last-Event-ID": self.resume_after})
        try:
            with request as r:
                for line in r.iter_lines():
                    if line.startswith("id:"):
                        self.last_id = line[3:].strip()
                    elif line.startswith("data:"):
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


# A reply that outlasts the drain timeout on any machine, as LONG above, and that the worker still finishes
# well inside the test's time limit.
HANDED_OFF = 12_000
WORKER_FLAGS = ("--engine", "thread", "--engine-threads", "1", "--dtype", "float32", "--attention-backend", "torch",
                "--num-kv-blocks", "1100", "--max-model-len", "16384", "--block-size", "16")


@pytest.mark.long  # two gateways, a worker, and a reply of 12,000 tokens generated to its end
def test_behind_workers_a_reply_running_at_the_drain_timeout_is_finished_by_another_gateway(
        redis_proc, tmp_path: Path) -> None:  # noqa: F811
    from tiny_model import make_tiny_model_dir

    client = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    client.flushdb()
    model = make_tiny_model_dir(tmp_path, max_position_embeddings=16_384)
    worker = WorkerProc(redis_proc.url, str(model), "w", *WORKER_FLAGS, ttl_s=6.0)
    a_port = free_port()
    a = Serve(str(model), a_port, redis_proc.url, "--engine", "redis", "--drain-timeout", str(scaled(DRAIN_S)))
    b = Serve(str(model), free_port(), redis_proc.url, "--engine", "redis")
    try:
        worker.wait_registered()
        a.start()
        b.start()
        sid = httpx.post(a.url + "/v1/sessions", json={}).json()["id"]
        on_a = Reply(a.url, sid, HANDED_OFF)
        on_a.start()
        assert on_a.started.wait(scaled(60)) and on_a.events, a.output()
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        # A relays until its drain times out, then until its shutdown closes the connection (or the end).
        on_a.join(scaled(DRAIN_S) + scaled(60))
        assert not on_a.is_alive() and a.proc.wait(scaled(60)) == 0, a.output()
        # A gave its liveness up itself: B did not wait for A's heartbeat to lapse to take the turn over.
        assert client.get(instance_key(f"{socket.gethostname()}:{a_port}")) is None
        events = list(on_a.events)
        if events[-1]["type"] != "done":
            on_b = Reply(b.url, sid, HANDED_OFF, last_event_id=on_a.last_id)
            on_b.start()
            on_b.join(scaled(240))
            events += on_b.events
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length", (done, a.output(), b.output())
        deltas = [ev for ev in events[:-1] if ev["type"] == "delta"]
        # Every delta once: none repeated across the hand-off, none missing.
        assert sum(ev["tokens"] for ev in deltas) == HANDED_OFF == done["usage"]["completion_tokens"]
        assert "".join(ev["text"] for ev in deltas) == done["message"]["content"]
        messages = httpx.get(f"{b.url}/v1/sessions/{sid}", timeout=10).json()["messages"]
        assert_alternating(messages)  # stored once
        assert messages[-1]["finish_reason"] == "length" and messages[-1]["tokens"] == HANDED_OFF
        assert messages[-1]["content"] == done["message"]["content"]
        # Finished by B after A handed it off, not by A inside its drain.
        assert "handed 1 running turns off" in a.output() and "took over turn" in b.output()
        deadline = time.monotonic() + scaled(30)
        while (beat := worker.beat()) is None or beat.stats.requests_running:  # nothing left running on it
            assert time.monotonic() < deadline, worker.output()
            time.sleep(0.1)
    finally:
        a.stop()
        b.stop()
        worker.terminate()
