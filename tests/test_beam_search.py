"""engine.beam: the step rules by hand, and against transformers' own beam search on a tiny random model
(its logits drive ``BeamSearch`` one step at a time; the two must return the same beams and scores)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from engine.beam import BeamSearch, EarlyStopping, end_tokens, num_candidates

EOS = 0


def test_import_does_not_pull_torch() -> None:
    code = "import sys, engine.beam; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_candidates_cover_a_step_where_every_best_token_ends() -> None:
    assert num_candidates(3, 1) == 6
    assert num_candidates(3, 0) == 6
    assert num_candidates(2, 3) == 8
    assert end_tokens([2], [7], ignore_eos=False) == {2, 7}
    assert end_tokens([2], [7], ignore_eos=True) == {7}


def test_first_step_expands_the_single_prompt_beam() -> None:
    search = BeamSearch(width=2)
    nxt = search.step([([5, 6, 7, 8], [-0.1, -0.5, -1.0, -2.0])], [[]], {EOS}, max_tokens=10)
    assert [(c.parent, c.token) for c in nxt] == [(0, 5), (0, 6)]
    assert search.scores == pytest.approx([-0.1, -0.5])
    assert not search.done and not search.finished


def test_a_parent_can_be_extended_twice_and_another_dropped() -> None:
    search = BeamSearch(width=2)
    search.step([([5, 6, 7, 8], [-0.1, -0.5, -1.0, -2.0])], [[]], {EOS}, max_tokens=10)
    # Beam 0 (-0.1) has two continuations better than anything of beam 1 (-0.5): beam 1 is dropped.
    nxt = search.step([([3, 4, 9, 1], [-0.2, -0.3, -5.0, -6.0]), ([3, 4, 9, 1], [-1.0, -2.0, -3.0, -4.0])],
                      [[5], [6]], {EOS}, max_tokens=10)
    assert [(c.parent, c.token) for c in nxt] == [(0, 3), (0, 4)]
    assert search.scores == pytest.approx([-0.3, -0.4])


def test_an_ending_continuation_is_kept_only_within_the_first_width_ranks() -> None:
    search = BeamSearch(width=2, length_penalty=1.0)
    search.step([([5, 6, 7, 8], [-0.1, -0.5, -1.0, -2.0])], [[]], {EOS}, max_tokens=10)
    # Ranks: (0,EOS) -0.2 first -> finished; (1,EOS) -0.5-0.9 is rank 4 -> discarded.
    nxt = search.step([([EOS, 3, 4, 9], [-0.1, -0.2, -0.3, -4.0]), ([EOS, 3, 4, 9], [-0.9, -3.0, -3.0, -4.0])],
                      [[5], [6]], {EOS}, max_tokens=10)
    assert [(c.parent, c.token) for c in nxt] == [(0, 3), (0, 4)]
    (hyp,) = search.finished
    assert (hyp.token_ids, hyp.ended) == ((5, EOS), True)
    assert (hyp.logprob, hyp.score) == (pytest.approx(-0.2), pytest.approx(-0.2 / 2))


def test_length_penalty_divides_by_the_output_length_with_its_ending_token() -> None:
    search = BeamSearch(width=1, length_penalty=2.0, early_stopping=True)
    search.step([([5, 6], [-0.5, -1.0])], [[]], {EOS}, max_tokens=10)
    assert search.step([([EOS, 6], [-0.7, -1.0])], [[5]], {EOS}, max_tokens=10) == []
    (hyp,) = search.finished
    assert hyp.token_ids == (5, EOS) and hyp.score == pytest.approx(-1.2 / 2**2) and search.done


@pytest.mark.parametrize(("early_stopping", "length_penalty", "stops"), [
    (True, 1.0, True),  # width hypotheses finished: done at once
    (False, 1.0, True),  # the best running beam at its length (-3/2) cannot beat the worst kept (-0.35)
    ("never", 1.0, False),  # ... at the length limit (-3/10) it could
    ("never", 0.0, True),  # no length penalty: the limit does not matter
])
def test_early_stopping_modes(early_stopping: EarlyStopping, length_penalty: float, stops: bool) -> None:
    search = BeamSearch(width=1, length_penalty=length_penalty, early_stopping=early_stopping)
    search.step([([5, 6], [-0.2, -0.3])], [[]], {EOS}, max_tokens=10)
    nxt = search.step([([EOS, 7, 8], [-0.5, -2.8, -3.0])], [[5]], {EOS}, max_tokens=10)
    assert len(search.finished) == 1
    assert search.done is stops and (nxt == []) is stops


def test_length_limit_finishes_the_best_width_continuations() -> None:
    search = BeamSearch(width=2)
    search.step([([5, 6, 7, 8], [-0.1, -0.5, -1.0, -2.0])], [[]], {EOS}, max_tokens=2)
    nxt = search.step([([3, EOS, 4, 9], [-0.2, -0.3, -5.0, -6.0]), ([3, 4, 9, 1], [-0.1, -2.0, -3.0, -4.0])],
                      [[5], [6]], {EOS}, max_tokens=2)
    assert nxt == [] and search.done
    assert [(h.token_ids, h.ended) for h in search.finished] == [((5, 3), False), ((5, EOS), True)]


def test_best_fills_in_with_running_beams_when_cut_short() -> None:
    search = BeamSearch(width=3)
    search.step([([5, 6, 7, 8, 9, 1], [-0.1, -0.5, -1.0, -2.0, -3.0, -4.0])], [[]], {EOS}, max_tokens=10)
    best = search.best(2, [[5], [6], [7]])
    assert [h.token_ids for h in best] == [(5,), (6,)] and not any(h.ended for h in best)


def test_step_after_done_is_an_error() -> None:
    search = BeamSearch(width=1, early_stopping=True)
    search.step([([EOS, 5], [-0.1, -1.0])], [[]], {EOS}, max_tokens=10)
    assert search.done
    with pytest.raises(RuntimeError):
        search.step([([EOS], [-0.1])], [[EOS]], {EOS}, max_tokens=10)


# -- against transformers on a tiny random model --------------------------------------------------

VOCAB = 12
PROMPTS = [[3, 7, 1, 4], [9, 2, 5], [6]]
MAX_NEW = 7


@pytest.fixture(scope="module")
def tiny() -> Any:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: peaked distributions, EOS often on top
        model.lm_head.weight.mul_(40.0)
        model.lm_head.weight[EOS] += 0.5 * model.lm_head.weight.mean(0)
    return model


def _search(model: Any, prompt: list[int], width: int, length_penalty: float,
            early_stopping: EarlyStopping) -> list[list[int]]:
    import torch

    search = BeamSearch(width, length_penalty, early_stopping)
    beams: list[list[int]] = [[]]
    k = num_candidates(width, 1)
    while True:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + b for b in beams])).logits[:, -1].float()
        vals, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        nxt = search.step(list(zip(ids.tolist(), vals.tolist(), strict=True)), beams, {EOS}, MAX_NEW)
        if search.done:
            return [list(h.token_ids) for h in search.finished]
        beams = [beams[c.parent] + [c.token] for c in nxt]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("width", [2, 3, 4])  # one beam is greedy decoding to transformers
@pytest.mark.parametrize(("length_penalty", "early_stopping"), [
    (1.0, False), (1.0, True), (1.0, "never"), (0.0, "never"), (2.0, False), (2.0, "never"), (-0.5, False),
])
def test_same_beams_as_transformers(tiny: Any, prompt: list[int], width: int, length_penalty: float,
                                    early_stopping: EarlyStopping) -> None:
    import torch

    with torch.no_grad():
        out = tiny.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=MAX_NEW, do_sample=False, num_beams=width, num_return_sequences=width,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    want = []
    for row in out[:, len(prompt):].tolist():
        want.append(row[: row.index(EOS) + 1] if EOS in row else row)
    assert _search(tiny, prompt, width, length_penalty, early_stopping) == want


# -- the request's parameters -----------------------------------------------------------------------


def test_beam_search_parameters() -> None:
    from engine.request import SamplingParams, SequenceGroup

    params = SamplingParams(use_beam_search=True, best_of=4, n=2, length_penalty=0.5, early_stopping="never")
    assert params.beam_width == 4 and params.max_seqs == 4 and params.greedy
    group = SequenceGroup("r", [1, 2, 3], params)
    assert group.beam is not None and group.beam.width == 4 and not group.needs_fork
    assert SamplingParams(use_beam_search=True, n=3).beam_width == 3
    assert SamplingParams(n=3).max_seqs == 3 and SequenceGroup("s", [1], SamplingParams(n=3)).beam is None


@pytest.mark.parametrize("kwargs", [
    {"use_beam_search": True},  # one beam: that is greedy decoding
    {"use_beam_search": True, "best_of": 2, "n": 3},
    {"use_beam_search": True, "best_of": 2, "top_p": 0.9},
    {"use_beam_search": True, "best_of": 2, "top_k": 5},
    {"use_beam_search": True, "best_of": 2, "min_p": 0.1},
    {"use_beam_search": True, "best_of": 2, "seed": 1},
    {"use_beam_search": True, "best_of": 2, "logprobs": 1},
    {"use_beam_search": True, "best_of": 2, "stop": ["x"]},
    {"use_beam_search": True, "best_of": 2, "early_stopping": "sometimes"},
    {"use_beam_search": True, "best_of": 2, "length_penalty": float("nan")},
    {"best_of": 3},  # without beam search every sample drawn is returned
    {"length_penalty": 2.0},
    {"early_stopping": True},
])
def test_refused_parameters(kwargs: dict[str, Any]) -> None:
    from engine.request import SamplingParams

    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
