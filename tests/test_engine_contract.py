"""One contract, every transport: the thread engine (``AsyncEngine``), the process engine (``ProcessEngine``) and
the Redis engine (``RemoteEngine`` with a ``Worker``) pass the same tests: generate, stream, abort, pin/unpin,
stats, snapshot, a failing request, engine death, shutdown.

The tiny float32 model with the torch kernels: the same greedy tokens whichever transport carries them, and
seconds per test. The Redis transport runs its worker on its own thread and event loop, so that its death
can be a real one: the loop stops mid-flight, its beat lapses, and the gateway must notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from gateway_fixtures import redis_proc  # noqa: F401

from engine.async_engine import AsyncEngine
from engine.client import EngineClient
from engine.engine import LLMEngine
from engine.engine_process import ProcessEngine
from engine.protocol import EngineDeadError, EngineStats, KVSnapshot, RequestDelta
from engine.request import SamplingParams

# One event loop for the module, so one engine per transport serves every test that leaves it running.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

BLOCK = 16
# A host KV tier (outside the 64-block pool) for the warm test.
ENGINE_KW: dict[str, Any] = {"dtype": "float32", "attention_backend": "torch", "block_size": BLOCK,
                             "num_kv_blocks": 64, "max_model_len": 512, "engine_threads": 1,
                             "kv_host_bytes": 1 << 22}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello! Who are you?", "The capital of France is", "List three prime numbers:"]
FAULT = "bad-"  # requests whose id starts with it fail inside the model run (LLMEngine's fault injection)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from the engine driven directly, no transport."""
    eng = LLMEngine.from_args(str(tiny), **ENGINE_KW)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", GREEDY, prompt=p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += d.token_ids
    return out


class Transport:
    """One way to run an engine: ``start`` returns its client, ``kill`` takes its engine down abruptly."""

    client: EngineClient

    async def start(self) -> EngineClient:
        raise NotImplementedError

    async def kill(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        await self.client.stop()


class ThreadTransport(Transport):
    async def start(self) -> EngineClient:
        eng = AsyncEngine.from_args(self.model, fault_request_prefix=FAULT, **ENGINE_KW)
        await eng.start()
        self.client = eng
        return eng

    async def kill(self) -> None:
        # The model loses a shard mid-step: the one failure that takes a thread engine down whole.
        from engine.distributed import RankDiedError

        eng = self.client
        assert isinstance(eng, AsyncEngine)

        def die() -> list[RequestDelta]:
            raise RankDiedError("rank 1 exited with code 1")

        eng.engine.step = die  # type: ignore[method-assign]


class ProcessTransport(Transport):
    async def start(self) -> EngineClient:
        eng = ProcessEngine.from_args(self.model, fault_request_prefix=FAULT, max_deaths=1, **ENGINE_KW)
        await eng.start()
        self.client = eng
        return eng

    async def kill(self) -> None:
        assert isinstance(self.client, ProcessEngine)
        os.kill(self.client.pid, signal.SIGKILL)


class RedisTransport(Transport):
    """A gateway's ``RemoteEngine`` and one ``Worker`` (its own thread and event loop) over a real Redis."""

    url: str

    async def start(self) -> EngineClient:
        from chatsvc.remote_engine import RemoteEngine
        from engine.streams import Keys

        # Keys of its own: a shared engine and a fresh one may run at once on the one Redis.
        self.keys = Keys(f"contract-{id(self)}:")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop_worker: asyncio.Event | None = None
        self.worker_done = asyncio.run_coroutine_threadsafe(self._worker(), self.loop)
        client = RemoteEngine.from_url(self.url, self.model, keys=self.keys, poll_s=0.05, wait_for_worker_s=1.0)
        await client.start()
        deadline = time.monotonic() + 60
        while not client.is_running:
            assert time.monotonic() < deadline and not self.worker_done.done(), "the worker did not register"
            await client.refresh()
            await asyncio.sleep(0.05)
        self.client = client
        return client

    async def _worker(self) -> int:
        from chatsvc.worker import Worker

        self.stop_worker = asyncio.Event()
        engine = AsyncEngine.from_args(self.model, fault_request_prefix=FAULT, **ENGINE_KW)
        r = aioredis.Redis.from_url(self.url, decode_responses=True)
        return await Worker(engine, r, "contract", keys=self.keys, ttl_s=2.0).run(self.stop_worker)

    async def kill(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)  # mid-flight: no drain, no deregistration

    async def close(self) -> None:
        await self.client.stop()
        if self.loop.is_running():
            assert self.stop_worker is not None
            self.loop.call_soon_threadsafe(self.stop_worker.set)
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.worker_done)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


TRANSPORTS: dict[str, type[Transport]] = {"thread": ThreadTransport, "process": ProcessTransport,
                                          "redis": RedisTransport}


@contextlib.asynccontextmanager
async def running(request: pytest.FixtureRequest, model: Path) -> AsyncIterator[Transport]:
    t = TRANSPORTS[request.param]()
    t.model = str(model)  # type: ignore[attr-defined]
    if isinstance(t, RedisTransport):
        t.url = request.getfixturevalue("redis_proc").url
    await t.start()
    try:
        yield t
    finally:
        await t.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(TRANSPORTS))
async def transport(request: pytest.FixtureRequest, tiny: Path) -> AsyncIterator[Transport]:
    """A running engine shared by the tests that leave it running."""
    async with running(request, tiny) as t:
        yield t


@pytest_asyncio.fixture(loop_scope="module", params=list(TRANSPORTS))
async def fresh(request: pytest.FixtureRequest, tiny: Path) -> AsyncIterator[Transport]:
    """An engine of its own, for a test that takes it down."""
    async with running(request, tiny) as t:
        yield t


async def collect(it: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [d async for d in it]


async def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def idle(stats: EngineStats, free: int) -> bool:
    return stats.requests_running == stats.requests_waiting == 0 and stats.kv_blocks_free == free


async def test_generate_streams_the_reference_tokens(transport: Transport, reference: dict[str, list[int]]) -> None:
    eng = transport.client
    streams = [eng.generate(f"r{i}", GREEDY, prompt=p) for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, deltas in enumerate(results):
        assert [t for d in deltas for t in d.token_ids] == reference[f"r{i}"]
        assert deltas[-1].request_finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].completion_tokens == GREEDY.max_tokens
        assert all(d.request_id == f"r{i}" for d in deltas) and len(deltas) > 1  # streamed, not one lump
    assert eng.tokenizer.decode(reference["r0"]) == "".join(d.text for d in results[0])


async def test_abort_ends_the_stream_and_frees_every_block(transport: Transport) -> None:
    eng = transport.client
    await wait_until(lambda: eng.stats().kv_blocks_total > 0, "the first stats")
    free = eng.stats().kv_blocks_free
    long = dataclasses.replace(GREEDY, max_tokens=400)
    stream = eng.generate("long", long, prompt=PROMPTS[0])
    first = await anext(stream)
    assert first.token_ids
    await eng.abort("long")
    rest = await collect(stream)
    assert rest and rest[-1].request_finished and rest[-1].finish_reason == "abort"
    await wait_until(lambda: idle(eng.stats(), free), "every block back")

    # Closing a stream early aborts its request as well.
    stream = eng.generate("closed", long, prompt=PROMPTS[1])
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_until(lambda: idle(eng.stats(), free), "every block back after the close")


async def test_pin_and_unpin_show_in_the_snapshot(transport: Transport) -> None:
    eng = transport.client
    ids = eng.tokenizer.encode("You are a careful tutor. " * 8)
    pinned = await eng.pin_prefix("persona:test", ids)
    assert pinned == len(ids) // BLOCK * BLOCK > 0
    if isinstance(transport, RedisTransport):  # a worker pins a persona when it first serves it
        await collect(eng.generate("use", GREEDY, prompt_token_ids=ids + eng.tokenizer.encode(" Hi")))
    await wait_until(lambda: len(eng.kv_snapshot().pins.get("persona:test", [])) == pinned // BLOCK,
                     "the pinned blocks in the snapshot")
    snap = eng.kv_snapshot()
    assert isinstance(snap, KVSnapshot) and snap.block_size == BLOCK and snap.num_blocks == 64
    assert all(snap.state[b] == "pinned" for b in snap.pins["persona:test"])
    eng.unpin_prefix("persona:test")
    await wait_until(lambda: "persona:test" not in eng.kv_snapshot().pins, "the pin to go")


async def test_a_salted_prefix_is_found_only_under_its_salt(transport: Transport) -> None:
    """``cache_salt`` crosses every transport: a prefix computed and pinned under one salt is hit by requests
    with that salt only, never by another salt or by an unsalted request (the hit count a client sees)."""
    eng = transport.client
    ids = eng.tokenizer.encode("The private persona of one tenant, known to nobody else. " * 3)
    question = ids + eng.tokenizer.encode(" Hi")
    pinned = await eng.pin_prefix("persona:own", ids, cache_salt="salt-b")
    assert pinned == len(ids) // BLOCK * BLOCK > 0

    async def cached(rid: str, salt: str | None) -> int:
        params = dataclasses.replace(GREEDY, max_tokens=1, cache_salt=salt)
        return (await collect(eng.generate(rid, params, prompt_token_ids=question)))[-1].cached_tokens

    assert await cached("owner-1", "salt-b") >= (0 if isinstance(transport, RedisTransport) else pinned)
    await wait_until(lambda: len(eng.kv_snapshot().pins.get("persona:own", [])) == pinned // BLOCK,
                     "the salted pin in the snapshot")
    assert await cached("other", "salt-a") == 0
    assert await cached("unsalted", None) == 0
    assert await cached("owner-2", "salt-b") >= pinned
    eng.unpin_prefix("persona:own")
    await wait_until(lambda: "persona:own" not in eng.kv_snapshot().pins, "the pin to go")


async def test_warm_brings_a_session_history_back_into_the_pool(transport: Transport) -> None:
    eng = transport.client
    short = dataclasses.replace(GREEDY, max_tokens=2)
    history = eng.tokenizer.encode("We talked about rivers and the sea for a long while. " * 8)[:96]
    await collect(eng.generate("warm-first", short, prompt_token_ids=history, session_id="warm-session"))
    for i in range(3):  # 3 x 25 blocks through the 64-block pool: the history's blocks go to the host tier
        filler = eng.tokenizer.encode(f"Filler text number {i} about nothing in particular. " * 40)[:400]
        await collect(eng.generate(f"warm-filler-{i}", short, prompt_token_ids=filler))
    await wait_until(lambda: eng.stats().kv_host_offloaded_blocks >= 6, "the history in the host tier")
    before = eng.stats().kv_warm_loaded_blocks
    eng.warm_prefix("warm-session", history)
    await wait_until(lambda: eng.stats().kv_warm_loaded_blocks >= before + 6, "the warm's loads")
    hit = await collect(eng.generate("warm-back", short, prompt_token_ids=history + eng.tokenizer.encode(" Next?")))
    assert hit[-1].cached_tokens >= 96  # the warmed blocks, as prefix hits


async def test_stats_are_typed_and_follow_the_load(transport: Transport) -> None:
    eng = transport.client
    await wait_until(lambda: eng.stats().kv_blocks_total == 64, "the pool size in the stats")
    stats = eng.stats()
    assert isinstance(stats, EngineStats) and stats.engine_state == "running"
    assert stats.max_waiting > 0 and stats.to_json()["kv_blocks_total"] == 64
    # What it computes with travels too: the torch kernels these tests ask for, in float32.
    assert stats.runtime is not None and stats.runtime["kernels"] == "torch" and stats.runtime["dtype"] == "float32"
    stream = eng.generate("busy", dataclasses.replace(GREEDY, max_tokens=300), prompt=PROMPTS[2])
    await anext(stream)
    await wait_until(lambda: eng.stats().requests_running == 1, "the running request in the stats")
    assert eng.stats().kv_blocks_free < 64
    await eng.abort("busy")
    await collect(stream)
    await wait_until(lambda: eng.stats().requests_running == 0, "the request to leave the stats")


async def test_a_failing_request_fails_alone(transport: Transport, reference: dict[str, list[int]]) -> None:
    eng = transport.client
    good = eng.generate("r1", GREEDY, prompt=PROMPTS[1])
    bad = eng.generate(f"{FAULT}1", GREEDY, prompt="culprit")
    results = await asyncio.gather(collect(bad), collect(good), return_exceptions=True)
    assert isinstance(results[0], RuntimeError) and "injected fault" in str(results[0]), results[0]
    assert not isinstance(results[1], BaseException)
    assert [t for d in results[1] for t in d.token_ids] == reference["r1"]
    with pytest.raises(ValueError):
        eng.generate("empty", GREEDY, prompt_token_ids=[])
    assert eng.is_running


async def test_engine_death_fails_open_streams_with_engine_dead(fresh: Transport) -> None:
    transport = fresh
    eng = transport.client
    stream = eng.generate("doomed", dataclasses.replace(GREEDY, max_tokens=400), prompt=PROMPTS[0])
    await anext(stream)
    await transport.kill()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect(stream), 30)
    await wait_until(lambda: not eng.is_running, "the client to say the engine is down")
    with pytest.raises(EngineDeadError):
        await collect(eng.generate("after", GREEDY, prompt=PROMPTS[1]))


async def test_shutdown_ends_open_streams(fresh: Transport) -> None:
    transport = fresh
    eng = transport.client
    stream = eng.generate("open", dataclasses.replace(GREEDY, max_tokens=400), prompt=PROMPTS[0])
    await anext(stream)
    await transport.close()
    assert not eng.is_running
    try:
        rest = await asyncio.wait_for(collect(stream), 30)
    except EngineDeadError:
        pass  # the transport cut the stream
    else:
        assert rest and rest[-1].request_finished and rest[-1].finish_reason == "abort"
    with pytest.raises(EngineDeadError):
        eng.generate("late", GREEDY, prompt=PROMPTS[1])
