"""Turn one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One row per sequence that samples this step (``n > 1`` samples are separate rows). The order of
operations follows vLLM: stop tokens are suppressed until ``min_tokens``, then repetition,
frequency and presence penalties, temperature, top-k, top-p, min-p, and a draw. Logprobs are
the log-softmax of the raw model logits (vLLM's default ``raw_logprobs``), so they do not
depend on the sampling settings.

Work is done only for the rows that need it, and an all-greedy batch without penalties or
logprobs is a single ``argmax``: the decode loop calls this every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.request import SamplingParams

_MASK = float("-inf")


@dataclass(frozen=True)
class SamplingBatch:
    """What the sampler needs to know about each row; all lists have one entry per row."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    eos_token_ids: frozenset[int]

    def __post_init__(self) -> None:
        n = len(self.params)
        if not (len(self.prompt_token_ids) == len(self.output_token_ids) == len(self.generators) == n):
            raise ValueError("SamplingBatch lists must all have one entry per row")


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} holding the top ``params.logprobs`` tokens in descending order,
    # then the sampled token if it is not among them. None when the row did not ask.
    logprobs: list[dict[int, float] | None]


def make_generator(
    seed: int | None, index: int, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """A generator for sample ``index`` of a request with ``seed``; None when unseeded.

    Sample 0 uses the seed itself; other samples mix in the index so the ``n`` samples of one
    seeded request differ from each other yet are each reproducible.
    """
    if seed is None:
        return None
    mixed = (seed ^ (index * 0x9E3779B97F4A7C15)) & 0xFFFF_FFFF_FFFF_FFFF
    gen = torch.Generator(device=device)
    gen.manual_seed(mixed)
    return gen


def _rows(idx: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(idx), dtype=torch.long, device=device)


def _column(values: Sequence[float], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device).unsqueeze(1)


def suppress_stop_tokens(logits: Tensor, batch: SamplingBatch) -> None:
    """Before ``min_tokens`` outputs, EOS and ``stop_token_ids`` may not be sampled. In place."""
    vocab = logits.shape[1]
    for i, (p, out) in enumerate(zip(batch.params, batch.output_token_ids, strict=True)):
        if len(out) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= batch.eos_token_ids
        banned = [t for t in stops if 0 <= t < vocab]
        if banned:
            logits[i, banned] = _MASK


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> None:
    """Repetition penalty over prompt + output (HF/vLLM); presence and frequency over output (OpenAI).

    In place, and only on the rows that set a penalty.
    """
    rows = [i for i, p in enumerate(batch.params) if _has_penalty(p)]
    if not rows:
        return
    device = logits.device
    vocab = logits.shape[1]
    idx = _rows(rows, device)
    sub = logits[idx]
    counts = torch.zeros_like(sub)
    seen = torch.zeros_like(sub, dtype=torch.bool)
    for r, i in enumerate(rows):
        out = torch.tensor(batch.output_token_ids[i], dtype=torch.long, device=device)
        out = out[(out >= 0) & (out < vocab)]
        counts[r].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        if batch.params[i].repetition_penalty != 1.0:
            prompt = torch.tensor(batch.prompt_token_ids[i], dtype=torch.long, device=device)
            seen[r, prompt[(prompt >= 0) & (prompt < vocab)]] = True
    seen |= counts > 0

    rep = _column([batch.params[i].repetition_penalty for i in rows], device)
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    freq = _column([batch.params[i].frequency_penalty for i in rows], device)
    presence = _column([batch.params[i].presence_penalty for i in rows], device)
    sub = sub - freq * counts - presence * (counts > 0).to(sub.dtype)
    logits[idx] = sub


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class Sampler:
    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch.params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(batch.params)} rows")
        logits = logits.float()
        params = batch.params
        num_rows = len(params)
        logprobs = [p.logprobs for p in params]

        outputs = batch.output_token_ids
        plain = not any(self._needs_processing(p, len(o)) for p, o in zip(params, outputs, strict=True))
        if plain and all(p.greedy for p in params):
            token_ids: list[int] = logits.argmax(dim=-1).tolist()
            return SamplerOutput(token_ids, self._gather_logprobs(logits, token_ids, logprobs))

        # Processing writes in place; the caller's logits stay intact and the raw ones feed logprobs.
        processed = logits.clone()
        suppress_stop_tokens(processed, batch)
        apply_penalties(processed, batch)

        token_ids = [0] * num_rows
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            picked = processed[_rows(greedy_rows, logits.device)].argmax(dim=-1).tolist()
            for i, tok in zip(greedy_rows, picked, strict=True):
                token_ids[i] = tok
        if random_rows:
            picked = self._sample(processed, random_rows, batch)
            for i, tok in zip(random_rows, picked, strict=True):
                token_ids[i] = tok
        return SamplerOutput(token_ids, self._gather_logprobs(logits, token_ids, logprobs))

    @staticmethod
    def _needs_processing(p: SamplingParams, num_output: int) -> bool:
        return num_output < p.min_tokens or _has_penalty(p)

    def _sample(self, logits: Tensor, rows: list[int], batch: SamplingBatch) -> list[int]:
        device = logits.device
        params = [batch.params[i] for i in rows]
        sub = logits[_rows(rows, device)] / _column([p.temperature for p in params], device)

        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            sub = self._top_k_top_p(sub, top_k, top_p)
        elif any(k > 0 for k in top_k):
            sub = self._top_k(sub, top_k)

        probs = torch.softmax(sub, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            # min-p keeps tokens at least ``min_p`` times as likely as the most likely one.
            threshold = probs.amax(dim=-1, keepdim=True) * _column(min_p, device)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return self._draw(probs, [batch.generators[i] for i in rows])

    @staticmethod
    def _top_k(logits: Tensor, top_k: list[int]) -> Tensor:
        vocab = logits.shape[1]
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        # Ties with the k-th value survive: cheaper than a sort and harmless for sampling.
        top_vals = logits.topk(max(ks), dim=-1).values
        kth = top_vals.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
        return logits.masked_fill(logits < kth, _MASK)

    @staticmethod
    def _top_k_top_p(logits: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
        device = logits.device
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks, _MASK)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass strictly before it is below top_p; the top token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= _column(top_p, device)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        return torch.full_like(logits, _MASK).scatter(1, order, sorted_logits)

    @staticmethod
    def _draw(probs: Tensor, generators: list[torch.Generator | None]) -> list[int]:
        """Sample one token per row as argmax(p / E) with E ~ Exp(1): exact categorical sampling.

        Seeded rows draw their noise from their own generator and nothing else does, so a seeded
        sequence's tokens do not depend on which other rows share the batch.
        """
        noise = torch.empty_like(probs)
        unseeded = [r for r, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            noise.exponential_()
        else:
            if unseeded:
                idx = _rows(unseeded, probs.device)
                noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
            for r, gen in enumerate(generators):
                if gen is None:
                    continue
                row = torch.empty(probs.shape[1], device=gen.device).exponential_(generator=gen)
                noise[r] = row.to(probs.device)
        # A zero draw would divide 0 by 0 for masked tokens; the smallest positive float is harmless.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1).tolist()

    @staticmethod
    def _gather_logprobs(
        logits: Tensor, token_ids: list[int], wanted: list[int | None]
    ) -> list[dict[int, float] | None]:
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
            entry.setdefault(token_ids[i], sampled_l[r])
            result[i] = entry
        return result
