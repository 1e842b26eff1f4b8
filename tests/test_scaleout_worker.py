"""Worker in this process on a real AsyncEngine (tiny model) and a real Redis: a Generate entry becomes the
engine's reply on the output stream and is acked; a bad entry is answered where it names its sender,
dead-lettered, and stops no loop; stop drains; a worker declared dead (fenced) aborts its requests and exits 1."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from timing import scaled

from chatsvc.worker import Worker
from engine.async_engine import AsyncEngine
from engine.protocol import Abort, AddRequest, RequestDelta, RequestError, TransportError
from engine.request import SamplingParams
from engine.streams import GROUP, VERSION, Deltas, Generate, Keys, decode, encode

pytestmark = pytest.mark.integration
K = Keys()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def engine(tiny: Path) -> AsyncEngine:
    return AsyncEngine.from_args(model=str(tiny), dtype="float32", attention_backend="torch", num_kv_blocks=64,
                                 max_model_len=512, engine_threads=1)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:  # noqa: F811
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def started(r: aioredis.Redis, tiny: Path, ttl_s: float = 2.0) -> tuple[Worker, asyncio.Event, asyncio.Task[int]]:
    worker = Worker(engine(tiny), r, "w1", ttl_s=ttl_s)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + 30
    while not await r.zscore(K.workers, "w1"):
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
    return worker, stop, task


async def send(r: aioredis.Redis, rid: str, ids: list[int], max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    await r.xadd(K.requests("w1"), encode(Generate(AddRequest(rid, params, ids), f"d-{rid}")))
    return K.out(f"d-{rid}")


async def read(r: aioredis.Redis, key: str, until_finished: bool = True, timeout_s: float = 30) -> list[Deltas | RequestError]:
    msgs: list[Deltas | RequestError] = []
    last = "0-0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _s, entries in await r.xread({key: last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                msg = decode(fields)
                assert isinstance(msg, Deltas | RequestError)
                msgs.append(msg)
                if isinstance(msg, RequestError) or msg.deltas[-1].request_finished or not until_finished:
                    return msgs
    if timeout_s >= 5:
        raise AssertionError(f"no end on {key}")
    return msgs


def deltas(msgs: list[Deltas | RequestError]) -> list[RequestDelta]:
    return [d for m in msgs if isinstance(m, Deltas) for d in m.deltas]


async def test_a_generate_entry_streams_the_engines_reply_and_is_acked(r: aioredis.Redis, tiny: Path) -> None:
    reference = engine(tiny)
    await reference.start()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [t async for d in reference.generate("ref", params, prompt_token_ids=list(range(3, 30))) for t in d.token_ids]
    await reference.stop()
    worker, stop, task = await started(r, tiny)
    keys = await asyncio.gather(*[send(r, f"g{i}", list(range(3, 30)), 24) for i in range(3)])
    for key in keys:
        got = deltas(await read(r, key))
        assert [t for d in got for t in d.token_ids] == want and got[-1].finish_reason == "length"
    deadline = time.monotonic() + 5
    while await r.xlen(K.requests("w1")) or (await r.xpending(K.requests("w1"), GROUP))["pending"]:
        assert time.monotonic() < deadline, "entries not acked and deleted"
        await asyncio.sleep(0.05)
    assert await r.ttl(keys[0]) > 0  # output streams expire
    stop.set()
    assert await task == 0
    assert not await r.exists(K.workers, K.beat("w1"), K.requests("w1"), K.control("w1"))


async def test_bad_entries_are_dropped_and_refused_requests_answered(r: aioredis.Redis, tiny: Path) -> None:
    worker, stop, task = await started(r, tiny)
    await r.xadd(K.requests("w1"), {"v": "99", "type": "generate", "data": "{}"})
    key = await send(r, "empty", [10**6], 4)  # a token id beyond the vocabulary: the engine refuses it
    msgs = await read(r, key)
    assert isinstance(msgs[-1], RequestError) and msgs[-1].kind == "ValueError"
    assert deltas(await read(r, await send(r, "fine", [5, 6, 7], 3)))[-1].completion_tokens == 3
    stop.set()
    assert await task == 0


async def test_stop_drains_the_running_request_and_deregisters(r: aioredis.Redis, tiny: Path) -> None:
    worker, stop, task = await started(r, tiny)
    key = await send(r, "long", list(range(3, 20)), 300)
    first = await read(r, key, until_finished=False)
    assert deltas(first) and not deltas(first)[-1].request_finished
    stop.set()
    queued = await send(r, "late", [5, 6, 7], 3)
    assert await task == 0
    got = deltas(await read(r, key))
    assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 300
    assert not await r.exists(K.workers, K.beat("w1"))
    # Read before the stop: it ran. Queued unread when draining began: handed back (WorkerGone). Arrived after
    # the worker left: unanswered, and its gateway, no longer seeing the worker, dispatches it elsewhere.
    late = await read(r, queued, timeout_s=1.0)
    assert (not late or (isinstance(late[-1], RequestError) and late[-1].kind == "WorkerGone")
            or deltas(late)[-1].completion_tokens == 3)


async def test_a_worker_declared_dead_aborts_its_requests_and_exits_1(r: aioredis.Redis, tiny: Path) -> None:
    worker, stop, task = await started(r, tiny, ttl_s=0.4)
    key = await send(r, "orphaned", list(range(3, 20)), 450)
    await read(r, key, until_finished=False)
    await r.zrem(K.workers, "w1")  # what a gateway does once the worker's beat has lapsed
    assert await asyncio.wait_for(task, 10) == 1
    got = deltas(await read(r, key))
    assert got[-1].finish_reason == "abort" and got[-1].completion_tokens < 450


def generate_entry(dispatch: str, params: object, version: int = VERSION) -> dict[str, str]:
    add = {"type": "add", "request_id": f"r-{dispatch}", "params": params, "prompt_token_ids": [5, 6, 7]}
    return {"v": str(version), "type": "generate", "data": json.dumps({"add": add, "dispatch": dispatch})}


async def test_a_bad_request_entry_is_answered_dead_lettered_and_the_reader_goes_on(r: aioredis.Redis,
                                                                                   tiny: Path) -> None:
    worker, stop, task = await started(r, tiny)
    await r.delete(K.dead_letter)
    bad = {"null": None, "seed": {"seed_offset": 10**30},
           # Each stop string is matched at every token: 100k of them would hold the step loop for everyone.
           "stops": {"stop": ["ab"] * 100_000, "max_tokens": 4}, "nan": {"temperature": float("nan")}}
    for name, params in bad.items():
        await r.xadd(K.requests("w1"), generate_entry(f"d-{name}", params))
    await r.xadd(K.requests("w1"), generate_entry("d-v9", {}, version=9))  # a newer gateway's entry
    for name in bad:
        msgs = await read(r, K.out(f"d-{name}"), timeout_s=scaled(10))
        assert len(msgs) == 1 and isinstance(msgs[0], RequestError), (name, msgs)
        assert msgs[0].kind == "TransportError" and msgs[0].request_id == f"r-d-{name}"
        assert isinstance(msgs[0].exception(), TransportError)
    assert await read(r, K.out("d-v9"), timeout_s=1.0) == []  # its sender would not read this version's answer
    dead = {fields["id"]: fields for _id, fields in await r.xrange(K.dead_letter)}
    assert len(dead) == len(bad) + 1 and {f["stream"] for f in dead.values()} == {K.requests("w1")}
    assert all(f["reason"] and f["entry"].startswith('{"v": ') for f in dead.values())
    assert any("version" in f["reason"] and '"9"' in f["entry"] for f in dead.values())
    assert not (await r.xpending(K.requests("w1"), GROUP))["pending"]  # acked: never read again
    assert deltas(await read(r, await send(r, "fine", [5, 6, 7], 3)))[-1].completion_tokens == 3
    assert not task.done()
    stop.set()
    assert await task == 0


async def test_a_bad_control_entry_is_dead_lettered_and_the_control_loop_goes_on(r: aioredis.Redis,
                                                                                 tiny: Path) -> None:
    worker, stop, task = await started(r, tiny)
    await r.delete(K.dead_letter, K.reply("c1"))
    key = await send(r, "long", list(range(3, 20)), 450)
    await read(r, key, until_finished=False)
    await r.xadd(K.control("w1"), {"v": str(VERSION), "type": "abort", "data": json.dumps(["long"])})
    await r.xadd(K.control("w1"), {"v": str(VERSION), "type": "pin",
                                   "data": json.dumps({"key": "p", "prompt_token_ids": [-1], "call_id": "c1"})})
    answer = await r.blpop([K.reply("c1")], timeout=scaled(10))
    assert answer is not None and "error" in json.loads(answer[1])  # the caller is told, not left waiting
    await r.xadd(K.control("w1"), encode(Abort("long")))  # the loop still reads: this one aborts the request
    got = deltas(await read(r, key))
    assert got[-1].finish_reason == "abort" and got[-1].completion_tokens < 450
    dead = [fields for _id, fields in await r.xrange(K.dead_letter)]
    assert [f["stream"] for f in dead] == [K.control("w1")] * 2
    assert "list" in dead[0]["reason"].lower() or "Abort" in dead[0]["reason"]
    stop.set()
    assert await task == 0
