"""Turn one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One row per sequence that samples this step (``n > 1`` samples are separate rows). The order of
operations follows vLLM: stop tokens are suppressed until ``min_tokens``, then repetition,
frequency and presence penalties, temperature, top-k, top-p, min-p, and a draw. Logprobs are
the log-softmax of the raw model logits (vLLM's default ``raw_logprobs``), so they do not
depend on the sampling settings.

The sampler runs every decode step over ``[rows, vocab]`` logits, so it avoids full-vocabulary
work it does not need: an all-greedy batch without penalties or logprobs is a single
``argmax``; penalties touch only the tokens a sequence has seen; a draw is one uniform number
per row mapped through the cumulative distribution (a vocabulary of exponential noise costs
ten times more on a CPU); and top-k/top-p look at the head of the distribution from ``topk``
instead of sorting the whole vocabulary, sorting only when the head holds too little mass.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.beam import end_tokens, num_candidates
from engine.grammar_masks import apply_ceilings
from engine.request import SamplingParams

_MASK = float("-inf")
# Candidates examined for top-p without top-k. Chat models at usual temperatures put well over
# 0.95 of the mass in their top 256 tokens; rows where that is not so fall back to a full sort.
HEAD_WIDTH = 256


@dataclass(frozen=True)
class SamplingBatch:
    """What the sampler needs to know about each row; all lists have one entry per row."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    eos_token_ids: frozenset[int]
    # Structured outputs: the rows under a grammar, and each one's token ceilings (``engine.grammar_masks``:
    # +inf where its grammar allows the token, -inf where not), a row of ``grammar_ceilings`` per grammar row.
    grammar_rows: tuple[int, ...] = ()
    grammar_ceilings: Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.params)
        if not (len(self.prompt_token_ids) == len(self.output_token_ids) == len(self.generators) == n):
            raise ValueError("SamplingBatch lists must all have one entry per row")
        ceilings = self.grammar_ceilings
        if self.grammar_rows and (ceilings is None or ceilings.shape[0] != len(self.grammar_rows)):
            raise ValueError("grammar rows need their token ceilings, a row per grammar row")


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} holding the top ``params.logprobs`` tokens in descending order,
    # then the sampled token if it is not among them. None when the row did not ask.
    logprobs: list[dict[int, float] | None]
    # Per row: a beam search row's most likely next tokens and their log-probabilities, best first, as many as
    # the beam step examines (``beam.num_candidates``); None for other rows. Empty when no row searches beams.
    beam_candidates: list[tuple[list[int], list[float]] | None] = field(default_factory=list)


def make_generator(seed: int | None, index: int, device: str | torch.device = "cpu",
                   skip: int = 0) -> torch.Generator | None:
    """A generator for sample ``index`` of a request with ``seed``; None when unseeded.

    Sample 0 uses the seed itself; other samples mix in the index so the ``n`` samples of one
    seeded request differ from each other yet are each reproducible. The sampler draws one
    number per step from it, on the generator's device, whatever the logits' device. ``skip``:
    steps already sampled elsewhere (``SamplingParams.seed_offset``); their draws are made and
    dropped here, one at a time exactly as the sampler makes them, so the stream goes on from there.
    """
    if seed is None:
        return None
    mixed = (seed ^ (index * 0x9E3779B97F4A7C15)) & 0xFFFF_FFFF_FFFF_FFFF
    gen = torch.Generator(device=device).manual_seed(mixed)
    for _ in range(skip):
        torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device)
    return gen


def _rows(idx: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(idx), dtype=torch.long, device=device)


def _take(t: Tensor, rows: Sequence[int]) -> Tensor:
    """``t[rows]`` without the copy when ``rows`` is every row in order (the common case)."""
    if len(rows) == t.shape[0] and all(r == i for i, r in enumerate(rows)):
        return t
    return t[_rows(rows, t.device)]


def _column(values: Sequence[float], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device).unsqueeze(1)


def suppress_stop_tokens(logits: Tensor, batch: SamplingBatch) -> None:
    """Before ``min_tokens`` outputs, EOS and ``stop_token_ids`` may not be sampled. In place."""
    vocab = logits.shape[1]
    for i, (p, out) in enumerate(zip(batch.params, batch.output_token_ids, strict=True)):
        if len(out) >= p.min_tokens:
            continue
        stops = end_tokens(batch.eos_token_ids, p.stop_token_ids, p.ignore_eos)
        banned = [t for t in stops if 0 <= t < vocab]
        if banned:
            logits[i, banned] = _MASK


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> None:
    """Repetition penalty over prompt + output (HF/vLLM); presence and frequency over output (OpenAI).

    In place (``logits`` must be contiguous), touching only the (row, token) pairs a penalized row has
    seen, so the cost follows the number of tokens rather than rows x vocabulary.
    """
    rows = [i for i, p in enumerate(batch.params) if _has_penalty(p)]
    if not rows:
        return
    vocab = logits.shape[1]
    rep_rows = [i for i in rows if batch.params[i].repetition_penalty != 1.0]
    out_keys = _token_keys(rows, batch.output_token_ids, vocab)
    out_keys, out_counts = torch.unique(out_keys, return_counts=True)
    keys = torch.unique(torch.cat([out_keys, _token_keys(rep_rows, batch.prompt_token_ids, vocab)]))
    if keys.numel() == 0:
        return
    # Occurrences in the output per key (0 for prompt-only tokens).
    counts = torch.zeros(keys.shape, dtype=torch.float32)
    if out_keys.numel():
        pos = torch.searchsorted(out_keys, keys).clamp_max_(out_keys.numel() - 1)
        counts = torch.where(out_keys[pos] == keys, out_counts[pos], 0).float()
    row_of = keys // vocab

    params = batch.params
    rep = torch.tensor([p.repetition_penalty for p in params])[row_of]
    freq = torch.tensor([p.frequency_penalty for p in params])[row_of]
    presence = torch.tensor([p.presence_penalty for p in params])[row_of]
    device = logits.device
    keys = keys.to(device)
    flat = logits.view(-1)  # raises on a non-contiguous tensor rather than writing into a copy
    vals = flat[keys]
    rep, freq, presence, counts = rep.to(device), freq.to(device), presence.to(device), counts.to(device)
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - freq * counts - presence * (counts > 0).float()
    flat[keys] = vals


def _token_keys(rows: list[int], token_ids: list[list[int]], vocab: int) -> Tensor:
    """``row * vocab + token`` for every token of the given rows (CPU, int64), out-of-range ids dropped."""
    lists = [token_ids[i] for i in rows]
    tokens = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    counts = torch.tensor([len(t) for t in lists], dtype=torch.long)
    row_idx = torch.tensor(rows, dtype=torch.long).repeat_interleave(counts)
    valid = (tokens >= 0) & (tokens < vocab)
    return (row_idx * vocab + tokens)[valid]


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> Tensor:
    """One U[0, 1) float64 per row; a seeded row's number comes from its own generator only."""
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for r, gen in enumerate(generators):
        if gen is not None:
            u[r] = torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device).item()
    return u.to(device)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index drawn from each row of non-negative, unnormalized ``weights`` with uniforms ``u``.

    Token i is picked when u * total falls in [cdf[i-1], cdf[i]); a zero-weight token has an
    empty interval and is never picked. float64 keeps tiny probabilities exact enough.
    """
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_max_(weights.shape[1] - 1)


class Sampler:
    """``argmax`` picks each row's greedy token; a backend may bring a faster one than torch's (the CPU
    kernels do), with the same answer: the first index of the maximum, the first NaN if there is one."""

    def __init__(self, argmax: Callable[[Tensor], Tensor] | None = None) -> None:
        self.argmax = argmax or functools.partial(torch.argmax, dim=-1)

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch.params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(batch.params)} rows")
        if batch.grammar_rows:
            assert batch.grammar_ceilings is not None
            # In place, before anything reads the logits: greedy, sampling and logprobs all see the grammar's
            # choices only, and the other rows are not touched (bit for bit). The runner's logits are inference
            # tensors, which only inference mode may write.
            with torch.inference_mode():
                apply_ceilings(logits, batch.grammar_ceilings, batch.grammar_rows)
        out = self._pick(logits, batch)
        beam_rows = [i for i, p in enumerate(batch.params) if p.use_beam_search]
        if not beam_rows:
            return out
        return SamplerOutput(out.token_ids, out.logprobs, self._beam_candidates(logits, batch, beam_rows))

    @staticmethod
    def _beam_candidates(logits: Tensor, batch: SamplingBatch, rows: list[int]
                         ) -> list[tuple[list[int], list[float]] | None]:
        """float32 log-softmax of each beam row's logits (after min_tokens and penalties, as sampling sees
        them), and its top ``num_candidates`` tokens."""
        sub = SamplingBatch([batch.params[i] for i in rows], [batch.prompt_token_ids[i] for i in rows],
                            [batch.output_token_ids[i] for i in rows], [None] * len(rows),
                            batch.eos_token_ids)
        x = _take(logits, rows).float().clone()
        suppress_stop_tokens(x, sub)
        apply_penalties(x, sub)
        lp = torch.log_softmax(x, dim=-1)
        widths = [num_candidates(p.beam_width, len(end_tokens(batch.eos_token_ids, p.stop_token_ids, p.ignore_eos)))
                  for p in sub.params]
        vals, ids = lp.topk(min(max(widths), lp.shape[1]), dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        result: list[tuple[list[int], list[float]] | None] = [None] * len(batch.params)
        for r, (i, k) in enumerate(zip(rows, widths, strict=True)):
            result[i] = (ids_l[r][:k], vals_l[r][:k])
        return result

    def _pick(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        params = batch.params
        logprobs = [p.logprobs for p in params]
        # Stop tokens suppressed before min_tokens, or penalties: logits to process before any pick.
        plain = not any(len(out) < p.min_tokens or _has_penalty(p)
                        for p, out in zip(params, batch.output_token_ids, strict=True))
        if plain and all(p.greedy for p in params):
            # Widening to float32 is exact, so the half-precision logits pick the same tokens; only
            # logprobs need the float32 copy.
            token_ids: list[int] = self.argmax(logits).tolist()
            if all(n is None for n in logprobs):
                return SamplerOutput(token_ids, [None] * len(params))
            return SamplerOutput(token_ids, self._gather_logprobs(logits.float(), token_ids, logprobs,
                                                                  batch.grammar_rows))
        logits = logits.float()

        if plain:
            processed = logits
        else:
            # Processing writes in place; the caller's logits stay intact and the raw ones feed logprobs.
            processed = logits.clone()
            suppress_stop_tokens(processed, batch)
            apply_penalties(processed, batch)

        token_ids = [0] * len(params)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            for i, tok in zip(greedy_rows, self.argmax(_take(processed, greedy_rows)).tolist(), strict=True):
                token_ids[i] = tok
        if random_rows:
            for i, tok in zip(random_rows, self._sample(processed, random_rows, batch), strict=True):
                token_ids[i] = tok
        lps = self._gather_logprobs(logits, token_ids, logprobs, batch.grammar_rows)
        return SamplerOutput(token_ids, lps)

    def _sample(self, logits: Tensor, rows: list[int], batch: SamplingBatch) -> list[int]:
        device = logits.device
        vocab = logits.shape[1]
        params = [batch.params[i] for i in rows]
        x = _take(logits, rows)
        u = _uniforms([batch.generators[i] for i in rows], device)
        temps = _column([p.temperature for p in params], device)
        min_p = _column([p.min_p for p in params], device)

        result = torch.empty(len(rows), dtype=torch.long, device=device)
        head = [r for r, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        full = [r for r, p in enumerate(params) if not (0 < p.top_k < vocab or p.top_p < 1.0)]
        if full:
            idx = _rows(full, device)
            result[idx] = self._sample_full(_take(x, full), temps[idx], min_p[idx], u[idx])
        if head:
            top_k = [params[r].top_k if 0 < params[r].top_k < vocab else 0 for r in head]
            top_p = [params[r].top_p for r in head]
            idx = _rows(head, device)
            result[idx] = self._sample_head(_take(x, head), temps[idx], min_p[idx], u[idx], top_k, top_p)
        return result.tolist()

    @staticmethod
    def _sample_full(x: Tensor, temps: Tensor, min_p: Tensor, u: Tensor) -> Tensor:
        # exp((x - max) / T) is p / p_max: unnormalized probabilities, and min-p compares them directly.
        w = ((x - x.amax(dim=-1, keepdim=True)) / temps).exp_()
        if bool((min_p > 0).any()):
            w.masked_fill_(w < min_p, 0.0)
        return _inverse_cdf(w, u)

    def _sample_head(self, x: Tensor, temps: Tensor, min_p: Tensor, u: Tensor, top_k: list[int],
                     top_p: list[float], width: int | None = None) -> Tensor:
        """Top-k, then top-p over what is left, then min-p, among the ``width`` most likely tokens."""
        device = x.device
        vocab = x.shape[1]
        if width is None:
            width = min(vocab, max(k if k > 0 else HEAD_WIDTH for k in top_k))
        vals, ids = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
        w = ((vals - vals[:, :1]) / temps).exp_()
        ks = torch.tensor([k if k > 0 else width for k in top_k], device=device).unsqueeze(1)
        w.masked_fill_(torch.arange(width, device=device).unsqueeze(0) >= ks, 0.0)

        cum = w.double().cumsum(dim=-1)
        # Top-p renormalizes over the top-k survivors, or over the whole vocabulary without top-k.
        z = cum[:, -1].clone()
        no_k = [r for r, k in enumerate(top_k) if k == 0]
        if no_k:
            idx = _rows(no_k, device)
            z[idx] = ((_take(x, no_k) - vals[idx, :1]) / temps[idx]).exp_().double().sum(dim=-1)
        p_col = torch.tensor(top_p, dtype=torch.float64, device=device).unsqueeze(1)
        # Keep a token while the mass strictly before it is below top_p; the top token always stays.
        keep = (cum - w.double()) < p_col * z.unsqueeze(1)
        keep[:, 0] = True
        w = w * keep
        if bool((min_p > 0).any()):
            w.masked_fill_(w < min_p, 0.0)
        tokens = ids.gather(1, _inverse_cdf(w, u).unsqueeze(1)).squeeze(1)

        if width < vocab and no_k:
            # Rows whose head holds less than top_p of the mass need tokens beyond it: widen the head
            # (eventually a full sort) for them.
            short = cum[:, -1] < p_col.squeeze(1) * z
            short[[r for r, k in enumerate(top_k) if k > 0]] = False
            if bool(short.any()):
                rows = short.nonzero().squeeze(1)
                sel = rows.tolist()
                tokens[rows] = self._sample_head(x[rows], temps[rows], min_p[rows], u[rows], [0] * len(sel),
                                                 [top_p[r] for r in sel], min(vocab, width * 8))
        return tokens

    @staticmethod
    def _gather_logprobs(logits: Tensor, token_ids: list[int], wanted: list[int | None],
                         masked: Sequence[int] = ()) -> list[dict[int, float] | None]:
        """``masked``: grammar rows, whose top tokens stop at the last one the grammar allows (a -inf logprob
        is no answer, and no transport's JSON carries it)."""
        rows = [i for i, n in enumerate(wanted) if n is not None]
        result: list[dict[int, float] | None] = [None] * len(wanted)
        if not rows:
            return result
        device = logits.device
        lp = torch.log_softmax(logits[_rows(rows, device)], dim=-1)
        max_n = min(max(wanted[i] or 0 for i in rows), lp.shape[1])
        top_vals, top_ids = lp.topk(max_n, dim=-1) if max_n > 0 else (lp[:, :0], lp[:, :0].long())
        sampled = lp.gather(1, _rows([token_ids[i] for i in rows], device).unsqueeze(1)).squeeze(1)
        top_vals_l, top_ids_l, sampled_l = top_vals.tolist(), top_ids.tolist(), sampled.tolist()
        for r, i in enumerate(rows):
            n = wanted[i] or 0
            entry = dict(zip(top_ids_l[r][:n], top_vals_l[r][:n], strict=True))
            if i in masked:
                entry = {t: v for t, v in entry.items() if v != _MASK}
            entry.setdefault(token_ids[i], sampled_l[r])
            result[i] = entry
        return result
