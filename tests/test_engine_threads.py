"""ThreadGovernor: the thread count each step runs on, chosen from measured step times."""

from __future__ import annotations

import pytest

from engine.threads import ThreadGovernor


def run(gov: ThreadGovernor, tokens: int, now: float, seconds_by_threads: dict[int, float]) -> int:
    """One step: the governor chooses, the step takes what the machine gives that count; returns the count."""
    n = gov.choose(tokens, now)
    gov.observe(n, tokens, seconds_by_threads[n], now + seconds_by_threads[n])
    return n


def test_a_new_step_size_runs_on_all_threads_then_tries_one_fewer() -> None:
    gov = ThreadGovernor(2)
    assert run(gov, 32, 0.0, {2: 0.05, 1: 0.09}) == 2
    assert run(gov, 32, 0.1, {2: 0.05, 1: 0.09}) == 1
    # 2 threads measured faster: they keep running until the retry interval of 1 thread has passed, and
    # that retry lost (1.8x), so the interval doubled to 2 s from its measurement at 0.19 s.
    assert [run(gov, 32, 0.2 + 0.1 * i, {2: 0.05, 1: 0.09}) for i in range(20)] == [2] * 20
    assert run(gov, 32, 2.2, {2: 0.05, 1: 0.09}) == 1


def test_on_a_busy_machine_one_fewer_thread_wins_and_stays() -> None:
    gov = ThreadGovernor(2)
    busy = {2: 0.25, 1: 0.04}
    counts = [run(gov, 32, 0.3 * i, busy) for i in range(20)]
    assert counts[:2] == [2, 1]
    # After the first retry of 2 threads loses, retries come ever further apart (1, 2, 4, ... s).
    assert counts.count(2) <= 4
    assert counts[-1] == 1


def test_contention_arriving_switches_at_once_from_the_rising_figure() -> None:
    gov = ThreadGovernor(2)
    quiet, busy = {2: 0.05, 1: 0.09}, {2: 0.30, 1: 0.10}
    t = 0.0
    for _ in range(6):
        run(gov, 32, t, quiet)
        t += 0.1
    assert gov.choose(32, t) == 2
    gov.observe(2, 32, busy[2], t + busy[2])
    t += 0.3
    # The moving average of 2 threads is now above 1 thread's (older) figure: no need to wait for a retry.
    assert [run(gov, 32, t + 0.1 * i, busy) for i in range(3)][-1] == 1


def test_one_slow_step_moves_nothing_two_in_a_row_do() -> None:
    # A client's burst or a page-fault storm slows one step: the figure follows the median of the last three
    # steps, so the engine does not drop to one thread for a whole retry interval because of it.
    gov = ThreadGovernor(2)
    quiet = {2: 0.05, 1: 0.09}
    t = 0.0
    for _ in range(6):
        run(gov, 32, t, quiet)
        t += 0.1
    two = gov._figures[(gov.group(32), 2)]
    before = two.seconds
    assert run(gov, 32, t, {2: 0.5, 1: 0.09}) == 2
    assert two.seconds == pytest.approx(before)
    assert gov.choose(32, t + 0.6) == 2
    gov.observe(2, 32, 0.5, t + 1.1)  # the second slow step in a row: now it counts
    assert two.seconds > 0.09 * gov.margin
    assert gov.choose(32, t + 1.2) == 1


def test_a_count_within_the_margin_does_not_take_over() -> None:
    # Figures within noise of each other (1-thread 5% faster here) leave the running count as it is.
    gov = ThreadGovernor(2, margin=1.1)
    close = {2: 0.100, 1: 0.095}
    assert [run(gov, 32, 0.2 * i, close) for i in range(4)] == [2, 1, 2, 2]
    faster = {2: 0.100, 1: 0.080}
    assert run(gov, 32, 2.0, faster) == 1  # a retry 1.25x faster: it takes over
    # (the first step after it retries 2 threads, measured long ago; that retry loses)
    assert [run(gov, 32, 2.2 + 0.1 * i, faster) for i in range(6)] == [2, 1, 1, 1, 1, 1]


def test_a_retry_that_loses_at_all_backs_off() -> None:
    # One thread 1.15x slower: every retry costs a slower step, so they come ever further apart.
    gov = ThreadGovernor(2, retry_s=1.0, max_retry_s=16.0)
    speeds = {2: 0.070, 1: 0.080}
    counts = [run(gov, 64, 0.1 * i, speeds) for i in range(300)]  # 30 s of steps
    assert counts[:2] == [2, 1]
    assert counts.count(1) <= 6  # retries after 2, 4, 8, 16 s (not one every second)
    assert gov._interval[(gov.group(64), 1)] == 16.0


def test_sizes_are_measured_apart() -> None:
    gov = ThreadGovernor(2)
    for i in range(4):  # decode steps: one thread is faster (the machine is busy)
        run(gov, 32, 0.01 * i, {2: 0.2, 1: 0.05})
    # A first prefill chunk is a size never seen: all threads, whatever decode steps measured.
    assert gov.choose(2048, 0.1) == 2
    assert gov.group(32) == gov.group(63) != gov.group(64)


def test_prefill_sized_steps_always_run_on_all_threads() -> None:
    # A retry on one thread would be a whole prefill chunk at half speed, which every request of the chunk
    # waits for: large steps are never retried, even when a smaller size measured one thread faster.
    gov = ThreadGovernor(2, all_threads_from=512)
    busy = {2: 0.9, 1: 0.3}
    assert [run(gov, 2048, 0.5 * i, busy) for i in range(10)] == [2] * 10
    assert [run(gov, 511, 10 + 0.5 * i, busy) for i in range(2)] == [2, 1]
    assert gov.choose(512, 20.0) == 2
    assert all("2048" not in key for key in gov.stats())


def test_steps_carrying_a_prompt_run_the_faster_count_and_never_retry() -> None:
    # A retry there delays the prompts' first tokens and every decode's next one: only decode-only steps
    # of the size retry the slower count.
    gov = ThreadGovernor(2, retry_s=1.0)
    quiet = {2: 0.15, 1: 0.30}
    assert [run(gov, 300, 0.5 * i, quiet) for i in range(2)] == [2, 1]  # new size: both counts measured
    for i in range(6):  # the one-thread figure is long stale, yet prompt-carrying steps stay on 2 threads
        n = gov.choose(300, 10.0 + i, prefill=True)
        gov.observe(n, 300, quiet[n], 10.0 + i + quiet[n])
        assert n == 2
    assert gov.choose(300, 20.0) == 1  # a decode-only step of the size is the retry
    # With no figure for a size yet, a prompt-carrying step runs on all threads.
    assert gov.choose(40, 30.0, prefill=True) == 2


def test_a_winning_retry_resets_the_interval() -> None:
    gov = ThreadGovernor(2, retry_s=1.0, max_retry_s=8.0)
    t = 0.0
    for _ in range(40):  # busy: 2 threads' retries lose, their interval grows to 8 s
        run(gov, 32, t, {2: 0.3, 1: 0.05})
        t += 0.5
    assert gov._interval[(gov.group(32), 2)] == 8.0
    # The machine quiets down: the next retry of 2 threads wins and 2 threads run from then on.
    counts = [run(gov, 32, t + 0.1 * i, {2: 0.04, 1: 0.05}) for i in range(100)]
    first = counts.index(2)
    assert all(n == 2 for n in counts[first:first + 8])
    assert gov._interval[(gov.group(32), 2)] == 1.0


def test_one_thread_has_nothing_to_choose() -> None:
    gov = ThreadGovernor(1)
    assert [run(gov, 32, 0.1 * i, {1: 0.1}) for i in range(5)] == [1] * 5
    assert gov.switches == 0
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0)


def test_stats_name_size_and_thread_count() -> None:
    gov = ThreadGovernor(2)
    run(gov, 32, 0.0, {2: 0.05, 1: 0.09})
    run(gov, 32, 0.1, {2: 0.05, 1: 0.09})
    assert gov.stats() == {"32+ tokens/1 threads": 90.0, "32+ tokens/2 threads": 50.0}
    assert gov.switches == 1


def test_governor_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine.threads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_real_model_gives_the_same_tokens_with_adaptive_threads() -> None:
    """Steps alternate between 2 threads and 1 (every size is retried on one fewer); greedy float32 output is
    that of a fixed thread count. The fixed engine runs one thread: two fixed threads beside another busy
    process wait on each other at every barrier (the stall adaptive threads exist for), several times slower."""
    import torch

    from engine.llm import LLM
    from engine.request import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fixed = LLM(dtype="float32", num_kv_blocks=128, engine_threads=1, adaptive_threads=False)
    want = [o.outputs[0].token_ids for o in fixed.generate(prompts, params)]
    adaptive = LLM(dtype="float32", num_kv_blocks=128, engine_threads=2, adaptive_threads=True)
    got = [o.outputs[0].token_ids for o in adaptive.generate(prompts, params)]
    stats = adaptive.engine.stats()
    torch.set_num_threads(2)
    assert got == want
    assert stats.step_thread_switches >= 1 and stats.step_threads in (1, 2)
