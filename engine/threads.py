"""How many OpenMP threads the engine's next step runs on, chosen from the step times it has seen.

On a machine whose cores the engine shares (the gateway, its clients, Redis), a step on every core can be
several times slower than a step on one core fewer: a step runs a few hundred short parallel regions, and
each one waits at its barrier for whichever team thread the kernel has preempted. With the cores free, the
same step is faster on every core. Neither fixed count is right for a server, so the engine measures
(``benchmarks/serving_ab.py`` compares this against fixed counts).

The choice is between all the engine's threads and one fewer (the core the other processes want). Steps
are grouped by size (tokens, in powers of two): a group's time per step is kept for each thread count as a
moving average of the median of its last three steps, so one slow step (a client's burst, a page fault
storm) moves nothing and two in a row do; a plain average would let one slow step on every thread put the
engine on one fewer until the next retry. The count running keeps running until the other's figure is
faster by ``margin``: two figures within noise of each other do not flip the count back and forth.
The other count is retried, one step, once its figure is older than its retry interval; a retry that loses
doubles that interval (up to ``max_retry_s``), one that wins resets it. A retry costs one slower step per
interval, so backing off keeps that cost small where the other count keeps losing (a retry at a fixed
interval would pay it every interval), while the current count's own figure rising past the other's by the
margin switches without waiting for a retry.

Large steps (``all_threads_from`` tokens and more: prefill chunks) always run on every thread. Their
parallel regions are long, so a preempted team thread delays each by a small fraction of it, and a retry
there is what a wave of new prompts waits for: a chunk retried on one thread fewer takes much longer, and
every request of that chunk sees its first token that much later. Smaller steps that carry a prompt (its
last chunk, or a short prompt joining the decodes) run on their size's faster count but are never the retry
either: such a step retried on one thread fewer can take about twice as long, and both the prompts' first
tokens and every decode's next token wait on it. Decode-only steps do the retrying.

No torch here: the engine applies the count (``torch.set_num_threads``) and reports the step's time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["ThreadGovernor"]


@dataclass
class _Figure:
    seconds: float  # moving average of the median of the last three steps' wall times
    at: float  # when it was last measured
    recent: list[float] = field(default_factory=list)  # the last three wall times, as measured

    def add(self, seconds: float, now: float, smoothing: float) -> None:
        self.recent = [*self.recent[-2:], seconds]
        self.seconds += smoothing * (statistics.median(self.recent) - self.seconds)
        self.at = now


class ThreadGovernor:
    def __init__(self, max_threads: int, *, retry_s: float = 1.0, max_retry_s: float = 16.0,
                 smoothing: float = 0.3, margin: float = 1.1, all_threads_from: int = 512) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.candidates: tuple[int, ...] = (max_threads, max_threads - 1) if max_threads > 1 else (1,)
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self.smoothing, self.margin = smoothing, margin
        self.all_threads_from = all_threads_from
        self._figures: dict[tuple[int, int], _Figure] = {}
        self._interval: dict[tuple[int, int], float] = {}
        self._probing: tuple[int, int] | None = None
        self._running: dict[int, int] = {}  # size group -> the count its steps run on (retries aside)
        self.switches = 0
        self._last_choice = max_threads

    @staticmethod
    def group(tokens: int) -> int:
        return max(1, tokens).bit_length()

    def choose(self, tokens: int, now: float, *, prefill: bool = False) -> int:
        """The thread count for a step of ``tokens`` tokens starting at ``now`` (seconds, any clock);
        ``prefill``: the step carries prompt tokens, so it is not used to retry the slower count."""
        g = self.group(tokens)
        known = {n: f for n in self.candidates if (f := self._figures.get((g, n))) is not None}
        if tokens >= self.all_threads_from or not known:  # a new size: the other count from the next step on
            self._probing = None
            return self._count(self.max_threads)
        fastest = min(known, key=lambda n: known[n].seconds)
        best = self._running.get(g, self.max_threads)
        if best not in known or known[fastest].seconds * self.margin < known[best].seconds:
            best = fastest
        self._running[g] = best
        choice, self._probing = best, None
        if prefill:
            return self._count(choice)
        for n in self.candidates:
            if n == best:
                continue
            figure = known.get(n)
            if figure is None or now - figure.at >= self._interval.get((g, n), self.retry_s):
                choice, self._probing = n, (g, n)
                break
        return self._count(choice)

    def _count(self, choice: int) -> int:
        if choice != self._last_choice:
            self.switches += 1
            self._last_choice = choice
        return choice

    def observe(self, threads: int, tokens: int, seconds: float, now: float) -> None:
        """Record that a step of ``tokens`` tokens took ``seconds`` on ``threads`` threads, ending at ``now``."""
        if tokens >= self.all_threads_from:
            return
        key = (self.group(tokens), threads)
        figure = self._figures.get(key)
        if self._probing == key:
            # A retry measures a figure that is stale by design: it replaces the old one.
            others = [f.seconds for (g, n), f in self._figures.items() if g == key[0] and n != threads]
            lost = bool(others) and seconds > min(others)
            interval = self._interval.get(key, self.retry_s)
            self._interval[key] = min(2 * interval, self.max_retry_s) if lost else self.retry_s
            self._probing = figure = None
        if figure is None:
            self._figures[key] = _Figure(seconds, now, [seconds])
        else:
            figure.add(seconds, now, self.smoothing)

    def stats(self) -> dict[str, float]:
        """Per size group and thread count, the average step time in ms (for logs and /metrics)."""
        return {f"{1 << (g - 1)}+ tokens/{n} threads": round(f.seconds * 1e3, 2)
                for (g, n), f in sorted(self._figures.items())}
