"""The request traces of the paper's latency experiments (Figs. 12-14 and 17) and their Poisson arrivals.

Each trace is a list of ``TraceRequest``: the prompt as token ids and the request's true output length, which
the run generates exactly (``ignore_eos``) and which the Orca Pow2 / Oracle baselines reserve for.

- ShareGPT: the real first-turn prompts of ``../shared/data/sharegpt_prompts_1000.json`` in the model's chat
  template (their token lengths as they are). The file holds no replies, so output lengths are drawn from a
  log-normal distribution whose mean the caller states (the paper's ShareGPT outputs average 338 tokens; a
  run on 2 CPU cores takes a fraction of that).
- Alpaca-like: no installed package ships the Alpaca data set, so it is synthesised from the paper's means
  (input 19.31, output 58.45 tokens): both lengths log-normal; the prompt is the tail of a ShareGPT prompt cut
  to its drawn length (real text, and the chat template's assistant header at its end).
- Chatbot: ShareGPT prompts drawn into conversations of several turns; the prompt is the last ``context``
  tokens of the conversation so far (the paper's last 1,024), the reply's length drawn as ShareGPT's.

Arrivals: a Poisson process at ``rate`` requests/s (exponential gaps) from one seeded generator, so every
policy at a given rate sees the same requests at the same times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PAPER_ALPACA_INPUT_MEAN = 19.31
PAPER_ALPACA_OUTPUT_MEAN = 58.45
PAPER_SHAREGPT_OUTPUT_MEAN = 337.99
# Spread of the log-normal lengths: ShareGPT's and Alpaca's length histograms (paper Fig. 11) are long-tailed
# with most mass within a factor of ~3 of the median.
LENGTH_SIGMA = 0.7


@dataclass(frozen=True)
class TraceRequest:
    prompt_ids: tuple[int, ...]
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.output_tokens


def lognormal_lengths(rng: random.Random, count: int, mean: float, low: int, high: int,
                      sigma: float = LENGTH_SIGMA) -> list[int]:
    """``count`` integer lengths, log-normal with mean ``mean`` (before clipping to ``[low, high]``)."""
    if not 1 <= low <= high or mean <= 0:
        raise ValueError(f"need 1 <= low <= high and mean > 0, got {low}, {high}, {mean}")
    mu = math.log(mean) - sigma * sigma / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def sharegpt_trace(prompts: list[list[int]], count: int, output_mean: float, max_output: int,
                   max_model_len: int, seed: int) -> list[TraceRequest]:
    """``count`` ShareGPT prompts (drawn with replacement, those that leave room for ``max_output``) with
    log-normal output lengths of mean ``output_mean``, each request fitting ``max_model_len``."""
    rng = random.Random(seed)
    usable = [p for p in prompts if len(p) + max_output <= max_model_len]
    if not usable:
        raise ValueError(f"no prompt fits max_model_len {max_model_len} with {max_output} output tokens")
    outputs = lognormal_lengths(rng, count, output_mean, 1, max_output)
    return [TraceRequest(tuple(rng.choice(usable)), out) for out in outputs]


def alpaca_like_trace(prompts: list[list[int]], count: int, seed: int, input_mean: float = PAPER_ALPACA_INPUT_MEAN,
                      output_mean: float = PAPER_ALPACA_OUTPUT_MEAN, max_input: int = 128,
                      max_output: int = 256) -> list[TraceRequest]:
    """Short prompts and replies with the paper's Alpaca means; the prompt is the last ``n`` tokens of a
    ShareGPT prompt at least that long."""
    rng = random.Random(seed)
    inputs = lognormal_lengths(rng, count, input_mean, 4, max_input)
    outputs = lognormal_lengths(rng, count, output_mean, 1, max_output)
    trace = []
    for n, out in zip(inputs, outputs, strict=True):
        source = rng.choice([p for p in prompts if len(p) >= n])
        trace.append(TraceRequest(tuple(source[-n:]), out))
    return trace


def chatbot_trace(prompts: list[list[int]], count: int, context: int, output_mean: float, max_output: int,
                  seed: int, turns: tuple[int, int] = (2, 8)) -> list[TraceRequest]:
    """``count`` chatbot requests: a conversation of ``turns`` ShareGPT prompts (the trace has no replies, so
    the history is the users' turns), the prompt its last ``context`` tokens, the reply log-normal."""
    rng = random.Random(seed)
    outputs = lognormal_lengths(rng, count, output_mean, 1, max_output)
    trace = []
    for out in outputs:
        history: list[int] = []
        for _ in range(rng.randint(*turns)):
            history.extend(rng.choice(prompts))
        trace.append(TraceRequest(tuple(history[-context:]), out))
    return trace


def poisson_arrivals(rate: float, duration_s: float, seed: int, min_requests: int = 1) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process at ``rate`` requests/s over
    ``duration_s``; at least ``min_requests`` of them (the process continued past ``duration_s``), so a
    low rate still measures something."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.expovariate(rate)
    while t <= duration_s or len(times) < min_requests:
        times.append(t)
        t += rng.expovariate(rate)
    return times
