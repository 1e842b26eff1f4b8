"""Beam search on the real model (SmolLM2-135M-Instruct, float32): the same beams, in the same order, as
transformers' ``generate(num_beams=k, do_sample=False, num_return_sequences=k)`` with the same length
penalty and early stopping; the beams share their prefix blocks and give every block back; preemption
(swap and recompute) does not change the answer.

Where the two ever part, the reference must score the differing beams within 1e-4 of each other at that
rank: a near-tie that float32 summation order can legitimately flip (as the greedy parity tests allow).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from model_fixtures import hf_reference  # noqa: F401

from engine.beam import EarlyStopping
from engine.llm import LLM
from engine.request import SamplingParams

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Give me a name for a pet turtle.",
]
# (beams, length_penalty, early_stopping)
SETTINGS: list[tuple[int, float, EarlyStopping]] = [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")]


@pytest.fixture(scope="module")
def reference(hf_reference: Any) -> Any:  # noqa: F811
    return hf_reference


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # One engine thread, for the reason of _one_thread; the process's setting is restored afterwards.
    threads = torch.get_num_threads()
    yield LLM(dtype="float32", num_kv_blocks=256, engine_threads=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def four_beams(llm: LLM, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Each prompt's four beams (length penalty 1, early stopping off) with plenty of blocks."""
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params(4, 1.0, False))
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _params(k: int, length_penalty: float, early_stopping: EarlyStopping) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=k, n=k, max_tokens=MAX_TOKENS,
                          length_penalty=length_penalty, early_stopping=early_stopping)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The reference runs on one thread: on a machine shared with other work, torch's OpenMP threads wait
    on each other at every small matmul and transformers' beam search runs twenty times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference_beams(reference: Any, prompt: list[int], eos: frozenset[int], k: int, length_penalty: float,
                     early_stopping: EarlyStopping) -> tuple[list[list[int]], list[float]]:
    with torch.inference_mode(), _one_thread():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, num_beams=k, num_return_sequences=k,
                                 length_penalty=length_penalty, early_stopping=early_stopping,
                                 eos_token_id=sorted(eos), return_dict_in_generate=True, output_scores=True)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        beams.append(row if end is None else row[: end + 1])
    return beams, out.sequences_scores.tolist()


def _score(reference: Any, prompt: list[int], beam: list[int], length_penalty: float) -> float:
    """The reference's beam score of ``beam``: summed log-probabilities / length ** length_penalty."""
    with torch.inference_mode(), _one_thread():
        logits = reference(torch.tensor([prompt + beam])).logits[0, len(prompt) - 1 : -1].float()
    logprob = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(beam).unsqueeze(1)).sum()
    return float(logprob) / len(beam) ** length_penalty


def _assert_same_beams(reference: Any, prompt: list[int], want: tuple[list[list[int]], list[float]],
                       got: list[list[int]], length_penalty: float) -> None:
    beams, scores = want
    assert len(got) == len(beams)
    for rank, (w, g, s) in enumerate(zip(beams, got, scores, strict=True)):
        if w == g:
            continue
        gap = abs(_score(reference, prompt, g, length_penalty) - s)
        assert gap < 1e-4, f"beam {rank} differs ({g} vs {w}) and its score is {gap} away: not a near-tie"


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"), SETTINGS)
def test_beams_match_transformers(llm: LLM, reference: Any, prompts: list[list[int]], k: int,
                                  length_penalty: float, early_stopping: EarlyStopping) -> None:
    eos = llm.engine.eos_token_ids
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params(k, length_penalty, early_stopping))
    for prompt, out in zip(prompts, outs, strict=True):
        assert [o.index for o in out.outputs] == list(range(k)) and out.finished
        want = _reference_beams(reference, prompt, eos, k, length_penalty, early_stopping)
        _assert_same_beams(reference, prompt, want, [o.token_ids for o in out.outputs], length_penalty)
        for o in out.outputs:
            assert o.finish_reason == ("stop" if o.token_ids[-1] in eos else "length")
            assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_n_best_of_k_are_the_first_n_beams(llm: LLM, prompts: list[list[int]],
                                          four_beams: list[list[list[int]]]) -> None:
    two = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
        use_beam_search=True, best_of=4, n=2, max_tokens=MAX_TOKENS))[0]
    assert [o.token_ids for o in two.outputs] == four_beams[0][:2]


def test_beams_share_prefix_blocks_and_copy_only_the_last(llm: LLM, prompts: list[list[int]]) -> None:
    """Step by step: beams whose full blocks hold the same tokens hold the same physical blocks (the prompt's
    at least); copy-on-write copies the partial block a diverging beam writes into; when the search ends
    every block is free again."""
    engine = llm.engine
    bm = engine.block_manager
    bs = bm.block_size
    copies: list[tuple[int, int]] = []
    execute = engine.runner.execute_block_plans

    def record(out: Any) -> None:
        copies.extend(out.blocks_to_copy)
        execute(out)

    engine.runner.execute_block_plans = record  # type: ignore[method-assign]
    try:
        group = engine.add_request("share", _params(4, 1.0, "never"), prompt_token_ids=prompts[1])
        prompt_blocks = len(prompts[1]) // bs
        saved = []
        while engine.has_unfinished():
            engine.step()
            if group.is_finished or len(group.seqs) < 2:
                continue
            tables = {s.seq_id: bm.block_table(s) for s in group.seqs}
            for a in group.seqs:
                for b in group.seqs:
                    full = min(a.num_computed_tokens, b.num_computed_tokens) // bs
                    for j in range(full):
                        if a.token_ids[j * bs : (j + 1) * bs] == b.token_ids[j * bs : (j + 1) * bs]:
                            assert tables[a.seq_id][j] == tables[b.seq_id][j], f"block {j} not shared"
            held = {blk for t in tables.values() for blk in t}
            assert len(held) <= prompt_blocks + sum(len(t) - prompt_blocks for t in tables.values())
            saved.append(1 - len(held) / sum(len(t) for t in tables.values()))
            bm.check_invariants()
    finally:
        engine.runner.execute_block_plans = execute  # type: ignore[method-assign]
    assert saved and min(saved) > 0
    assert copies, "diverging beams inside a partial block must copy it"
    assert len({dst for _, dst in copies}) == len(copies)
    assert bm.device.num_free == bm.device.num_blocks
    bm.check_invariants()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_the_beams(mode: str, prompts: list[list[int]], four_beams: list[list[list[int]]]) -> None:
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    tiny = LLM(dtype="float32", num_kv_blocks=4 * -(-longest // 16) + 2, max_model_len=longest + 16,
               preemption_mode=mode, max_num_batched_tokens=64, engine_threads=1)
    outs = tiny.generate(prompt_token_ids=prompts, sampling_params=_params(4, 1.0, False))
    stats = tiny.stats()
    assert getattr(stats, f"preemptions_{mode}") > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert [[o.token_ids for o in out.outputs] for out in outs] == four_beams


def test_a_beam_search_streams_its_beams_whole_at_the_end(llm: LLM, prompts: list[list[int]],
                                                          four_beams: list[list[list[int]]]) -> None:
    engine = llm.engine
    engine.add_request("whole", _params(4, 1.0, False), prompt_token_ids=prompts[0])
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    assert all(not deltas for deltas in steps[:-1]) and len(steps) > MAX_TOKENS // 2
    final = steps[-1]
    assert [d.index for d in final] == [0, 1, 2, 3] and [d.request_finished for d in final] == [0, 0, 0, 1]
    assert [d.token_ids for d in final] == four_beams[0] and all(d.finished for d in final)
    assert [d.text for d in final] == [llm.tokenizer.decode(t, skip_special_tokens=True) for t in four_beams[0]]
    assert [d.completion_tokens for d in final] == [len(t) for t in four_beams[0]]


def test_an_aborted_beam_search_returns_its_best_beams_so_far(llm: LLM, prompts: list[list[int]]) -> None:
    engine = llm.engine
    engine.add_request("cut", _params(4, 1.0, False), prompt_token_ids=prompts[0])
    for _ in range(4):
        engine.step()
    deltas = engine.abort_request("cut")
    assert [d.index for d in deltas] == [0, 1, 2, 3] and deltas[-1].request_finished
    assert all(d.finish_reason in ("abort", "stop") and d.token_ids for d in deltas)
    assert any(d.finish_reason == "abort" for d in deltas)
    assert engine.block_manager.device.num_free == engine.block_manager.device.num_blocks
