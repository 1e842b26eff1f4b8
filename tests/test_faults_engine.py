"""Faults in the engine: a step that raises fails only its culprit (LLMEngine, AsyncEngine, ProcessEngine);
a cancelled caller does not kill the engine thread; a killed engine process is replaced (pins restored)
under a live gateway, a stuck one makes /ready 503, and restarts are bounded. Tiny model throughout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401
from tiny_model import make_tiny_model_dir

from engine.async_engine import AsyncEngine
from engine.engine import LLMEngine
from engine.engine_process import ProcessEngine
from engine.protocol import EngineDeadError, RequestDelta
from engine.request import SamplingParams

ENGINE_KW: dict[str, Any] = {"dtype": "float32", "attention_backend": "torch", "block_size": 16,
                             "num_kv_blocks": 64, "max_num_seqs": 8, "swap_space_mb": 0}
PROMPTS = ["Hello! How are you today?", "The quick brown fox", "what is the capital of France?",
           "0123456789", "I am a small language model"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-faults"), arch="llama")


def run_to_end(eng: LLMEngine, requests: dict[str, str]) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    """Greedy tokens of every request that finished, and the error of every request a step failed."""
    for rid, prompt in requests.items():
        eng.add_request(rid, GREEDY, prompt=prompt)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    failed: dict[str, BaseException] = {}
    for _ in range(200):
        if not eng.has_unfinished():
            break
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
        failed.update(eng.take_failures())
    assert not eng.has_unfinished(), "the engine livelocked"
    return {rid: t for rid, t in tokens.items() if rid not in failed}, failed


def assert_all_blocks_free(eng: LLMEngine) -> None:
    eng.block_manager.check_invariants()
    stats = eng.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.requests_running == 0 and stats.requests_waiting == 0


def test_a_step_that_raises_fails_only_the_requests_that_caused_it(tiny_dir: Path) -> None:
    reference, none_failed = run_to_end(LLMEngine.from_args(str(tiny_dir), **ENGINE_KW),
                                        {f"ok-{i}": p for i, p in enumerate(PROMPTS)})
    assert not none_failed
    eng = LLMEngine.from_args(str(tiny_dir), fault_request_prefix="bad-", **ENGINE_KW)
    # Culprits first, in the middle and last in the batch; the good ones share steps with them.
    mixed = {"bad-0": "culprit", **{f"ok-{i}": p for i, p in enumerate(PROMPTS[:3])}, "bad-1": "another",
             **{f"ok-{i}": p for i, p in enumerate(PROMPTS[3:], start=3)}}
    tokens, failed = run_to_end(eng, mixed)
    assert set(failed) == {"bad-0", "bad-1"}
    assert all("injected fault" in str(e) for e in failed.values())
    assert tokens == reference  # every other request: the same greedy tokens as without the culprits
    assert_all_blocks_free(eng)
    # A culprit alone fails once and is never retried: no livelock, nothing held.
    tokens, failed = run_to_end(eng, {"bad-alone": "x y z"})
    assert set(failed) == {"bad-alone"} and not tokens
    assert_all_blocks_free(eng)
    # Identical prompts in one step: the good twin took the culprit's prompt blocks from the prefix cache
    # before their KV existed, so it fails with it; none of those blocks stays cached, so the same prompt
    # later gets the same greedy tokens as on a fresh engine.
    twin_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    fresh, _ = run_to_end(LLMEngine.from_args(str(tiny_dir), **ENGINE_KW), {"twin": twin_prompt})
    tokens, failed = run_to_end(eng, {"bad-twin": twin_prompt, "ok-twin": twin_prompt})
    assert set(failed) == {"bad-twin", "ok-twin"} and "shared prompt blocks" in str(failed["ok-twin"])
    assert_all_blocks_free(eng)
    tokens, failed = run_to_end(eng, {"twin-again": twin_prompt})
    assert not failed and tokens["twin-again"] == fresh["twin"]
    assert_all_blocks_free(eng)
    # Without the hook nothing fails.
    tokens, failed = run_to_end(eng, {"ok-again": PROMPTS[0]})
    assert not failed and tokens["ok-again"] == reference["ok-0"]


async def collect(it: AsyncIterator[RequestDelta]) -> list[int]:
    return [t async for d in it for t in d.token_ids]


@pytest.mark.timeout(300)
async def test_async_engine_fails_the_culprit_alone_and_survives_cancelled_callers(tiny_dir: Path) -> None:
    reference, _ = run_to_end(LLMEngine.from_args(str(tiny_dir), **ENGINE_KW), {f"ok-{i}": p for i, p in enumerate(PROMPTS)})
    eng = AsyncEngine.from_args(str(tiny_dir), fault_request_prefix="bad-", **ENGINE_KW)
    await eng.start()
    try:
        streams = {f"ok-{i}": eng.generate(f"ok-{i}", GREEDY, prompt=p) for i, p in enumerate(PROMPTS)}
        bad = eng.generate("bad-0", GREEDY, prompt="culprit")
        results = await asyncio.gather(collect(bad), *(collect(s) for s in streams.values()),
                                       return_exceptions=True)
        assert isinstance(results[0], RuntimeError) and "injected fault" in str(results[0])
        assert dict(zip(streams, results[1:], strict=True)) == reference

        # A caller that gives up before the core replies cancels its future; the reply that comes later
        # finds it done and is dropped, and the core and the client go on.
        task = asyncio.create_task(eng.abort("no-such-request"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert eng.is_running and eng._thread is not None and eng._thread.is_alive()
        assert await collect(eng.generate("after", GREEDY, prompt=PROMPTS[0])) == reference["ok-0"]
        assert eng.engine.stats().kv_blocks_free == eng.engine.stats().kv_blocks_total
        assert eng.stats().last_step_age_s < 5
    finally:
        await eng.stop()


async def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_process_engine_isolates_a_failing_step_restarts_replays_pins_and_gives_up(tiny_dir: Path) -> None:
    reference, _ = run_to_end(LLMEngine.from_args(str(tiny_dir), **ENGINE_KW), {f"ok-{i}": p for i, p in enumerate(PROMPTS)})
    eng = ProcessEngine.from_args(str(tiny_dir), fault_request_prefix="bad-", max_deaths=2, death_window_s=120,
                        engine_threads=1, **ENGINE_KW)
    await eng.start()
    try:
        # A failing step across the pipe: the culprit's stream raises, the others are untouched.
        streams = {f"ok-{i}": eng.generate(f"ok-{i}", GREEDY, prompt=p) for i, p in enumerate(PROMPTS)}
        results = await asyncio.gather(collect(eng.generate("bad-0", GREEDY, prompt="culprit")),
                                       *(collect(s) for s in streams.values()), return_exceptions=True)
        assert isinstance(results[0], RuntimeError) and "injected fault" in str(results[0])
        assert dict(zip(streams, results[1:], strict=True)) == reference
        assert eng.is_running

        ids = eng.tokenizer.encode("You are a helpful assistant. " * 8)
        pinned = await eng.pin_prefix("persona:x", ids)
        assert pinned >= 16
        first_pid = eng.pid
        stream = eng.generate("long", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                              prompt="go on")
        await anext(stream)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(5):
                await collect(stream)
        assert not eng.is_running and eng.state == "restarting"
        with pytest.raises(EngineDeadError):
            eng.generate("during", GREEDY, prompt="hi")
        await wait_for(lambda: eng.is_running, 120, "the restarted engine")
        assert eng.pid != first_pid and eng.stats().engine_restarts == 1
        # The pin was replayed into the new child.
        await wait_for(lambda: "persona:x" in eng.kv_snapshot().pins, 10, "the replayed pin")
        assert len(eng.kv_snapshot().pins["persona:x"]) == pinned // 16
        assert await collect(eng.generate("ok-after", GREEDY, prompt=PROMPTS[0])) == reference["ok-0"]

        # The second death within the window reaches the bound: no more restarts.
        second_pid = eng.pid
        os.kill(second_pid, signal.SIGKILL)
        await wait_for(lambda: eng.state == "failed", 10, "the failed state")
        await asyncio.sleep(1.0)
        assert eng.state == "failed" and not eng.is_running and eng.pid == second_pid
        with pytest.raises(EngineDeadError):
            eng.generate("after-fail", GREEDY, prompt="hi")
    finally:
        await eng.stop()


@pytest.fixture
def live_gateway(redis_proc, tiny_dir: Path) -> Iterator[tuple[LiveServer, ProcessEngine]]:  # noqa: F811
    import redis as sync_redis

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    eng = ProcessEngine.from_args(str(tiny_dir), engine_threads=1, **ENGINE_KW)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), Settings())
    with LiveServer(app) as live:
        yield live, eng


def sse_events(r: httpx.Response) -> Iterator[str]:
    for line in r.iter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def ready(live: LiveServer) -> httpx.Response:
    return httpx.get(live.url + "/ready", timeout=5)


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_gateway_survives_a_killed_and_a_stuck_engine_process(live_gateway: tuple[LiveServer, ProcessEngine],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    live, eng = live_gateway
    deadline = time.monotonic() + 60
    while not (ready(live).status_code == 200 and eng._pins):  # personas pinned
        assert time.monotonic() < deadline, ready(live).text
        time.sleep(0.1)
    personas = set(eng._pins)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}

    # SIGKILL the engine process with a stream open.
    first_pid = eng.pid
    events: list[str] = []
    ended: list[BaseException | None] = []

    def consume() -> None:
        try:
            with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                for data in sse_events(r):
                    events.append(data)
            ended.append(None)
        except Exception as exc:  # noqa: BLE001 - how the stream ended is what is checked below
            ended.append(exc)

    # A session turn streams alongside it (the web UI's path).
    sid = httpx.post(live.url + "/v1/sessions", json={"persona": "assistant"}, timeout=10).json()["id"]
    turn: list[dict[str, Any]] = []

    def consume_turn() -> None:
        msg = {"content": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{live.url}/v1/sessions/{sid}/messages", json=msg, timeout=30) as r:
            if r.status_code != 200:
                turn.append({"type": "http", "status": r.status_code, "body": r.read().decode()})
                return
            for data in sse_events(r):
                turn.append(json.loads(data))

    turn_reader = threading.Thread(target=consume_turn)
    reader = threading.Thread(target=consume)
    turn_reader.start()
    reader.start()
    deadline = time.monotonic() + 30
    while len(events) < 2 or len(turn) < 2:  # both batched together, so both are mid-reply
        assert turn_reader.is_alive(), turn
        assert time.monotonic() < deadline and reader.is_alive(), (events, ended, turn)
        time.sleep(0.02)
    os.kill(first_pid, signal.SIGKILL)
    t0 = time.monotonic()
    while ready(live).status_code != 503:
        assert time.monotonic() - t0 < 2, "/ready still 200 two seconds after the engine died"
        time.sleep(0.02)
    reader.join(10)
    assert not reader.is_alive(), "the open stream hangs after the engine died"
    # It ends with an error event, then [DONE] (as vLLM does), not a cut connection.
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    last = json.loads(events[-2])
    assert "error" in last, f"the stream ended without an error event: {events[-2]!r} ({ended})"
    assert last["error"]["code"] == "engine_failed" and ended == [None]
    turn_reader.join(10)
    assert not turn_reader.is_alive(), "the session turn hangs after the engine died"
    assert turn[-1]["type"] == "done" and turn[-1]["finish_reason"] == "error", turn[-1]
    r = ready(live)
    assert r.status_code == 503 and "restarting" in r.json()["reason"] and r.headers["Retry-After"]
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=10)
    if r.status_code == 503:  # unless the engine was already back
        assert r.json()["error"]["code"] == "engine_unavailable" and r.headers["Retry-After"]

    # It comes back, with the personas pinned again, and serves.
    deadline = time.monotonic() + 120
    while ready(live).status_code != 200:
        assert time.monotonic() < deadline, ready(live).text
        time.sleep(0.1)
    assert eng.pid != first_pid
    snap = httpx.get(live.url + "/v1/kv", timeout=5).json()
    deadline = time.monotonic() + 10
    while not all(f"persona:{p}" in snap["pins"] for p in personas) and time.monotonic() < deadline:
        time.sleep(0.1)
        snap = httpx.get(live.url + "/v1/kv", timeout=5).json()
    assert {k for k in snap["pins"]} >= set(personas)
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    # A stuck engine (stopped mid-request): /ready reports it, and recovers when it steps again.
    monkeypatch.setattr("chatsvc.app.STUCK_AFTER_S", 1.0)
    events.clear()
    ended.clear()
    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 30
    while len(events) < 2:
        assert time.monotonic() < deadline and reader.is_alive(), (events, ended)
        time.sleep(0.02)
    os.kill(eng.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while ready(live).status_code != 503:
            assert time.monotonic() < deadline, "a stuck engine still reads as ready"
            time.sleep(0.1)
        assert "stuck" in ready(live).json()["reason"]
    finally:
        os.kill(eng.pid, signal.SIGCONT)
    reader.join(60)
    assert ended == [None] and events[-1] == "[DONE]"
    deadline = time.monotonic() + 10
    while ready(live).status_code != 200:
        assert time.monotonic() < deadline, ready(live).text
        time.sleep(0.1)

    # All KV blocks free at idle, except those the persona pins hold.
    deadline = time.monotonic() + 10
    while True:
        snap = httpx.get(live.url + "/v1/kv", timeout=5).json()
        pinned = {b for blocks in snap["pins"].values() for b in blocks}
        if snap["requests_running"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"] - len(pinned):
            break
        assert time.monotonic() < deadline, snap
        time.sleep(0.1)
