"""engine/grammar_masks.py on the real tokenizer (SmolLM2's 49,152 tokens): the filler's masks equal each state's
own, the ceilings block exactly what the bitmask blocks (and the padded columns), applying them touches only
the grammar rows and leaves allowed logits bit for bit, and the filler's thread runs at a lower priority."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine.grammar import GrammarCompiler, GrammarSpec
from engine.grammar_masks import MaskFiller, allocate_bitmask, apply_bitmask, apply_ceilings, token_ceilings
from engine.model_files import load_tokenizer
from engine.tokenizer import Tokenizer

PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok, _ = load_tokenizer()
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    _, config = load_tokenizer()
    return GrammarCompiler.from_hf(tokenizer.hf, config.vocab_size, tokenizer.eos_token_ids)


@pytest.fixture
def filler(compiler: GrammarCompiler) -> Iterator[MaskFiller]:
    masks = MaskFiller(compiler.vocab_size)
    yield masks
    masks.close()


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask's rows as booleans, by shifts: a reading independent of the byte table under test."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def test_ceilings_block_exactly_what_the_bitmask_blocks() -> None:
    vocab = 1000  # not a multiple of 32: the last word's spare bits are set, and still blocked
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(3, 32), dtype=np.int64).astype(np.int32)
    bitmask = torch.from_numpy(words)
    ceilings = token_ceilings(bitmask, vocab)
    assert ceilings.shape == (3, 1024) and ceilings.dtype == torch.float32
    allowed = _allowed(bitmask, vocab)
    assert torch.equal(ceilings[:, :vocab] == float("inf"), allowed)
    assert bool(torch.isneginf(ceilings[:, :vocab][~allowed]).all())
    assert bool(torch.isneginf(ceilings[:, vocab:]).all())
    with pytest.raises(ValueError, match="int32"):
        token_ceilings(bitmask.to(torch.int64), vocab)


def test_filler_masks_equal_each_states_own(compiler: GrammarCompiler, tokenizer: Tokenizer,
                                            filler: MaskFiller) -> None:
    vocab = compiler.vocab_size
    states = {1: compiler.state(GrammarSpec.json_schema(PERSON)), 3: compiler.state(GrammarSpec.json_object())}
    for token in tokenizer.encode('{"name": "Al'):
        assert states[1].accept(token)
    bitmask = allocate_bitmask(4, vocab)
    filler.fill_bitmask(bitmask, states)
    one_by_one = allocate_bitmask(4, vocab)
    for row, state in states.items():
        state.fill(one_by_one, row)
    assert torch.equal(bitmask, one_by_one)
    assert bool((bitmask[[0, 2]] == -1).all())  # rows without a grammar were not written
    # The prefetch path: a row per state, in order, the same tokens allowed.
    ceilings = filler.ceilings([states[3], states[1]]).result(timeout=30)
    assert torch.equal(ceilings, token_ceilings(one_by_one[[3, 1]].contiguous(), vocab))
    # Inside the person's name a quote may follow, not a raw newline; an object starts with a brace, not a
    # bracket.
    assert ceilings[1, tokenizer.encode('"')[0]] == float("inf")
    assert ceilings[1, tokenizer.encode("\n")[0]] == float("-inf")
    assert ceilings[0, tokenizer.encode("{")[0]] == float("inf")
    assert ceilings[0, tokenizer.encode("[")[0]] == float("-inf")


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3]], ids=["some rows", "every row"])
def test_applying_touches_only_grammar_rows_and_keeps_allowed_logits(compiler: GrammarCompiler,
                                                                     filler: MaskFiller, rows: list[int]) -> None:
    vocab = compiler.vocab_size
    specs = [GrammarSpec.json_schema(PERSON), GrammarSpec.json_object()]
    states = [compiler.state(specs[i % 2]) for i in range(len(rows))]
    ceilings = filler.ceilings(states).result(timeout=30)
    # bf16 logits, wider than the vocabulary (a padded LM head), with a -0.0 that must stay -0.0.
    logits = torch.randn(4, vocab + 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[:, 0] = -0.0
    before = logits.clone()
    apply_ceilings(logits, ceilings, rows)
    others = [r for r in range(4) if r not in rows]
    assert torch.equal(logits[others], before[others])
    for i, row in enumerate(rows):
        allowed = ceilings[i, :vocab] == float("inf")
        assert 0 < int(allowed.sum()) < vocab
        kept = logits[row, :vocab][allowed]
        assert torch.equal(kept.view(torch.int16), before[row, :vocab][allowed].view(torch.int16))  # bit for bit
        assert bool(torch.isneginf(logits[row, :vocab][~allowed]).all())
        assert bool(torch.isneginf(logits[row, vocab:]).all())  # the padded columns no grammar allows
    with pytest.raises(ValueError, match="rows of ceilings"):
        apply_ceilings(logits, ceilings, rows[:1] if len(rows) > 1 else [0, 1])


def test_apply_bitmask_reads_only_the_rows_it_is_given(compiler: GrammarCompiler, filler: MaskFiller) -> None:
    vocab = compiler.vocab_size
    bitmask = allocate_bitmask(3, vocab)
    filler.fill_bitmask(bitmask, {1: compiler.state(GrammarSpec.json_object())})
    logits = torch.zeros(3, vocab)
    apply_bitmask(logits, bitmask, [1], vocab)
    assert torch.equal(torch.isfinite(logits[1]), _allowed(bitmask[1:2], vocab)[0])
    assert bool(torch.isfinite(logits[[0, 2]]).all())


def test_filler_thread_runs_below_the_forwards_priority(compiler: GrammarCompiler, filler: MaskFiller) -> None:
    """The filler's thread and llguidance's workers (started from it) yield the cores to torch's threads."""
    tids: list[int] = []
    filler._pool.submit(lambda: tids.append(threading.get_native_id())).result(timeout=30)
    if os.getpriority(os.PRIO_PROCESS, tids[0]) == os.getpriority(os.PRIO_PROCESS, 0):
        pytest.skip("this system refused to lower a thread's priority")
    assert os.getpriority(os.PRIO_PROCESS, tids[0]) == os.getpriority(os.PRIO_PROCESS, 0) + 10
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = {int(tid) for tid in os.listdir("/proc/self/task") if os.getpriority(os.PRIO_PROCESS, int(tid)) > base}
    filler.ceilings([compiler.state(GrammarSpec.json_object())]).result(timeout=30)
    assert threading.get_native_id() not in lowered  # the caller (the engine's thread) keeps its priority
    # llguidance's workers started when the filler's thread made its executor: at its priority too.
    workers = {int(tid) for tid in os.listdir("/proc/self/task") if os.getpriority(os.PRIO_PROCESS, int(tid)) > base}
    assert len(workers - {tids[0]}) >= 1
