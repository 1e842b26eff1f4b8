"""Beam search bookkeeping: which continuations of ``width`` beams survive a step, which end, and when
the search is over. Plain Python over token ids and log-probabilities (no torch, no sequences, no blocks);
the engine turns its answers into forks and frees of sequences, whose blocks the block manager shares.

The rules are those of transformers' ``generate(num_beams=width, do_sample=False)``, so the two return the
same beams:

- Each step looks at the ``num_candidates`` best continuations over all running beams, scored by their
  summed log-probabilities. The first ``width`` of them that do not end become the next running beams.
- A continuation that ends (an end token, or the length limit for all of them at once) becomes a finished
  hypothesis only if it ranks among the first ``width``; its score is the summed log-probability divided
  by its output length (the ending token included) to the power ``length_penalty``. At most ``width``
  hypotheses are kept, best first.
- ``early_stopping=True`` stops as soon as ``width`` hypotheses are finished. ``False`` stops once the best
  running beam, scored at its current length, cannot beat the worst kept hypothesis; ``"never"`` does the
  same but, for a positive ``length_penalty``, scores the running beam at the length limit instead (the
  canonical, exhaustive search).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

EarlyStopping = bool | Literal["never"]


def num_candidates(width: int, num_end_tokens: int) -> int:
    """Continuations examined per step (and so the top-k the sampler returns per beam): enough that
    ``width`` of them remain even when every beam's best continuations are end tokens."""
    return max(2, 1 + num_end_tokens) * width


def end_tokens(eos_token_ids: Iterable[int], stop_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
    """Tokens that end a beam: its stop tokens, and EOS unless ``ignore_eos``."""
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_token_ids))


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # output tokens, the ending token included
    logprob: float  # summed log-probabilities of the output tokens
    score: float  # logprob / len(token_ids) ** length_penalty
    ended: bool  # by an end token (else it reached the length limit)


@dataclass(frozen=True)
class Continuation:
    parent: int  # index of the running beam it extends, in the order the step was given them
    token: int
    logprob: float  # the parent's summed log-probability plus this token's


@dataclass
class BeamSearch:
    width: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    # Summed log-probability of each running beam, best first (one beam, the prompt, before the first step).
    scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most ``width``
    done: bool = False
    # Candidates of beams that sampled in this step, keyed by the engine's sequence id: a step of the search
    # waits until every running beam has sampled (a chunked or preempted beam may lag behind the others).
    pending: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    _improvable: bool = True

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"beam width must be >= 1, got {self.width}")

    def step(self, candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
             outputs: Sequence[Sequence[int]], end_tokens: Collection[int], max_tokens: int) -> list[Continuation]:
        """One step: ``candidates[b]`` are running beam ``b``'s best next tokens and their log-probabilities,
        ``outputs[b]`` its output tokens so far; ``max_tokens`` the length limit of an output. Returns the
        next running beams, best first; none once the search is ``done``."""
        if self.done:
            raise RuntimeError("step after the beam search is done")
        if len(candidates) != len(self.scores) or len(outputs) != len(self.scores):
            raise ValueError(f"{len(candidates)} candidate lists and {len(outputs)} outputs for "
                             f"{len(self.scores)} running beams")
        length = len(outputs[0]) + 1  # every beam has generated as many tokens as the others
        at_limit = length >= max_tokens
        pool = sorted(
            ((score + lp, b, rank, tok) for b, (score, (toks, lps)) in enumerate(zip(self.scores, candidates,
                                                                                     strict=True))
             for rank, (tok, lp) in enumerate(zip(toks, lps, strict=True))),
            key=lambda c: (-c[0], c[1], c[2]))
        top = [Continuation(b, tok, total) for total, b, _, tok in pool[: num_candidates(self.width, len(end_tokens))]]
        ends = [at_limit or c.token in end_tokens for c in top]

        if self._improvable and not (self.early_stopping is True and len(self.finished) == self.width):
            new = [Hypothesis((*outputs[c.parent], c.token), c.logprob, c.logprob / length**self.length_penalty,
                              c.token in end_tokens)
                   for c, end in zip(top[: self.width], ends, strict=False) if end]
            # Stable: among equal scores the earlier hypothesis (and the better-ranked continuation) stays first.
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]

        running = [c for c, end in zip(top, ends, strict=True) if not end][: self.width]
        if running:
            self.scores = [c.logprob for c in running]
            if len(self.finished) == self.width:
                hypothetical = max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
                best_possible = running[0].logprob / hypothetical**self.length_penalty
                self._improvable = best_possible > self.finished[-1].score
        self.done = (not running or not self._improvable
                     or (self.early_stopping is True and len(self.finished) == self.width))
        self.pending.clear()
        return [] if self.done else running

    def best(self, n: int, running_outputs: Sequence[Sequence[int]] = ()) -> list[Hypothesis]:
        """The ``n`` best hypotheses. A search cut short (aborted, or out of memory) may have fewer finished
        than ``n``: the running beams (``running_outputs``, best first) fill in, scored by their length."""
        best = list(self.finished[:n])
        for tokens, logprob in zip(running_outputs, self.scores, strict=False):
            if len(best) >= n:
                break
            length = max(1, len(tokens))
            best.append(Hypothesis(tuple(tokens), logprob, logprob / length**self.length_penalty, False))
        return best


__all__ = ["BeamSearch", "Continuation", "EarlyStopping", "Hypothesis", "end_tokens", "num_candidates"]
