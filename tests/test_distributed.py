"""The tensor-parallel engine over real gloo ranks (``python -m engine.tp_rank`` processes): greedy output
identical to one process in float32 (batched, prefix caching, swap and recompute preemption; TP=2 on the tiny
model, TP=3 on SmolLM2-135M), from a script file, from stdin and under torchrun; the same block tables on every
rank after every step and none left at idle; the error for sizes that do not split the heads; a rank that
dies, on the way up or later, taking the engine down at once with its error instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timing import scaled
from tiny_model import make_tiny_model_dir

from engine import tp_group
from engine.config import EngineConfig
from engine.distributed import DriverRunner, RankDiedError
from engine.engine import LLMEngine
from engine.engine_process import ProcessEngine
from engine.protocol import EngineDeadError
from engine.request import SamplingParams

PROMPTS = [
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "what is the capital of France?",
    "user assistant system",
    "0123456789 " * 5,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama")  # 4 query / 2 KV heads


def _engine(model: Path | None, **kw: object) -> LLMEngine:
    settings: dict[str, object] = {"num_kv_blocks": 256, "block_size": 4, "dtype": "float32", **kw}
    return LLMEngine(EngineConfig(model=str(model) if model else None, **settings))  # type: ignore[arg-type]


def _close(engine: LLMEngine) -> None:
    if isinstance(engine.runner, DriverRunner):
        engine.runner.close()


def _check_tables(engine: LLMEngine) -> None:
    """Every rank holds the block tables rank 0's block manager has for the running sequences."""
    runner = engine.runner
    assert isinstance(runner, DriverRunner)
    views = runner.rank_tables()
    assert [v.rank for v in views] == list(range(engine.config.tensor_parallel_size))
    for view in views[1:]:
        assert view.tables == views[0].tables
        assert view.kv_cache_shape == views[0].kv_cache_shape and view.cpu_cache_shape == views[0].cpu_cache_shape
    for group in engine.scheduler.running:
        for seq in group.seqs:
            if seq.seq_id in views[0].tables:
                assert views[0].tables[seq.seq_id] == engine.block_manager.block_table(seq)


def _check_idle(engine: LLMEngine) -> None:
    assert isinstance(engine.runner, DriverRunner)
    assert all(view.tables == {} for view in engine.runner.rank_tables())
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.cpu_blocks_free == stats.cpu_blocks_total


def _generate(engine: LLMEngine, prompts: list[str], params: SamplingParams, tag: str,
              check_tables: bool = False) -> list[list[int]]:
    groups = [engine.add_request(f"{tag}-{i}", params, prompt=p) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
        if check_tables:
            _check_tables(engine)
    return [g.seqs[0].output_token_ids for g in groups]


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    return _generate(_engine(tiny_dir), PROMPTS, GREEDY, "ref")


@pytest.fixture
def tp2(tiny_dir: Path) -> Iterator[LLMEngine]:
    engine = _engine(tiny_dir, tensor_parallel_size=2)  # one at a time: a process has one process group
    yield engine
    _close(engine)


def test_tp2_matches_one_process_batched_and_from_the_prefix_cache(tp2: LLMEngine,
                                                                   reference: list[list[int]]) -> None:
    assert tp2.runner.kv_cache.shape[-2] == 1  # one of the tiny model's two KV heads per rank
    assert _generate(tp2, PROMPTS, GREEDY, "first", check_tables=True) == reference
    hits = tp2.stats().prefix_cache_hit_tokens
    assert _generate(tp2, PROMPTS, GREEDY, "second", check_tables=True) == reference
    assert tp2.stats().prefix_cache_hit_tokens > hits
    _check_idle(tp2)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_preemption_keeps_greedy_output_and_a_dead_rank_stops_the_engine(
        tiny_dir: Path, reference: list[list[int]], mode: str) -> None:
    engine = _engine(tiny_dir, tensor_parallel_size=2, num_kv_blocks=32, max_model_len=128, preemption_mode=mode,
                     max_num_batched_tokens=64)
    try:
        assert _generate(engine, PROMPTS, GREEDY, mode, check_tables=True) == reference
        assert getattr(engine.stats(), f"preemptions_{mode}") > 0
        _check_idle(engine)
        # Then rank 1 dies while the engine idles: the next step raises instead of waiting on it.
        assert isinstance(engine.runner, DriverRunner) and engine.runner.ranks.procs
        worker = engine.runner.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        engine.add_request("after", GREEDY, prompt=PROMPTS[0])
        started = time.monotonic()
        with pytest.raises(RankDiedError, match="rank 1 exited"):
            engine.step()
        with pytest.raises(RankDiedError):  # and every step after it, at once
            engine.step()
        assert time.monotonic() - started < 10
    finally:
        _close(engine)


@pytest.mark.long
def test_tp3_smollm2_matches_one_process() -> None:
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = _generate(_engine(None, num_kv_blocks=64, block_size=16), prompts, params, "one")
    engine = _engine(None, num_kv_blocks=64, block_size=16, tensor_parallel_size=3)
    try:
        assert engine.runner.kv_cache.shape[-2] == 1  # SmolLM2's 3 KV heads, one per rank
        assert _generate(engine, prompts, params, "tp3", check_tables=True) == alone
        _check_idle(engine)
    finally:
        _close(engine)


def test_sizes_that_do_not_split_the_heads_are_refused_before_any_rank_starts(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="valid sizes: 1, 2"):
        _engine(tiny_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"9 query heads, 3 KV heads.*valid sizes: 1, 3"):
        _engine(None, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_a_rank_that_dies_on_the_way_up_fails_the_start_at_once_with_its_own_error(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rank prints before it dies (here: a rank that cannot even start) is the caller's error, at once,
    not a rendezvous timeout."""
    monkeypatch.setattr(tp_group, "rank_command",
                        lambda: [sys.executable, "-c", "raise RuntimeError('rank cannot start here')"])
    started = time.monotonic()
    with pytest.raises(RankDiedError, match=r"(?s)rank 1 exited with code 1.*RuntimeError: rank cannot start here"):
        _engine(tiny_dir, tensor_parallel_size=2)
    assert time.monotonic() - started < 20


def test_an_engine_on_a_launched_rank_other_than_0_refuses_instead_of_becoming_a_worker(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 .*-m engine\.tp_rank"):
        _engine(tiny_dir, tensor_parallel_size=2)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="differs from the launcher's WORLD_SIZE 2"):
        _engine(tiny_dir, tensor_parallel_size=4)


STDIN_SCRIPT = """
from engine.llm import LLM
from engine.request import SamplingParams

llm = LLM(model={model!r}, dtype="float32", num_kv_blocks=256, block_size=4, tensor_parallel_size=2)
out = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
print("tokens", [o.outputs[0].token_ids for o in out], flush=True)
"""


@pytest.mark.long
@pytest.mark.timeout(120)
def test_a_script_piped_on_stdin_starts_its_ranks(tiny_dir: Path, reference: list[list[int]],
                                                  tmp_path: Path) -> None:
    """No script file, no main guard, another working directory: the ranks start all the same (a rank never
    imports the caller's ``__main__``), and TP=2 gives TP=1's greedy tokens."""
    script = STDIN_SCRIPT.format(model=str(tiny_dir), prompts=PROMPTS[:2])
    proc = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(110))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("tokens")] == [f"tokens {reference[:2]}"]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_engine_process_with_ranks_serves_and_goes_down_whole_when_a_rank_dies(
        tiny_dir: Path, reference: list[list[int]]) -> None:
    # max_deaths=1: no restart (ProcessEngine's own tests cover restarting); this one checks the way down.
    engine = ProcessEngine.from_args(str(tiny_dir), max_deaths=1, dtype="float32", num_kv_blocks=256,
                                     block_size=4, tensor_parallel_size=2, engine_threads=2)
    await engine.start()
    try:
        deltas = [d async for d in engine.generate("tp", GREEDY, prompt=PROMPTS[0])]
        assert [t for d in deltas for t in d.token_ids] == reference[0]
        (rank1,) = _children(engine.pid)  # the engine process (rank 0) spawned rank 1
        stream = engine.generate("killed", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                 prompt=PROMPTS[1])
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert _gone(engine.pid, scaled(20))  # the engine process exited on RankDiedError
        deadline = time.monotonic() + scaled(20)
        while engine.state != "failed" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.state == "failed" and not engine.is_running
    finally:
        await engine.stop()


TORCHRUN_SCRIPT = """
import os, sys
from engine.llm import LLM
from engine.request import SamplingParams

llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=256, block_size=4, tensor_parallel_size=2)
out = llm.generate(sys.argv[2:], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
print("tokens", os.environ["RANK"], [o.outputs[0].token_ids for o in out], flush=True)
"""


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_same_code_runs_under_torchrun(tiny_dir: Path, reference: list[list[int]], tmp_path: Path) -> None:
    """torchrun starts both ranks (env:// rendezvous) through the rank entry module: rank 0 runs the script and
    generates, rank 1 serves its shard without ever running the script, and exits when rank 0's engine is gone."""
    script = tmp_path / "generate.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(port), "-m", "engine.tp_rank",
                           str(script), str(tiny_dir), *PROMPTS[:2]], env=env, capture_output=True, text=True,
                          timeout=scaled(280))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("tokens")]
    assert lines == [f"tokens 0 {reference[:2]}"]  # rank 1 never ran the script
