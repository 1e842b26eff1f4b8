"""Per-key quotas: concurrent generations, requests waiting for the engine, new sessions per minute, open
WebSockets, readers of a reply. Only with API keys (without them there is one owner, the operator). Past a
quota: 429 with Retry-After (a WS error frame), counted in ``chatsvc_quota_refused_total{quota}``."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.settings import Settings

if TYPE_CHECKING:
    from chatsvc.metrics import Metrics
    from chatsvc.turns import ActiveTurn
    from engine.client import EngineClient


class Quotas:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, engine: EngineClient | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine = engine  # whose waiting queue the waiting share is of
        self.streams: Counter[str] = Counter()  # owner -> stateless (OpenAI route) generations running
        self.waiting: Counter[str] = Counter()  # owner -> requests admitted that have no first token yet
        self.sockets: Counter[str] = Counter()
        self.sessions: defaultdict[str, deque[float]] = defaultdict(deque)

    def _limited(self, quota: str, what: str, limit: int, retry_after: int | None = None) -> APIError:
        if self.metrics is not None:
            self.metrics.quota_refused.labels(quota).inc()
        return APIError(429, f"{what} (at most {limit} per key); retry later", code="quota_exceeded",
                        headers={"Retry-After": str(retry_after or self.settings.retry_after_s)})

    def applies(self, owner: str) -> bool:
        return owner != ANON

    def check_stream(self, owner: str, session_turns: int) -> None:
        """Refuse a new generation when ``owner`` already runs its quota (OpenAI requests plus session turns)."""
        limit = self.settings.max_streams_per_key
        if self.applies(owner) and self.streams[owner] + session_turns >= limit:
            raise self._limited("streams", "too many concurrent generations", limit)

    def start_stream(self, owner: str, session_turns: int = 0) -> None:
        self.check_stream(owner, session_turns)
        self.streams[owner] += 1

    def end_stream(self, owner: str) -> None:
        _give_back(self.streams, owner)

    def waiting_limit(self) -> int | None:
        """``max_waiting_share`` of the engine's waiting queue (at least 1); None when the engine does not say
        how long its queue is."""
        size = self.engine.stats().max_waiting if self.engine is not None else 0
        return None if size <= 0 else max(1, math.floor(self.settings.max_waiting_share * size))

    @contextlib.contextmanager
    def admitting(self, owner: str) -> Iterator[None]:
        """Hold one of ``owner``'s places in the engine's waiting queue while a request is admitted (until its
        first token): past the key's share, 429 before anything is queued."""
        limit = self.waiting_limit() if self.applies(owner) else None
        if limit is not None and self.waiting[owner] >= limit:
            raise self._limited("waiting", "too many requests waiting for the engine", limit)
        self.waiting[owner] += 1
        try:
            yield
        finally:
            _give_back(self.waiting, owner)

    def check_readers(self, at: ActiveTurn | None) -> None:
        """Refuse one more reader of a running reply past ``max_readers_per_reply`` (each holds a buffer
        and a send loop; one key could otherwise attach thousands to one cheap reply)."""
        limit = self.settings.max_readers_per_reply
        if at is not None and at.readers >= limit:
            raise self._limited("readers", "too many readers of this reply", limit)

    def new_session(self, owner: str) -> None:
        if not self.applies(owner):
            return
        limit, now = self.settings.max_sessions_per_minute, time.monotonic()
        times = self.sessions[owner]
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) >= limit:
            raise self._limited("sessions", "too many new sessions this minute", limit,
                                int(60.0 - (now - times[0])) + 1)
        times.append(now)

    def open_socket(self, owner: str) -> None:
        limit = self.settings.max_sockets_per_key
        if self.applies(owner) and self.sockets[owner] >= limit:
            raise self._limited("sockets", "too many open WebSockets", limit)
        self.sockets[owner] += 1

    def close_socket(self, owner: str) -> None:
        _give_back(self.sockets, owner)


def _give_back(counts: Counter[str], owner: str) -> None:
    """One of ``owner``'s places in ``counts`` back; an owner holding none leaves the counter."""
    counts[owner] -= 1
    if counts[owner] <= 0:
        del counts[owner]


class FrameBudget:
    """A token bucket per WebSocket: ``rate`` frames a second with bursts of twice that."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = 2 * rate
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(2 * self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
