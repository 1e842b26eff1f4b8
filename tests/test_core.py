"""engine/core.py: the one engine loop, driven here through a scripted channel (no thread, no process)."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.engine import LLMEngine
from engine.protocol import (
    Abort,
    AddRequest,
    Command,
    Pin,
    Shutdown,
    StepOutput,
    Unpin,
    WantSnapshot,
)
from engine.request import SamplingParams

KW = {"dtype": "float32", "attention_backend": "torch", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 512,
      "max_waiting": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Script:
    """A channel that hands the core one batch of commands per receive and records every output."""

    def __init__(self, *batches: list[Command]) -> None:
        self.batches = list(batches)
        self.outputs: list[StepOutput] = []
        self.waits: list[bool] = []

    def receive(self, wait: bool) -> list[Command] | None:
        self.waits.append(wait)
        if self.batches:
            return self.batches.pop(0)
        return [] if not wait else None  # nothing left to say: run until idle, then the client is gone

    def send(self, out: StepOutput) -> None:
        self.outputs.append(out)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    from tiny_model import make_tiny_model_dir

    return LLMEngine.from_args(str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))), **KW)


def ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_the_loop_runs_requests_to_the_end_and_counts_what_it_took_in(engine: LLMEngine) -> None:
    core = EngineCore(engine)
    chan = Script([AddRequest("a", GREEDY, ids(engine, "Hello there")), AddRequest("b", GREEDY, ids(engine, "Hi"))])
    core.run(chan)
    deltas = [d for out in chan.outputs for d in out.deltas]
    for rid in ("a", "b"):
        mine = [d for d in deltas if d.request_id == rid]
        assert sum(len(d.token_ids) for d in mine) == 6 and mine[-1].request_finished
    assert chan.outputs[-1].adds_seen == 2 and chan.outputs[-1].stats is not None
    assert chan.outputs[-1].stats.requests_running == 0
    assert all(out.heartbeat > 0 for out in chan.outputs)
    assert chan.waits[0] and not all(chan.waits)  # it blocks only when it has nothing to run


def test_calls_get_replies_and_a_refused_add_fails_its_request_alone(engine: LLMEngine) -> None:
    core = EngineCore(engine)
    prefix = ids(engine, "You are a tutor. " * 6)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    chan = Script([AddRequest("p", GREEDY, prefix)], [Pin("persona:t", prefix, "c1")],
                  [AddRequest(f"q{i}", long, [1, 2, 3]) for i in range(4)] + [Abort("q0", "c2"), WantSnapshot()],
                  [Unpin("persona:t"), Abort("nobody", "c3")])
    core.run(chan)
    replies = {r.call_id: r for out in chan.outputs for r in out.replies}
    assert replies["c1"].result == len(prefix) // 16 * 16 and replies["c1"].error is None
    assert {"c2", "c3"} <= set(replies)
    errors = [e for out in chan.outputs for e in out.errors]
    # max_waiting is 2: of four adds in one batch, the ones past the queue fail with QueueFullError, alone.
    assert errors and all(e.kind == "QueueFullError" for e in errors)
    assert any(out.snapshot is not None and "persona:t" in out.snapshot.pins for out in chan.outputs)
    aborted = [d for out in chan.outputs for d in out.deltas if d.request_id == "q0"]
    assert aborted[-1].finish_reason == "abort"
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_shutdown_aborts_what_runs_and_says_so(engine: LLMEngine) -> None:
    core = EngineCore(engine)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    chan = Script([AddRequest("x", long, [1, 2, 3])], [], [Shutdown(), AddRequest("never", GREEDY, [1])])
    core.run(chan)
    last = [d for d in chan.outputs[-1].deltas if d.request_id == "x"]
    assert last and last[-1].request_finished and last[-1].finish_reason == "abort"
    assert not any(d.request_id == "never" for out in chan.outputs for d in out.deltas)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_a_lost_shard_fails_every_open_request_and_ends_the_loop(engine: LLMEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.distributed import RankDiedError

    core = EngineCore(engine)
    chan = Script([AddRequest("y", GREEDY, [1, 2, 3])])

    def die() -> list[object]:
        raise RankDiedError("rank 1 exited with code 1")

    monkeypatch.setattr(engine, "step", die)
    with pytest.raises(RankDiedError):
        core.run(chan)
    errors = [e for out in chan.outputs for e in out.errors]
    assert [(e.request_id, e.kind) for e in errors] == [("y", "EngineDeadError")]
    monkeypatch.undo()
    engine.abort_request("y")
