"""ProcessEngine with the real default model: same greedy tokens as in-process, aborts free blocks, bad
requests refused in the parent, a killed child fails open streams, stop() and parent death leave no process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from gateway_fixtures import LiveServer, default_model_path, redis_proc  # noqa: F401
from timing import scaled

from engine.engine_process import ProcessEngine
from engine.process_env import ENGINE_SPINCOUNT, find_tcmalloc, omp_wait_policy
from engine.protocol import EngineDeadError, EngineStats, QueueFullError, RequestDelta
from engine.request import SamplingParams

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16
# The torch attention kernels: this file tests the process boundary, not which kernels run behind it.
ENGINE_KW: dict[str, object] = {"dtype": "float32", "attention_backend": "torch", "block_size": BLOCK,
                                "num_kv_blocks": 128, "max_num_seqs": 8, "max_waiting": 6}
PROMPTS = ["Hello! Who are you?", "The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers:"]


def process_state(pid: int) -> str | None:
    """The /proc state letter of a process (Z: zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_state(pid) in (None, "Z"):
            return True
        time.sleep(0.05)
    return False


async def collect(it: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [d async for d in it]


async def wait_stats(engine: ProcessEngine, **want: int) -> EngineStats:
    deadline = time.monotonic() + 20
    stats = engine.stats()
    while any(getattr(stats, k) != v for k, v in want.items()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        stats = engine.stats()
    return stats


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[ProcessEngine]:
    eng = ProcessEngine.from_args(default_model_path(), **ENGINE_KW)  # type: ignore[arg-type]
    await eng.start()
    yield eng
    await eng.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_tokens_equal_the_in_process_llm(engine: ProcessEngine) -> None:
    from engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = await asyncio.gather(*(collect(engine.generate(f"greedy-{i}", params, prompt=p))
                                 for i, p in enumerate(PROMPTS)))
    kw = {k: v for k, v in ENGINE_KW.items() if k != "max_waiting"}
    want = LLM(model=default_model_path(), **kw).generate(PROMPTS, params)  # type: ignore[arg-type]
    for deltas, out in zip(got, want, strict=True):
        assert [t for d in deltas for t in d.token_ids] == out.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == out.outputs[0].text
        assert deltas[-1].request_finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].completion_tokens == 16
    assert engine.model_name and engine.max_model_len > 0 and engine.is_running
    # The child runs on tcmalloc when the machine has it, and with a short OpenMP spin unless the operator
    # chose how its workers wait.
    assert engine.info.allocator.startswith("tcmalloc") == (find_tcmalloc() is not None)
    chosen = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)
    assert engine.info.omp_wait_policy == (omp_wait_policy() if chosen else f"GOMP_SPINCOUNT={ENGINE_SPINCOUNT}")
    # And with torch's large allocations on huge pages, unless the operator set that too.
    child_env = Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0")
    assert f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '1')}".encode() in child_env


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_abort_mid_stream_frees_every_kv_block(engine: ProcessEngine) -> None:
    idle = (await wait_stats(engine, requests_running=0, requests_waiting=0)).kv_blocks_free
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    streams = [engine.generate(f"abort-{i}", params, prompt=f"Tell me a long story, number {i}.") for i in range(3)]
    for s in streams:
        await anext(s)
        await anext(s)
    running = engine.stats()
    assert running.kv_blocks_free < idle
    await engine.abort("abort-0")
    rest = await collect(streams[0])
    assert rest[-1].request_finished and rest[-1].finish_reason == "abort"
    await streams[1].aclose()  # a client that goes away
    await engine.abort("abort-2")
    await collect(streams[2])
    stats = await wait_stats(engine, requests_running=0, kv_blocks_free=idle)
    assert stats.requests_running == 0 and stats.requests_waiting == 0
    assert stats.kv_blocks_free == idle


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_bad_requests_are_refused_before_anything_is_queued(engine: ProcessEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    vocab = len(engine.tokenizer.hf)
    # generate() itself raises: nothing reaches the engine process.
    with pytest.raises(ValueError, match="integers in"):
        engine.generate("bad-1", params, prompt_token_ids=[1, vocab + 5])
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.generate("bad-2", SamplingParams(n=9), prompt="hi")
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate("bad-3", params, prompt_token_ids=[1] * engine.max_model_len)
    with pytest.raises(ValueError, match="required"):
        engine.generate("bad-4", params)
    assert engine._adds_sent == engine._adds_seen
    # The waiting bound counts requests the child has not acknowledged yet.
    streams = [engine.generate(f"full-{i}", params, prompt="hi") for i in range(6)]
    with pytest.raises(QueueFullError):
        engine.generate("full-6", params, prompt="hi")
    with pytest.raises(ValueError, match="already in use"):
        engine.generate("full-0", params, prompt="hi")
    for s in streams:
        assert (await collect(s))[-1].finish_reason == "length"
    await wait_stats(engine, requests_running=0, requests_waiting=0)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_pin_and_snapshot_cross_the_pipe(engine: ProcessEngine) -> None:
    ids = engine.tokenizer.encode("You are a helpful assistant who always answers in one short sentence. " * 3)
    pinned = await engine.pin_prefix("persona:test", ids)
    assert pinned == len(ids) // BLOCK * BLOCK > 0
    deadline = time.monotonic() + 10
    while "persona:test" not in engine.kv_snapshot().pins and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    snap = engine.kv_snapshot()
    assert len(snap.pins["persona:test"]) == pinned // BLOCK
    assert snap.num_blocks == ENGINE_KW["num_kv_blocks"]
    engine.unpin_prefix("persona:test")
    while "persona:test" in engine.kv_snapshot().pins and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert "persona:test" not in engine.kv_snapshot().pins


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_stop_ends_open_streams_and_leaves_no_process(engine: ProcessEngine) -> None:
    """Last of the tests on the module's engine: it stops it (the fixture's stop() is then a no-op)."""
    import multiprocessing

    stream = engine.generate("s-0", SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True),
                             prompt="Go on.")
    await anext(stream)
    await engine.stop()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    assert not engine.is_running
    assert process_state(engine.pid) is None
    assert all(p.pid != engine.pid for p in multiprocessing.active_children())
    with pytest.raises(EngineDeadError):
        engine.generate("s-1", SamplingParams(), prompt="hi")


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_killed_child_fails_open_streams_and_is_reaped() -> None:
    eng = ProcessEngine.from_args(default_model_path(), **ENGINE_KW)  # type: ignore[arg-type]
    await eng.start()
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    streams = [eng.generate(f"k-{i}", params, prompt=f"Count to a thousand, {i}.") for i in range(2)]
    for s in streams:
        await anext(s)
    pid = eng.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for s in streams:
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(5):
                while True:
                    await anext(s)
    assert time.monotonic() - t0 < 5
    assert not eng.is_running and eng.state == "restarting"  # a new child is loading
    with pytest.raises(EngineDeadError):
        eng.generate("k-after", params, prompt="hi")
    with pytest.raises(EngineDeadError):
        await eng.pin_prefix("x", [1, 2, 3])
    assert wait_gone(pid, 15)
    assert process_state(pid) is None  # reaped, not a zombie
    await eng.stop()  # waits for the restart under way, then shuts the new child down
    assert eng.state == "stopped" and process_state(eng.pid) is None


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_engine_build_errors_surface_from_the_constructor() -> None:
    # The child cannot build the engine: its ValueError is raised here, not a hang.
    with pytest.raises(ValueError, match="max_model_len") as info:
        ProcessEngine.from_args(default_model_path(), max_model_len=10**8, attention_backend="torch")
    assert "engine process" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(ValueError, match="model not found"):
        ProcessEngine.from_args("/nonexistent/model.gguf")


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_engine_process_exits_when_its_parent_dies(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, signal, sys\n"
        "from engine.engine_process import ProcessEngine\n"
        "if __name__ == '__main__':\n"
        f"    eng = ProcessEngine.from_args({default_model_path()!r}, attention_backend='torch', num_kv_blocks=16)\n"
        "    print(eng.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=scaled(240),
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    assert wait_gone(child, 10), f"engine process {child} outlived its parent"


@pytest.fixture
def gateway_server(redis_proc) -> Iterator[LiveServer]:  # noqa: F811
    import redis as sync_redis

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    eng = ProcessEngine.from_args(default_model_path(), **ENGINE_KW)  # type: ignore[arg-type]
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), Settings())
    with LiveServer(app) as live:
        live.engine = eng  # type: ignore[attr-defined]
        yield live
    assert process_state(eng.pid) is None  # no engine process is left behind


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_gateway_streams_a_chat_completion_from_the_engine_process(gateway_server: LiveServer) -> None:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    client = openai.OpenAI(base_url=gateway_server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert full.choices[0].message.content == text and text
    # A dead engine process: not ready, and requests are refused as unavailable rather than hanging.
    assert httpx.get(gateway_server.url + "/ready").json()["engine"] is True
    # (tests/test_faults_engine.py covers the restart that follows.)
    os.kill(gateway_server.engine.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while httpx.get(gateway_server.url + "/ready").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    body = httpx.get(gateway_server.url + "/ready").json()
    assert body["engine"] is False and body["reason"] == "engine restarting"
    r = httpx.post(gateway_server.url + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert r.headers["Retry-After"]
