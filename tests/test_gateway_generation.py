"""chatsvc.generation.Generation against the fake engine: eager admission errors, deltas, abort on exit."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import REPLY, FakeEngine, tiny_tokenizer

from chatsvc.errors import APIError
from chatsvc.generation import Generation
from chatsvc.metrics import Metrics
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def engine(tokenizer: Tokenizer) -> FakeEngine:
    eng = FakeEngine(tokenizer, max_model_len=64)
    await eng.start()
    return eng


def finished(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("chatsvc_requests_finished_total", {"reason": reason})
    return value or 0.0


async def test_deltas_stream_the_whole_reply_and_count_the_finish(engine: FakeEngine) -> None:
    metrics = Metrics(engine)
    gen = Generation(engine, metrics, "r1", SamplingParams(max_tokens=32), [5, 6, 7])
    await gen.start()
    assert engine.running == {"r1"}  # admitted by start(), before anything is read
    deltas = [d async for d in gen.deltas()]
    assert "".join(d.text for d in deltas) == REPLY
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert engine.submitted["r1"].prompt_token_ids == [5, 6, 7]
    assert finished(metrics, "stop") == 1 and engine.aborted == []
    assert metrics.registry.get_sample_value("chatsvc_time_to_first_token_seconds_count") == 1


async def test_n_samples_are_counted_by_their_most_common_reason(engine: FakeEngine) -> None:
    metrics = Metrics(engine)
    gen = Generation(engine, metrics, "r2", SamplingParams(max_tokens=3, n=2), [5])
    await gen.start()
    deltas = [d async for d in gen.deltas()]
    assert sorted({d.index for d in deltas}) == [0, 1]
    assert gen.reason_counts == {"length": 2}
    assert finished(metrics, "length") == 1


async def test_leaving_early_aborts_the_request(engine: FakeEngine) -> None:
    metrics = Metrics(engine)
    gen = Generation(engine, metrics, "r3", SamplingParams(max_tokens=32), [5])
    await gen.start()
    async for _ in gen.deltas():
        break
    # The abandoned generator is closed by the loop's async-generator finalizer, a few steps later.
    for _ in range(10):
        await asyncio.sleep(0)
    assert engine.aborted == ["r3"] and engine.running == set()
    assert finished(metrics, "abort") == 1


async def test_close_before_reading_aborts_and_is_idempotent(engine: FakeEngine) -> None:
    gen = Generation(engine, Metrics(engine), "r4", SamplingParams(max_tokens=32), [5])
    await gen.start()
    await gen.close()
    await gen.close()
    assert engine.aborted == ["r4"] and engine.running == set()


async def test_a_request_the_engine_refuses_is_a_400(engine: FakeEngine) -> None:
    gen = Generation(engine, Metrics(engine), "r5", SamplingParams(max_tokens=64), [5])
    with pytest.raises(APIError) as err:
        await gen.start()
    assert err.value.status == 400 and err.value.code == "invalid_request"
    assert engine.running == set()


async def test_a_full_engine_is_a_429_with_retry_after(engine: FakeEngine) -> None:
    engine.max_running = 1
    first = Generation(engine, Metrics(engine), "r6", SamplingParams(max_tokens=8), [5])
    await first.start()
    second = Generation(engine, Metrics(engine), "r7", SamplingParams(max_tokens=8), [5], retry_after_s=7)
    with pytest.raises(APIError) as err:
        await second.start()
    assert err.value.status == 429 and err.value.code == "queue_full"
    assert err.value.headers == {"Retry-After": "7"}
    await first.close()


async def test_a_stopped_engine_is_not_turned_into_an_http_error(engine: FakeEngine) -> None:
    from engine.protocol import EngineDeadError

    await engine.stop()
    gen = Generation(engine, Metrics(engine), "r8", SamplingParams(max_tokens=8), [5])
    with pytest.raises(EngineDeadError):  # the app maps it to a 503 for every route at once
        await gen.start()
