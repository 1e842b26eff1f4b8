"""RemoteEngine (a gateway without a model) with two real ``chatsvc worker`` processes on the tiny model and a
real Redis: session affinity with prefix-cache hits, persona spread and pins, abort from a second gateway,
kill -9 failover with an unchanged greedy reply, SIGTERM drain, no worker alive.

The workers live for the whole module (starting them is most of its time); the tests run in file order and
the last two stop them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from gateway_fixtures import redis_proc  # noqa: F401
from scaleout_workers import TINY_FLAGS, WorkerProc, worker_output_written
from timing import scaled

from chatsvc.remote_engine import RemoteEngine
from chatsvc.router import Router
from engine.client import StreamLimits
from engine.grammar import GrammarSpec
from engine.protocol import EngineDeadError, ProtocolError, RequestDelta, StreamOverflowError, TransportError
from engine.request import SamplingParams
from engine.streams import Beat, Generate, Keys, Message, encode, read_pin

pytestmark = pytest.mark.integration
BLOCK = 16
TTL_S = 4.0  # beats every second; a shorter TTL lapses when a loaded machine stalls a worker for a moment


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def workers(redis_proc, tiny: Path) -> Iterator[list[WorkerProc]]:  # noqa: F811
    redis.Redis.from_url(redis_proc.url).flushdb()
    procs = [WorkerProc(redis_proc.url, str(tiny), name, *TINY_FLAGS, ttl_s=TTL_S) for name in ("wa", "wb")]
    try:
        for p in procs:
            p.wait_registered()
        yield procs
    finally:
        for p in procs:
            p.kill9()


@pytest.fixture
async def gateway(redis_proc, tiny: Path, workers: list[WorkerProc]) -> AsyncIterator[RemoteEngine]:  # noqa: F811
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, wait_for_worker_s=2.0)
    await eng.start()
    await wait_for(lambda: len(eng.workers) == sum(p.proc.poll() is None for p in workers))
    yield eng
    await eng.stop()


async def wait_for(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def run(eng: RemoteEngine, rid: str, ids: list[int], max_tokens: int,
              session_id: str | None = None) -> list[RequestDelta]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [d async for d in eng.generate(rid, params, prompt_token_ids=ids, session_id=session_id)]


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def idle_and_free(w: WorkerProc) -> bool:
    """No request on the worker and every block free but the persona pin's two (the earlier test's)."""
    beat = w.beat()
    assert beat is not None
    pinned = 2 * len(beat.pins)
    return beat.stats.requests_running == 0 and beat.free_blocks == beat.stats.kv_blocks_total - pinned


def route(redis_url: str, key: str) -> str | None:
    value = redis.Redis.from_url(redis_url, decode_responses=True).get(key)
    return None if value is None else str(value)


async def test_a_repin_after_an_unpin_keeps_the_prefix_registered(redis_proc, tiny: Path) -> None:  # noqa: F811
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), keys=Keys("repin:"), wait_for_worker_s=0.5)
    await eng.start()
    try:
        for ids in ([1, 2, 3], [4, 5, 6]):  # a persona edited: unpin its old prefix, pin the new one
            eng.unpin_prefix("persona:p")
            assert await eng.pin_prefix("persona:p", ids) == 0  # shorter than a block: nothing to pin
            await asyncio.sleep(0.05)
            raw = redis.Redis.from_url(redis_proc.url, decode_responses=True).hget("repin:pins", "persona:p")
            assert raw is not None and read_pin(raw).prompt_token_ids == ids
        with pytest.raises(EngineDeadError):  # no worker under these keys: refused after the bounded wait
            await run(eng, "nobody", [1, 2, 3], 2)
    finally:
        await eng.stop()


async def test_a_request_waits_for_a_worker_that_registers_late(redis_proc, tiny: Path) -> None:  # noqa: F811
    import redis.asyncio as aioredis

    from chatsvc.worker import Worker
    from engine.async_engine import AsyncEngine

    keys = Keys("late:")
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), keys=keys, poll_s=0.1, wait_for_worker_s=60)
    await eng.start()
    client = aioredis.Redis.from_url(redis_proc.url, decode_responses=True)
    stop = asyncio.Event()
    try:
        waiting = asyncio.create_task(run(eng, "early", [5, 6, 7, 8], 6))
        await asyncio.sleep(0.5)
        assert not waiting.done() and not eng.is_running  # no worker yet: the request waits, /ready says 503
        engine = AsyncEngine.from_args(model=str(tiny), dtype="float32", attention_backend="torch",
                                       num_kv_blocks=32, max_model_len=512, engine_threads=1)
        worker = asyncio.create_task(Worker(engine, client, "late-w", keys=keys, ttl_s=2.0).run(stop))
        got = await asyncio.wait_for(waiting, 60)
        assert got[-1].completion_tokens == 6 and eng.router.decisions["load"] == 1
        stop.set()
        assert await worker == 0
    finally:
        stop.set()
        await eng.stop()
        await client.aclose()


async def test_a_returning_session_follows_its_disk_tier_to_the_restarted_worker(
        redis_proc, tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    """A worker with a disk tier stops (its cached blocks go to disk) and a new worker process starts on the
    same directory: the session's next turn is routed to it, not to the worker with the most room, and its
    history comes back from disk with the tokens a recompute gives."""
    import redis.asyncio as aioredis

    from chatsvc.worker import Worker
    from engine.async_engine import AsyncEngine
    from engine.kv_disk import kv_home

    keys, disk = Keys("home:"), tmp_path / "kv"
    client = aioredis.Redis.from_url(redis_proc.url, decode_responses=True)
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), keys=keys, poll_s=0.1, wait_for_worker_s=30)
    stops: list[asyncio.Event] = []
    running: list[asyncio.Task[int]] = []

    def start(name: str, blocks: int, tiers: bool) -> None:
        tier_args: dict[str, Any] = dict(kv_host_bytes=1 << 20, kv_disk_dir=str(disk), kv_disk_bytes=1 << 26)
        engine = AsyncEngine.from_args(model=str(tiny), dtype="float32", attention_backend="torch",
                                       num_kv_blocks=blocks, max_model_len=512, block_size=BLOCK, engine_threads=1,
                                       **(tier_args if tiers else {}))
        stops.append(asyncio.Event())
        worker = Worker(engine, client, name, keys=keys, ttl_s=2.0, kv_home=kv_home(disk) if tiers else "")
        running.append(asyncio.create_task(worker.run(stops[-1])))

    await eng.start()
    try:
        start("home-a1", 64, tiers=True)
        prompt = [5 + i % 200 for i in range(45)]
        first = await run(eng, "h-0", prompt, 20, session_id="hs")
        stops[0].set()
        assert await running[0] == 0  # drained; its engine wrote its cached blocks to disk on the way out
        start("home-a2", 64, tiers=True)
        start("home-b", 256, tiers=False)  # the most free blocks: where a request without affinity goes
        await wait_for(lambda: sorted(eng.workers) == ["home-a2", "home-b"], 30)
        back = prompt + tokens(first) + [7, 8, 9]
        again = await run(eng, "h-1", back, 12, session_id="hs")
        assert eng.router.decisions["session"] == 1 and eng.router.decisions["load"] == 1
        assert again[-1].cached_tokens == (len(prompt) + 20 - 1) // BLOCK * BLOCK
        recomputed = await run(eng, "h-2", back, 12)  # no session: placed by load, on home-b
        assert eng.router.decisions["load"] == 2 and recomputed[-1].cached_tokens == 0
        assert tokens(again) == tokens(recomputed)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        await eng.stop()
        await client.aclose()


async def test_session_turns_stay_on_their_worker_and_hit_the_prefix_cache(gateway: RemoteEngine,
                                                                           redis_proc) -> None:  # noqa: F811
    prompt = [5 + i % 200 for i in range(37)]
    placed = []
    for turn in range(3):
        deltas = await run(gateway, f"s1-{turn}", prompt, 20, session_id="s1")
        placed.append(route(redis_proc.url, Keys().session("s1")))
        last = deltas[-1]
        assert last.request_finished and last.completion_tokens == 20 and last.prompt_tokens == len(prompt)
        if turn:
            # Everything before this turn's new message was computed on this worker: its full blocks hit.
            assert last.cached_tokens >= (len(prompt) - 7 - 1) // BLOCK * BLOCK > 0
        prompt = prompt + tokens(deltas) + [7, 8, 9, 10, 11, 12, 13]
    assert placed[0] is not None and placed == [placed[0]] * 3
    assert gateway.router.decisions["session"] == 2


async def test_persona_sessions_spread_over_both_workers_each_pinning_it_once(
        gateway: RemoteEngine, workers: list[WorkerProc]) -> None:
    persona = [40 + i for i in range(2 * BLOCK + 5)]
    assert await gateway.pin_prefix("persona:tutor", persona) == 2 * BLOCK
    replies = await asyncio.gather(*[run(gateway, f"p-{i}", persona + [200 + i, 201, 202], 24, session_id=f"p{i}")
                                     for i in range(6)])
    assert all(r[-1].completion_tokens == 24 for r in replies)
    await wait_for(lambda: all("persona:tutor" in (w.beat() or w).pins for w in workers))  # type: ignore[union-attr]
    assert gateway.router.decisions["persona"] >= 2
    # /v1/kv's picture: both pools side by side, the pin holding the persona's two full blocks on each.
    # An engine answers with its latest picture and refreshes it on being asked: wait for one with the pins.
    await wait_for(lambda: len(gateway.kv_snapshot().pins.get("persona:tutor", [])) == 4)
    snap = gateway.kv_snapshot()
    assert len(snap.pools) == 2
    assert snap.num_blocks == len(snap.state) == sum(w.num_blocks for w in snap.pools)
    pinned = snap.pins["persona:tutor"]
    assert len(pinned) == 4 and all(snap.state[b] == "pinned" for b in pinned)
    offsets = [w.offset for w in snap.pools]
    assert [b >= offsets[1] for b in sorted(pinned)] == [False, False, True, True]


async def test_kv_shows_tenants_no_workers_and_operators_everything(
        gateway: RemoteEngine, redis_proc) -> None:  # noqa: F811
    """In scale-out mode /v1/kv tells a tenant nothing of the workers (hosts, pids, every tenant's pin names)
    or the runtime; an admin key and the metrics key get the operators' detail."""
    import httpx

    from chatsvc.app import create_app, load_secret
    from chatsvc.settings import Settings
    from chatsvc.store import Store

    await wait_for(lambda: len(gateway.kv_snapshot().pools) == 2 and gateway.stats().workers)
    app = create_app(gateway, Store.from_url(redis_proc.url),
                     Settings(api_keys=("tenant",), admin_keys=("admin",), metrics_key="scrape"))
    await load_secret(app.state.gateway)  # the lifespan (which would start the engine again) does not run
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        async def kv(key: str) -> dict[str, object]:
            r = await client.get("/v1/kv", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return dict(r.json())

        tenant = await kv("tenant")
        assert not {"workers", "route_decisions", "runtime"} & set(tenant)
        assert [p["worker"] for p in tenant["pools"]] == ["worker-0", "worker-1"]  # type: ignore[index]
        assert not any(name in json.dumps(tenant) for name in gateway.workers)
        for operator in ("admin", "scrape"):
            full = await kv(operator)
            assert set(full["workers"]) == set(gateway.workers)  # type: ignore[arg-type]
            assert {p["worker"] for p in full["pools"]} == set(gateway.workers)  # type: ignore[index]


async def test_worker_control_streams_are_trimmed(redis_proc, tiny: Path,  # noqa: F811
                                                  workers: list[WorkerProc]) -> None:
    """Every control message (here unpins, sent to every worker) is appended with a MAXLEN: the streams stay
    about that long however many are sent."""
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, control_maxlen=50)
    await eng.start()
    try:
        await wait_for(lambda: len(eng.workers) == 2)
        r = redis.Redis.from_url(redis_proc.url)
        for i in range(400):
            eng.unpin_prefix(f"persona:nothing-{i}")
        await wait_for(lambda: not eng._unpinning)
        lengths = [r.xlen(Keys().control(wid)) for wid in eng.workers]
        assert all(n <= 50 + 100 for n in lengths), lengths  # trimmed a whole node (100 entries) at a time
    finally:
        await eng.stop()


async def test_abort_from_a_second_gateway_frees_the_blocks_on_the_worker(
        gateway: RemoteEngine, redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    other = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1)
    await other.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
        stream = gateway.generate("long-1", params, prompt_token_ids=list(range(3, 40)))
        first = await anext(stream)
        assert not first.request_finished
        await other.abort("long-1")
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort" and rest[-1].completion_tokens < 450
    finally:
        await other.stop()
    await wait_for(lambda: all(idle_and_free(w) for w in workers))


class FirstTo(Router):
    """Places a request's first dispatch on the worker named ``name`` (the one the test wedges); failovers
    as the affinity policy does."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def choose(self, workers: Sequence[Beat], **kwargs: Any) -> Beat | None:
        if not kwargs.get("failover"):
            first = next((w for w in workers if w.worker.startswith(f"{self.name}-")), None)
            if first is not None:
                return first
        return super().choose(workers, **kwargs)


def engine_child(pid: int) -> int:
    """The engine process a ``--engine process`` worker runs its engine in (not multiprocessing's helper)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    engines = [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


async def test_a_wedged_worker_whose_beat_goes_on_is_failed_over_after_the_progress_deadline(
        redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    wedged = WorkerProc(redis_proc.url, str(tiny), "wedged", *TINY_FLAGS, "--engine", "process", ttl_s=TTL_S)
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, progress_timeout_s=scaled(5.0),
                                router=FirstTo(wedged.name))
    await eng.start()
    child = 0
    try:
        await asyncio.to_thread(wedged.wait_registered)
        await wait_for(lambda: len(eng.workers) == 3)
        prompt = [19 + (i * 11) % 230 for i in range(27)]
        reference = await run(eng, "wedge-ref", prompt, 300)
        params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        stream = eng.generate("wedge", params, prompt_token_ids=prompt)
        got = [await anext(stream)]
        assert json.loads(route(redis_proc.url, Keys().request("wedge")) or "{}")["worker"] == wedged.id
        child = engine_child(wedged.pid)
        os.kill(child, signal.SIGSTOP)  # the engine stops; the worker's loop, and its beat, go on
        got += [d async for d in stream]
        assert wedged.id in eng.workers  # never taken for dead: only the progress deadline caught it
        assert eng.failovers == 1 and tokens(got) == tokens(reference)
        assert got[-1].completion_tokens == 300
    finally:
        if child:
            os.kill(child, signal.SIGCONT)
        await eng.stop()
        await asyncio.to_thread(wedged.terminate)
    await wait_for(lambda: all(idle_and_free(w) for w in workers))


async def test_an_undecodable_output_entry_fails_the_request_at_once(
        gateway: RemoteEngine, redis_proc, workers: list[WorkerProc]) -> None:  # noqa: F811
    client = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    client.delete(Keys().dead_letter)
    params = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
    stream = gateway.generate("garbled", params, prompt_token_ids=list(range(3, 40)))
    assert not (await anext(stream)).request_finished
    dispatch = json.loads(route(redis_proc.url, Keys().request("garbled")) or "{}")["dispatch"]
    client.xadd(Keys().out(dispatch), {"v": "2", "type": "deltas", "data": '{"deltas": null}'})
    with pytest.raises(TransportError):  # an engine failure (503), not the caller's bad request
        async for _ in stream:
            pass
    dead = [fields for _id, fields in client.xrange(Keys().dead_letter)]
    assert [f["stream"] for f in dead] == [Keys().out(dispatch)] and "deltas" in dead[0]["reason"]
    await wait_for(lambda: all(idle_and_free(w) for w in workers))  # aborted on its worker
    # What a worker would refuse to decode is refused before it is sent, as the caller's bad request.
    with pytest.raises(ProtocolError):
        gateway.generate("too-many-stops", SamplingParams(stop=["ab"] * 100), prompt_token_ids=[5, 6])


def newer_generate(msg: Message) -> dict[str, str]:
    """A ``Generate`` as a gateway of a later format version sends it: no worker of this version decodes it."""
    return {**encode(msg), "v": "9"} if isinstance(msg, Generate) else encode(msg)


async def test_a_request_every_worker_drops_fails_after_the_progress_deadline(
        redis_proc, tiny: Path, workers: list[WorkerProc], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    deadline_s = scaled(3.0)
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, progress_timeout_s=deadline_s)
    await eng.start()
    client = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    client.delete(Keys().dead_letter)
    monkeypatch.setattr("chatsvc.remote_engine.encode", newer_generate)
    try:
        await wait_for(lambda: len(eng.workers) == 2)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="no other engine worker is live"):
            await asyncio.wait_for(run(eng, "skewed", [5, 6, 7], 4), scaled(60))
        # Each worker was given its deadline in turn (the first one failed over), then the caller was told.
        assert 2 * deadline_s <= time.monotonic() - started and eng.failovers == 1
        dead = [fields for _id, fields in client.xrange(Keys().dead_letter)]
        assert len(dead) == 2 and all("version" in f["reason"] for f in dead)
        assert not await asyncio.to_thread(client.exists, Keys().request("skewed"))
    finally:
        await eng.stop()


async def test_output_the_worker_gave_up_on_is_failed_over_after_the_progress_deadline(
        redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    prompt = [17 + (i * 3) % 200 for i in range(21)]
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, progress_timeout_s=scaled(8.0))
    await eng.start()
    try:
        await wait_for(lambda: len(eng.workers) == 2)
        reference = await run(eng, "given-up-ref", prompt, 24)
        worker_output_written(redis_proc.url, allowed=False)
        try:
            reply = asyncio.create_task(run(eng, "given-up", prompt, 24))
            await wait_for(lambda: any("dropped the output" in w.output() for w in workers), scaled(30))
        finally:
            worker_output_written(redis_proc.url, allowed=True)
        got = await asyncio.wait_for(reply, scaled(60))
        assert eng.failovers == 1  # the worker that dropped it is alive and well: the other one answered
        assert tokens(got) == tokens(reference) and got[-1].completion_tokens == 24
    finally:
        await eng.stop()
    await wait_for(lambda: all(idle_and_free(w) for w in workers))


async def test_kill_9_mid_reply_fails_over_with_the_uninterrupted_greedy_reply(
        gateway: RemoteEngine, redis_proc, workers: list[WorkerProc]) -> None:  # noqa: F811
    prompt = [11 + (i * 7) % 250 for i in range(29)]
    reference = await run(gateway, "ref", prompt, 400)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = gateway.generate("victim", params, prompt_token_ids=prompt)
    got = [await anext(stream)]
    victim = json.loads(route(redis_proc.url, Keys().request("victim")) or "{}")["worker"]
    dead = next(w for w in workers if w.id == victim)
    survivor = next(w for w in workers if w.id != victim)
    os.kill(dead.pid, signal.SIGKILL)
    got += [d async for d in stream]
    assert gateway.failovers == 1 and gateway.router.decisions["failover"] == 1
    assert tokens(got) == tokens(reference)  # no token twice, none missing, same greedy choices
    assert "".join(d.text for d in got) == "".join(d.text for d in reference)
    assert got[-1].completion_tokens == 400 and got[-1].prompt_tokens == len(prompt)
    assert list(gateway.workers) == [survivor.id]
    await wait_for(lambda: idle_and_free(survivor))
    dead.proc.wait(10)


async def test_kill_9_mid_reply_continues_a_seeded_sampled_stream(
        gateway: RemoteEngine, redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    extra = WorkerProc(redis_proc.url, str(tiny), "wc", *TINY_FLAGS, ttl_s=TTL_S)
    workers.append(extra)  # the module's teardown stops it; the survivor of the two stays for the drain test
    await asyncio.to_thread(extra.wait_registered)
    await wait_for(lambda: len(gateway.workers) == 2)
    prompt = [13 + (i * 5) % 240 for i in range(31)]

    def params() -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=4321, max_tokens=400, ignore_eos=True)

    reference = [d async for d in gateway.generate("seeded-ref", params(), prompt_token_ids=prompt)]
    stream = gateway.generate("seeded", params(), prompt_token_ids=prompt)
    got = [await anext(stream)]
    victim = json.loads(route(redis_proc.url, Keys().request("seeded")) or "{}")["worker"]
    dead = next(w for w in workers if w.id == victim)
    os.kill(dead.pid, signal.SIGKILL)
    got += [d async for d in stream]
    assert gateway.failovers == 1  # re-dispatched mid-reply, with the count of tokens already sampled
    assert len(tokens(got)) == 400
    assert tokens(got) == tokens(reference)  # the new worker's generator went on where the dead one was
    dead.proc.wait(10)
    survivor = next(w for w in workers if w.proc.poll() is None)
    await wait_for(lambda: idle_and_free(survivor))


async def test_a_full_queue_on_one_worker_is_retried_on_another(
        gateway: RemoteEngine, redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    full = WorkerProc(redis_proc.url, str(tiny), "full", *TINY_FLAGS, "--max-waiting", "0", ttl_s=TTL_S)  # refuses all
    try:
        await asyncio.to_thread(full.wait_registered)
        await wait_for(lambda: full.id in gateway.workers)
        other = next(w for w in workers if w.proc.poll() is None)
        redis.Redis.from_url(redis_proc.url).set(Keys().session("s-full"), full.id)  # its last turn ran there
        got = await run(gateway, "retried", [5, 6, 7, 8], 6, session_id="s-full")
        assert len(tokens(got)) == 6 and got[-1].finish_reason == "length"
        assert route(redis_proc.url, Keys().session("s-full")) == other.id  # answered by the other worker
        assert gateway.failovers == 0
    finally:
        assert await asyncio.to_thread(full.terminate) == 0
    await wait_for(lambda: full.id not in gateway.workers)


async def test_a_reader_that_stops_reading_has_its_request_aborted(
        redis_proc, tiny: Path, workers: list[WorkerProc]) -> None:  # noqa: F811
    eng = RemoteEngine.from_url(redis_proc.url, str(tiny), poll_s=0.1, stream_limits=StreamLimits(max_buffered=40))
    await eng.start()
    try:
        await wait_for(lambda: len(eng.workers) == 1)
        params = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True)
        stream = eng.generate("never-read", params, prompt_token_ids=list(range(30, 50)))
        first = await anext(stream)
        assert not first.request_finished
        await wait_for(lambda: eng.stream_counters.overflowed == 1)  # the worker wrote on; nobody read
        with pytest.raises(StreamOverflowError):
            await anext(stream)
        survivor = next(w for w in workers if w.proc.poll() is None)
        await wait_for(lambda: idle_and_free(survivor))
        assert not eng._readers
    finally:
        await eng.stop()


def test_a_seed_offset_skips_exactly_the_draws_made_before() -> None:
    from engine.sampler import make_generator

    fresh = make_generator(99, 0)
    assert fresh is not None
    draws = [torch.rand(1, generator=fresh, dtype=torch.float64).item() for _ in range(7)]
    resumed = make_generator(99, 0, skip=5)
    assert resumed is not None
    assert [torch.rand(1, generator=resumed, dtype=torch.float64).item() for _ in range(2)] == draws[5:]
    assert RemoteEngine._rest(SamplingParams(seed=1, max_tokens=10), 4).seed_offset == 4
    assert RemoteEngine._rest(SamplingParams(max_tokens=10), 4).seed_offset == 0


def test_a_failover_tells_a_grammar_how_many_prompt_tokens_are_its_reply() -> None:
    """The engine starts a re-dispatched request's grammar past the last ``seed_offset`` prompt tokens
    (tests/test_engine.py checks that it resumes there), seeded or not."""
    params = SamplingParams(max_tokens=10, grammar=GrammarSpec.json_object())
    assert RemoteEngine._rest(params, 4).seed_offset == 4


async def test_sigterm_drains_the_running_request_then_leaves(gateway: RemoteEngine,
                                                              workers: list[WorkerProc]) -> None:
    alive = [w for w in workers if w.proc.poll() is None]
    assert len(alive) == 1
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    stream = gateway.generate("drained", params, prompt_token_ids=list(range(20, 50)))
    got = [await anext(stream)]
    alive[0].proc.send_signal(signal.SIGTERM)
    got += [d async for d in stream]
    assert got[-1].finish_reason == "length" and len(tokens(got)) == 300 and gateway.failovers == 0
    assert await asyncio.to_thread(alive[0].proc.wait, 30) == 0
    assert redis.Redis.from_url(alive[0].url).zcard(Keys().workers) == 0
    await wait_for(lambda: not gateway.workers)
    started = time.monotonic()
    with pytest.raises(EngineDeadError):  # no worker: refused after the bounded wait (the 503)
        await run(gateway, "orphan", [1, 2, 3], 4)
    assert 1.5 < time.monotonic() - started < 10



def test_after_a_failover_a_stop_string_straddling_it_still_ends_the_reply(tiny: Path) -> None:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.model_files import load_tokenizer

    tok, _ = load_tokenizer(str(tiny))
    params = SamplingParams(temperature=0.0, max_tokens=50, stop=["xy"])
    detok = IncrementalDetokenizer(tok, [1, 2], params, eos_token_ids=tok.eos_token_ids)
    detok.step(tok.encode("ab x"))  # streamed before the failover: "x" held back as a possible stop start
    # The new worker decodes only its own tokens, so it saw no stop string and ran on.
    delta = RequestDelta("r", 0, "y!", tok.encode("y!"), False, None, None, 2, 5, 0)
    assert RemoteEngine._retext(detok, delta) is True  # cut here: the worker is to be aborted
    assert (delta.finished, delta.request_finished, delta.finish_reason, delta.stop_reason) == (
        True, True, "stop", "xy")
    assert delta.text == ""  # nothing of the stop string reaches the client, nor anything after it
