"""``preemption_mode="auto"`` on the real model in float32: whichever mode it picks per preempted request,
greedy output stays equal to transformers' (to a near-tie, as in test_llm). The pool is sized as test_llm's
forced-preemption case: room for the longest request and little else.

On this CPU a swap round trip of a block (~0.7 MB of float32 KV) costs well under a millisecond against
several milliseconds to prefill its 16 tokens again, so with CPU room auto swaps; without it, it must recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from model_fixtures import hf_greedy, hf_reference  # noqa: F401
from test_llm import MAX_TOKENS, _assert_parity, _conversations

from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_files import load_tokenizer
from engine.request import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(hf_reference: Any) -> Any:  # noqa: F811
    return hf_reference


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer, _ = load_tokenizer()
    convs = _conversations()
    # The long prompt and four short ones: enough to oversubscribe the small pool.
    return [tokenizer.apply_chat_template(c) for c in convs[:4] + convs[-1:]]


@pytest.fixture(scope="module")
def expected(hf_greedy: Callable[[list[int], int], list[int]],  # noqa: F811
             prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(ids, MAX_TOKENS) for ids in prompts]


def _run_small_pool(prompts: list[list[int]], **settings: Any) -> tuple[list[list[int]], dict[str, Any]]:
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 4
    llm = LLM(dtype="float32", num_kv_blocks=blocks, max_model_len=longest + 16, max_num_batched_tokens=256,
              **settings)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0,
                                                                                 max_tokens=MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outs], llm.stats()


def test_auto_is_the_default() -> None:
    assert EngineConfig().preemption_mode == "auto"


def test_auto_swaps_when_cheaper_and_matches(reference: Any, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    got, stats = _run_small_pool(prompts)  # the default mode
    assert stats.preemptions_swap > 0, stats
    assert 0 < stats.swap_seconds_per_block < 16 * stats.prefill_seconds_per_token, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.cpu_blocks_free == stats.cpu_blocks_total
    for ids, want, tokens in zip(prompts, expected, got, strict=True):
        _assert_parity(reference, ids, want, tokens)


def test_auto_recomputes_without_swap_space_and_matches(reference: Any, prompts: list[list[int]],
                                                        expected: list[list[int]]) -> None:
    got, stats = _run_small_pool(prompts, preemption_mode="auto", swap_space_mb=0)
    assert stats.preemptions_recompute > 0 and stats.preemptions_swap == 0, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total
    for ids, want, tokens in zip(prompts, expected, got, strict=True):
        _assert_parity(reference, ids, want, tokens)
