"""Two gateways (``chatsvc serve --engine redis`` processes) and one ``chatsvc worker`` against one real Redis,
on the tiny model: a session turn started through one gateway is cancelled, or kept alive and then aborted by
the grace, through the other; a gateway killed with ``kill -9`` mid-reply hands the turn to the other, which
relays the rest to a client resuming with ``Last-Event-ID`` and stores it once. A clean WebSocket close by the
last reader, on the other gateway, aborts the turn at once. A turn whose worker sends nothing fails after the
progress deadline with the session unlocked and nothing stored. A gateway stalled past its lock while the other
took the turn over writes nothing more into the reply once it resumes (fencing).

The processes live for the whole module; the tests run in file order and the last one kills gateway A.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from gateway_fixtures import free_port, redis_proc  # noqa: F401
from scaleout_workers import WorkerProc, worker_output_written
from serve_process import Serve, assert_alternating
from timing import scaled
from websockets.sync.client import connect

from chatsvc.store.keys import lock_key, stream_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GRACE_S = 1.5
# Past the worker writer's retries (about 3 s), which the progress-deadline test outlasts; the module's other
# replies stream without a pause that long.
PROGRESS_TIMEOUT_S = 6.0
# A reply the tests abort: long enough to outlast moving its readers between gateways and the grace on any
# machine (3500 tokens of the tiny model ran out before the abort in a CI run on a 2-core Zen 5; attention's
# cost grows with the context, so 12000 take many times as long).
LONG_REPLY = 12000
WORKER_FLAGS = ("--engine", "thread", "--engine-threads", "1", "--dtype", "float32", "--attention-backend", "torch",
                "--num-kv-blocks", "1024", "--max-model-len", "16384", "--block-size", "16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=16384)


@pytest.fixture(scope="module")
def stack(redis_proc, tiny: Path) -> Iterator[tuple[Serve, Serve, WorkerProc]]:  # noqa: F811
    redis.Redis.from_url(redis_proc.url).flushdb()
    worker = WorkerProc(redis_proc.url, str(tiny), "w", *WORKER_FLAGS, ttl_s=6.0)
    gateways = [Serve(str(tiny), free_port(), redis_proc.url, "--engine", "redis", "--abort-grace", str(GRACE_S),
                      "--progress-timeout", str(scaled(PROGRESS_TIMEOUT_S))) for _ in range(2)]
    try:
        worker.wait_registered()
        for g in gateways:
            g.start()
        # A first turn pins the default persona on the worker: what is free at idle from then on.
        sid = session(gateways[1].url)
        httpx.post(f"{gateways[1].url}/v1/sessions/{sid}/messages", json=ask(sid, 4), timeout=120).read()
        wait_for(lambda: (beat := worker.beat()) is not None and bool(beat.pins)
                 and beat.stats.requests_running == 0)
        time.sleep(1.0)
        beat = worker.beat()
        assert beat is not None
        FREE_AT_IDLE[worker.id] = beat.free_blocks
        yield gateways[0], gateways[1], worker
    finally:
        for g in gateways:
            g.stop()
        worker.terminate()


def idle_and_free(w: WorkerProc) -> bool:
    """No request on the worker, and every block free but those of the persona it pinned (the warm-up's)."""
    beat = w.beat()
    assert beat is not None
    return beat.stats.requests_running == 0 and beat.free_blocks == FREE_AT_IDLE[w.id]


FREE_AT_IDLE: dict[str, int] = {}


def wait_for(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def session(base: str) -> str:
    return str(httpx.post(base + "/v1/sessions", json={}, timeout=10).json()["id"])


class SSE:
    """An open SSE response read one event at a time: (id, event)."""

    def __init__(self, client: httpx.Client, method: str, url: str, **kwargs: Any) -> None:
        self.cm = client.stream(method, url, timeout=120, **kwargs)
        self.r = self.cm.__enter__()
        assert self.r.status_code == 200, self.r.read()
        self.lines = self.r.iter_lines()

    def next(self) -> tuple[str, dict[str, Any]]:
        eid = ""
        for line in self.lines:
            if line.startswith("id:"):
                eid = line[3:].strip()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                return eid, json.loads(line[5:])
        raise AssertionError("the stream ended without an event")

    def rest(self) -> list[tuple[str, dict[str, Any]]]:
        out = [self.next()]
        while out[-1][1]["type"] not in ("done", "error"):
            out.append(self.next())
        return out

    def close(self) -> None:
        self.cm.__exit__(None, None, None)


def ask(sid: str, max_tokens: int) -> dict[str, Any]:
    return {"content": "Tell me everything.", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def stored(base: str, sid: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{base}/v1/sessions/{sid}", timeout=10).json()["messages"])


def test_cancel_through_the_other_gateway_aborts_on_the_worker(stack: tuple[Serve, Serve, WorkerProc]) -> None:
    a, b, worker = stack
    sid = session(a.url)
    with httpx.Client() as client:
        reply = SSE(client, "POST", f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, LONG_REPLY))
        assert reply.next()[1]["type"] == "delta"
        assert httpx.get(f"{b.url}/v1/sessions/{sid}", timeout=10).json()["busy"]
        cancelled = httpx.post(f"{b.url}/v1/sessions/{sid}/cancel", timeout=60).json()
        assert cancelled["cancelled"] is True
        done = reply.rest()[-1][1]
        reply.close()
    assert done["type"] == "done" and done["finish_reason"] == "abort", done
    assert done["usage"]["completion_tokens"] < LONG_REPLY
    messages = stored(b.url, sid)
    assert_alternating(messages)
    assert messages[-1]["finish_reason"] == "abort"
    wait_for(lambda: idle_and_free(worker))


def test_a_reader_on_the_other_gateway_holds_the_turn_through_the_grace(stack: tuple[Serve, Serve, WorkerProc]) -> None:
    a, b, worker = stack
    sid = session(a.url)
    with httpx.Client() as client:
        first = SSE(client, "POST", f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, LONG_REPLY))
        eid, ev = first.next()
        first.close()  # the last reader on A leaves: A's grace starts
        resumed = SSE(client, "GET", f"{b.url}/v1/sessions/{sid}/stream", headers={"Last-Event-ID": eid})
        resumed.next()
        time.sleep(GRACE_S * 2.5)  # A's grace passes while B holds a reader: the turn goes on
        assert resumed.next()[1]["type"] == "delta"
        assert idle_and_free(worker) is False
        resumed.close()  # the last reader anywhere leaves: after the grace, A aborts the turn
    wait_for(lambda: stored(b.url, sid)[-1]["role"] == "assistant")
    messages = stored(b.url, sid)
    assert_alternating(messages)
    assert messages[-1]["finish_reason"] == "abort" and messages[-1]["tokens"] < LONG_REPLY
    wait_for(lambda: idle_and_free(worker))


def test_a_clean_websocket_close_by_the_last_reader_elsewhere_aborts_at_once(
        stack: tuple[Serve, Serve, WorkerProc]) -> None:
    a, b, worker = stack
    sid = session(a.url)
    with httpx.Client() as client:
        first = SSE(client, "POST", f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, LONG_REPLY))
        eid, _ = first.next()
        first.close()  # A's grace starts; the reader moves to B
        # An unbounded queue: a bounded one stops reading once the deltas fill it, so the client would not
        # see the server's close frame and would wait out its close_timeout (10 s) on leaving the block.
        with connect(b.url.replace("http://", "ws://") + "/v1/ws", max_queue=None) as ws:
            ws.send(json.dumps({"type": "hello", "session_id": sid}))
            assert json.loads(ws.recv(timeout=30))["busy"] is True
            ws.send(json.dumps({"type": "resume", "after": eid}))
            assert json.loads(ws.recv(timeout=30))["type"] == "delta"
            time.sleep(GRACE_S * 1.5)  # past A's grace: B's reader holds the turn
            assert stored(b.url, sid)[-1]["role"] == "user"
        closed = time.monotonic()  # a clean close (1000) by the last reader: abort now, not after a grace
    wait_for(lambda: stored(b.url, sid)[-1]["role"] == "assistant")
    assert time.monotonic() - closed < GRACE_S
    messages = stored(b.url, sid)
    assert_alternating(messages)
    assert messages[-1]["finish_reason"] == "abort" and messages[-1]["tokens"] < LONG_REPLY
    wait_for(lambda: idle_and_free(worker))


def test_a_turn_whose_worker_sends_nothing_fails_after_the_progress_deadline_unlocked(
        stack: tuple[Serve, Serve, WorkerProc], redis_proc) -> None:  # noqa: F811
    a, b, worker = stack
    sid = session(a.url)
    worker_output_written(redis_proc.url, allowed=False)  # the worker runs the request; its output is lost
    try:
        started = time.monotonic()
        refused = httpx.post(f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, 8), timeout=scaled(120))
        waited = time.monotonic() - started
    finally:
        worker_output_written(redis_proc.url, allowed=True)
    # Not left waiting with the session locked: the one worker failed its deadline, and there is no other.
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable", refused.text
    assert waited >= PROGRESS_TIMEOUT_S
    view = httpx.get(f"{b.url}/v1/sessions/{sid}", timeout=10).json()
    assert view["busy"] is False and view["messages"] == []  # rolled back: nothing stored, nothing twice
    with httpx.Client() as client:
        reply = SSE(client, "POST", f"{b.url}/v1/sessions/{sid}/messages", json=ask(sid, 8))
        done = reply.rest()[-1][1]
        reply.close()
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 8
    assert_alternating(stored(a.url, sid))
    wait_for(lambda: idle_and_free(worker))


@pytest.mark.long  # a gateway stalled past its instance TTL (10 s) before the other takes its turn over
def test_a_gateway_that_stalled_past_its_lock_stops_relaying_once_it_resumes(
        stack: tuple[Serve, Serve, WorkerProc], redis_proc) -> None:  # noqa: F811
    a, b, worker = stack
    assert a.proc is not None
    client_r = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    sid = session(a.url)
    with httpx.Client() as client:
        reply = SSE(client, "POST", f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, LONG_REPLY))
        seen = [reply.next() for _ in range(3)]
        held = client_r.get(lock_key(sid))
        a.proc.send_signal(signal.SIGSTOP)  # A's loop stalls: its heartbeat and lock lapse, its request runs on
        try:
            resumed = SSE(client, "GET", f"{b.url}/v1/sessions/{sid}/stream", headers={"Last-Event-ID": seen[-1][0]})
            wait_for(lambda: client_r.get(lock_key(sid)) not in (None, held), scaled(60))  # B took the turn
            resumed.next()
        finally:
            a.proc.send_signal(signal.SIGCONT)
        time.sleep(3.0)  # A relays on from where it stalled: every write it tries now is fenced
        assert httpx.post(f"{b.url}/v1/sessions/{sid}/cancel", timeout=60).json()["cancelled"] is True
        rest = resumed.rest()
        resumed.close()
        reply.close()
    assert rest[-1][1]["type"] == "done" and rest[-1][1]["finish_reason"] == "abort"
    events = [json.loads(fields["e"]) for _id, fields in client_r.xrange(stream_key(sid, 1))]
    ends = [i for i, ev in enumerate(events) if ev["type"] in ("done", "error")]
    assert ends == [len(events) - 1], events[-3:]  # one end, nothing written after it
    done = events[-1]
    # No token twice: A wrote nothing into the reply after B took it over.
    assert sum(ev.get("tokens", 0) for ev in events[:-1]) == done["usage"]["completion_tokens"]
    messages = stored(b.url, sid)
    assert_alternating(messages)  # stored once, by B
    assert messages[-1]["content"] == done["message"]["content"]
    assert "lost its lock to another gateway" in a.output()
    wait_for(lambda: idle_and_free(worker))
    assert httpx.get(f"{a.url}/health", timeout=10).status_code == 200


@pytest.mark.long
def test_a_gateway_killed_mid_reply_hands_the_turn_to_the_other(stack: tuple[Serve, Serve, WorkerProc]) -> None:
    a, b, worker = stack
    reference_sid = session(b.url)
    with httpx.Client() as client:
        ref = SSE(client, "POST", f"{b.url}/v1/sessions/{reference_sid}/messages", json=ask("", 600))
        reference = ref.rest()[-1][1]
        ref.close()
        sid = session(a.url)
        reply = SSE(client, "POST", f"{a.url}/v1/sessions/{sid}/messages", json=ask(sid, 600))
        seen = [reply.next() for _ in range(3)]
        a.kill9()
        with pytest.raises(httpx.HTTPError):  # the dead gateway's stream breaks off
            while True:
                seen.append(reply.next())
        seen = [(eid, ev) for eid, ev in seen if eid]
        resumed = SSE(client, "GET", f"{b.url}/v1/sessions/{sid}/stream", headers={"Last-Event-ID": seen[-1][0]})
        rest = resumed.rest()
        resumed.close()
    done = rest[-1][1]
    assert done["type"] == "done", done
    text = "".join(ev.get("text", "") for _, ev in seen + rest[:-1])
    tokens = sum(ev.get("tokens", 0) for _, ev in seen + rest[:-1])
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 600 == tokens
    assert text == done["message"]["content"] == reference["message"]["content"]  # none twice, none missing
    messages = stored(b.url, sid)
    assert_alternating(messages)  # stored once
    assert messages[-1]["content"] == text and messages[-1]["finish_reason"] == "length"
    wait_for(lambda: idle_and_free(worker))
