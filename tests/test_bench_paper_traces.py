"""benchmarks/paper/traces.py: the paper's latency traces (ShareGPT, Alpaca-like, chatbot) and Poisson
arrivals, on made-up prompts (the real ones need the tokenizer; tests/test_bench_paper_latency.py runs them)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "paper"))

from traces import (  # noqa: E402
    PAPER_ALPACA_INPUT_MEAN,
    PAPER_ALPACA_OUTPUT_MEAN,
    alpaca_like_trace,
    chatbot_trace,
    lognormal_lengths,
    poisson_arrivals,
    sharegpt_trace,
)

PROMPTS = [[(i * 31 + j) % 1000 + 1 for j in range(20 + 7 * i)] for i in range(60)]


def test_lognormal_lengths_have_the_stated_mean_and_bounds() -> None:
    lengths = lognormal_lengths(random.Random(1), 20_000, 58.45, 1, 10_000)
    assert statistics.mean(lengths) == pytest.approx(58.45, rel=0.03)
    clipped = lognormal_lengths(random.Random(1), 2_000, 58.45, 10, 80)
    assert min(clipped) == 10 and max(clipped) == 80
    with pytest.raises(ValueError):
        lognormal_lengths(random.Random(1), 1, 5, 9, 8)


def test_alpaca_like_trace_matches_the_papers_means() -> None:
    trace = alpaca_like_trace(PROMPTS, 5_000, seed=3)
    assert statistics.mean(len(r.prompt_ids) for r in trace) == pytest.approx(PAPER_ALPACA_INPUT_MEAN, rel=0.08)
    assert statistics.mean(r.output_tokens for r in trace) == pytest.approx(PAPER_ALPACA_OUTPUT_MEAN, rel=0.05)
    source = {tuple(p) for p in PROMPTS}
    # Each prompt is the tail of a real prompt.
    assert all(any(p[len(p) - len(r.prompt_ids):] == r.prompt_ids for p in source) for r in trace[:50])


def test_sharegpt_trace_fits_the_context_and_is_reproducible() -> None:
    trace = sharegpt_trace(PROMPTS, 500, output_mean=40, max_output=100, max_model_len=300, seed=5)
    assert all(r.total_tokens <= 300 and 1 <= r.output_tokens <= 100 for r in trace)
    assert trace == sharegpt_trace(PROMPTS, 500, output_mean=40, max_output=100, max_model_len=300, seed=5)
    assert trace != sharegpt_trace(PROMPTS, 500, output_mean=40, max_output=100, max_model_len=300, seed=6)
    with pytest.raises(ValueError, match="no prompt fits"):
        sharegpt_trace(PROMPTS, 1, output_mean=4, max_output=300, max_model_len=300, seed=5)


def test_chatbot_prompts_are_the_last_context_tokens_of_a_conversation() -> None:
    trace = chatbot_trace(PROMPTS, 200, context=256, output_mean=30, max_output=64, seed=2)
    assert max(len(r.prompt_ids) for r in trace) == 256
    for r in trace[:20]:  # the history ends with a whole user turn (or the tail of a long one)
        assert any(r.prompt_ids[-min(len(p), 256):] == tuple(p[-256:]) for p in PROMPTS)


def test_poisson_arrivals_have_the_rate_and_a_floor() -> None:
    times = poisson_arrivals(5.0, 400.0, seed=0)
    assert times == sorted(times) and times[-1] <= 400.0
    assert len(times) / 400.0 == pytest.approx(5.0, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(statistics.stdev(gaps), rel=0.1)  # exponential: mean = sd
    assert len(poisson_arrivals(0.01, 1.0, seed=0, min_requests=4)) == 4
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 1.0, seed=0)
