from __future__ import annotations

import math

import pytest
import torch

from engine.grammar_masks import allocate_bitmask, token_ceilings
from engine.request import SamplingParams
from engine.sampler import (
    HEAD_WIDTH,
    Sampler,
    SamplingBatch,
    apply_penalties,
    make_generator,
    suppress_stop_tokens,
)

EOS = 1


def batch_of(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[0]] * n,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        eos_token_ids=frozenset({EOS}),
    )


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax() -> None:
    logits = random_logits(6, 1000)
    out = Sampler()(logits, batch_of([SamplingParams(temperature=0.0)] * 6))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_uses_the_given_argmax_on_the_raw_logits(dtype: torch.dtype) -> None:
    """A backend's argmax (here the C++ one) picks the greedy tokens; half-precision logits are not widened
    first (widening is exact), and rows that want logprobs still get them from float32."""
    from kernels import cpu_kernels

    seen: list[torch.dtype] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        return cpu_kernels.CpuKernels().argmax(x)

    logits = random_logits(6, 1000).to(dtype)
    logits[2, 7] = logits[2, 9] = 50.0  # a tie: the first index wins, as with torch
    out = Sampler(argmax)(logits, batch_of([SamplingParams(temperature=0.0)] * 6))
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.token_ids[2] == 7
    assert seen == [dtype]
    with_logprobs = [SamplingParams(temperature=0.0, logprobs=2)] + [SamplingParams(temperature=0.0)] * 5
    out = Sampler(argmax)(logits, batch_of(with_logprobs))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs[0] is not None and out.logprobs[1] is None
    expected = Sampler()(logits.float(), batch_of(with_logprobs)).logprobs[0]
    assert out.logprobs[0] == expected


@pytest.mark.parametrize("penalized", [True, False])
def test_sampler_leaves_caller_logits_untouched(penalized: bool) -> None:
    logits = random_logits(3, 50)
    before = logits.clone()
    penalty = {"repetition_penalty": 1.3, "presence_penalty": 1.0} if penalized else {}
    params = [
        SamplingParams(temperature=0.7, top_p=0.5, **penalty),  # type: ignore[arg-type]
        SamplingParams(temperature=1.2, min_p=0.1, **penalty),  # type: ignore[arg-type]
        SamplingParams(temperature=0.0, top_k=3, **penalty),  # type: ignore[arg-type]
    ]
    Sampler()(logits, batch_of(params, outputs=[[3, 4], [5], []], prompts=[[1, 2], [3], [4]]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)],
    ids=["top_k=1", "top_p_tiny"],
)
def test_truncation_to_one_token_is_greedy(params: SamplingParams) -> None:
    logits = random_logits(8, 500, seed=1)
    for _ in range(3):
        out = Sampler()(logits, batch_of([params] * 8))
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_unaffected_by_random_rows() -> None:
    logits = random_logits(4, 300, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 2
    out = Sampler()(logits, batch_of(params))
    greedy = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == greedy[0] and out.token_ids[2] == greedy[2]


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    rows = 4000
    counts = torch.zeros(5)
    for _ in range(5):
        out = Sampler()(logits.repeat(rows, 1), batch_of([SamplingParams(temperature=temperature)] * rows))
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=5).float()
    # 4 degrees of freedom: 18.5 is the 0.1% tail; the draw is seeded so this is deterministic.
    assert chi_square(counts, torch.softmax(logits / temperature, dim=0)) < 18.5


def test_top_k_top_p_min_p_renormalize_over_kept_tokens() -> None:
    torch.manual_seed(1)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()
    rows = 4000
    cases = {
        # top-k keeps the 3 most likely.
        "top_k": (SamplingParams(top_k=3), [0, 1, 2]),
        # top-p: the smallest head whose mass reaches 0.6 is {0, 1} (0.65).
        "top_p": (SamplingParams(top_p=0.6), [0, 1]),
        # min-p: p >= 0.3 * 0.4 = 0.12 keeps the first three.
        "min_p": (SamplingParams(min_p=0.3), [0, 1, 2]),
        # both: top-k 4 then top-p 0.8 of the renormalized head (0.4/0.9, 0.25/0.9, ...) keeps 3.
        "top_k_top_p": (SamplingParams(top_k=4, top_p=0.8), [0, 1, 2]),
    }
    for name, (params, kept) in cases.items():
        out = Sampler()(logits.repeat(rows, 1), batch_of([params] * rows))
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).float()
        assert counts[[t for t in range(6) if t not in kept]].sum() == 0, name
        expected = probs[kept] / probs[kept].sum()
        # df = len(kept) - 1 <= 2: 13.8 is the 0.1% tail.
        assert chi_square(counts[kept], expected) < 13.8, name


@pytest.mark.parametrize("top_p", [0.5, 0.9], ids=["widened_head", "full_sort"])
def test_top_p_beyond_the_head_width(top_p: float) -> None:
    torch.manual_seed(2)
    vocab = 3000
    logits = -torch.arange(vocab, dtype=torch.float32) * 3e-4  # nearly flat, sorted by id
    probs = torch.softmax(logits.double(), dim=0)
    kept = int(((probs.cumsum(0) - probs) < top_p).sum())
    # The first head is too narrow; the widened one (8x) suffices only in the first case.
    assert kept > HEAD_WIDTH and (kept > HEAD_WIDTH * 8) == (top_p == 0.9)
    rows = 1000
    out = Sampler()(logits.repeat(rows, 1), batch_of([SamplingParams(top_p=top_p)] * rows))
    tokens = torch.tensor(out.token_ids)
    assert int(tokens.max()) < kept
    # The far half of the kept set is hit as often as its renormalized mass says.
    far = float(probs[kept // 2 : kept].sum() / probs[:kept].sum())
    assert abs(float((tokens >= kept // 2).float().mean()) - far) < 0.05  # ~3 sigma at 1000 draws


def test_seeded_rows_do_not_depend_on_batch_composition() -> None:
    vocab = 400
    steps = 6
    logits = [random_logits(1, vocab, seed=10 + s)[0] for s in range(steps)]
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.8)

    def run(layout: str) -> list[int]:
        gen = make_generator(1234, 0)
        others = [make_generator(7, 0), None]
        got = []
        for s in range(steps):
            if layout == "alone":
                rows, params, gens, pos = [logits[s]], [seeded], [gen], 0
            else:
                noise = random_logits(2, vocab, seed=100 + s)
                rows = [noise[0], logits[s], noise[1]]
                # The top-k neighbour widens the candidate head the seeded row is sampled from.
                params = [SamplingParams(temperature=1.0, seed=7), seeded, SamplingParams(top_k=300)]
                gens, pos = [others[0], gen, others[1]], 1
            out = Sampler()(torch.stack(rows), batch_of(params, generators=gens))
            got.append(out.token_ids[pos])
        return got

    assert run("alone") == run("crowded")


def test_different_seeds_and_sample_indices_differ() -> None:
    vocab = 1000
    logits = torch.zeros(1, vocab)  # flat: 20 draws agreeing by chance has probability 1e-60

    def draws(seed: int, index: int) -> list[int]:
        gen = make_generator(seed, index)
        params = SamplingParams(temperature=1.0, seed=seed)
        return [Sampler()(logits, batch_of([params], generators=[gen])).token_ids[0] for _ in range(20)]

    assert draws(1, 0) == draws(1, 0)
    assert draws(1, 0) != draws(2, 0)
    assert draws(1, 0) != draws(1, 1)
    assert make_generator(None, 0) is None


def test_penalties_change_exactly_the_expected_logits() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalty: row untouched
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),  # nothing generated yet
    ]
    prompts = [[0, 1], [0, 1], [0, 1], [0, 2]]
    outputs = [[3, 3, 4], [3, 3, 4], [3, 3, 4], []]
    got = logits.clone()
    apply_penalties(got, batch_of(params, outputs=outputs, prompts=prompts))
    # Repetition over prompt {0, 1} and output {3, 4}: positive / 2, negative * 2; 2 and 5 unseen.
    assert got[0].tolist() == [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]
    # Output only: token 3 seen twice (-0.5 - 2 * 0.25), token 4 once (-0.5 - 0.25); prompt ignored.
    assert got[1].tolist() == [2.0, -1.0, 0.5, 2.0, -2.75, 1.0]
    assert got[2].tolist() == logits[2].tolist()
    # Repetition over the prompt only; presence needs output tokens.
    assert got[3].tolist() == [1.0, -1.0, 0.25, 3.0, -2.0, 1.0]


def test_penalty_steers_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    # Token 1 already generated once: 5 - 2 = 3 < 4.
    out = Sampler()(logits, batch_of([params], outputs=[[1]]))
    assert out.token_ids == [2]


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0, 0.5]])  # EOS (1) best, then token 2
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, batch_of([params], outputs=[[4]])).token_ids == [3]
    assert sampler(logits, batch_of([params], outputs=[[4, 4]])).token_ids == [EOS]
    # ignore_eos only means "do not stop at EOS": min_tokens still bans the explicit stop tokens.
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    got = logits.clone()
    suppress_stop_tokens(got, batch_of([params]))
    assert got[0].tolist() == [0.0, 9.0, float("-inf"), 1.0, 0.5]


def test_logprobs_are_raw_normalized_and_ordered() -> None:
    logits = random_logits(3, 8, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=8),
        SamplingParams(temperature=0.5, logprobs=3, presence_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, batch_of(params, outputs=[[0], [0], [0]]))
    raw = torch.log_softmax(logits, dim=-1)

    full = out.logprobs[0]
    assert full is not None and len(full) == 8
    assert math.isclose(sum(math.exp(v) for v in full.values()), 1.0, rel_tol=1e-5)
    values = list(full.values())
    assert values == sorted(values, reverse=True)
    assert list(full)[0] == out.token_ids[0]

    top3 = out.logprobs[1]
    assert top3 is not None
    expected_top = raw[1].topk(3).indices.tolist()
    assert list(top3)[:3] == expected_top
    for tok, lp in top3.items():
        # Raw logits: neither temperature nor the penalty shows in the logprobs.
        assert lp == pytest.approx(raw[1, tok].item(), abs=1e-6)
    assert out.token_ids[1] in top3
    assert len(top3) == (3 if out.token_ids[1] in expected_top else 4)
    assert out.logprobs[2] is None


def test_logprobs_zero_returns_only_sampled_token() -> None:
    logits = random_logits(1, 50, seed=6)
    out = Sampler()(logits, batch_of([SamplingParams(temperature=0.0, logprobs=0)]))
    tok = out.token_ids[0]
    assert out.logprobs[0] == {tok: pytest.approx(torch.log_softmax(logits[0], -1)[tok].item())}


def test_batch_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), batch_of([SamplingParams()]))
    with pytest.raises(ValueError):
        SamplingBatch([SamplingParams()], [[0]], [], [None], frozenset())


# -- structured outputs: grammar rows ---------------------------------------------------------------------
def _allow(bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Row ``row`` of an ``engine.grammar_masks`` bitmask allows exactly ``tokens``."""
    bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
    bits[tokens] = True
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    bitmask[row] = (bits.view(-1, 32).long() * weights).sum(dim=1).to(torch.int32)  # wraps bit 31 to the sign


def test_grammar_rows_pick_allowed_tokens_and_other_rows_are_untouched() -> None:
    """Greedy, sampled and logprob rows under a grammar choose among its tokens only; the other rows' logits
    stay bit for bit what they were, so their tokens equal a batch without grammar rows."""
    vocab = 1000
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=2)]
    allowed = {1: [3, 500, 999], 2: [7, 31, 32, 640], 3: [12]}
    bitmask = allocate_bitmask(len(params), vocab)
    for row, tokens in allowed.items():
        _allow(bitmask, row, tokens)
    logits = random_logits(len(params), vocab, seed=3)
    plain_rows = [0, 4]
    before = logits[plain_rows].clone()
    plain = Sampler()(logits.clone(), batch_of(params))
    batch = SamplingBatch(params, [[0]] * 5, [[] for _ in params], [None] * 5, frozenset({EOS}),
                          grammar_rows=tuple(allowed),
                          grammar_ceilings=token_ceilings(bitmask[list(allowed)].contiguous(), vocab))
    out = Sampler()(logits, batch)
    assert torch.equal(logits[plain_rows], before)
    for row in plain_rows:
        assert out.token_ids[row] == plain.token_ids[row] and out.logprobs[row] == plain.logprobs[row]
    for row, tokens in allowed.items():
        assert out.token_ids[row] in tokens
        assert bool(torch.isinf(logits[row]).sum() == vocab - len(tokens))
        lps = out.logprobs[row]
        if lps is not None:  # the grammar's tokens only (fewer than asked for), renormalized: no -inf
            assert set(lps) == set(tokens) and all(math.isfinite(v) for v in lps.values())
            assert math.isclose(sum(math.exp(v) for v in lps.values()), 1.0, rel_tol=1e-5)
    assert out.token_ids[1] == max(allowed[1], key=lambda t: float(logits[1, t]))


def test_grammar_mask_blocks_logits_past_the_grammar_vocabulary() -> None:
    """A model may pad its LM head past the tokenizer's vocabulary; those logits are never picked."""
    bitmask = allocate_bitmask(1, 64)
    logits = torch.zeros(1, 80)
    logits[0, 70] = 100.0  # a padding column the model happens to like
    batch = SamplingBatch([SamplingParams(temperature=0.0)], [[0]], [[]], [None], frozenset({EOS}),
                          grammar_rows=(0,), grammar_ceilings=token_ceilings(bitmask, 64))
    assert Sampler()(logits, batch).token_ids[0] < 64


def test_grammar_rows_need_their_ceilings() -> None:
    with pytest.raises(ValueError, match="ceilings"):
        SamplingBatch([SamplingParams()], [[0]], [[]], [None], frozenset(), grammar_rows=(0,))
    with pytest.raises(ValueError, match="ceilings"):
        SamplingBatch([SamplingParams()], [[0]], [[]], [None], frozenset(), grammar_rows=(0,),
                      grammar_ceilings=token_ceilings(allocate_bitmask(2, 64), 64))
