"""Per-key quotas: concurrent generations, new sessions per minute, open WebSockets, readers of a reply. Only with API keys
(without them there is one owner, the operator). Past a quota: 429 with Retry-After (a WS error frame)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from typing import TYPE_CHECKING

from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.settings import Settings

if TYPE_CHECKING:
    from chatsvc.turns import ActiveTurn


def _limited(what: str, limit: int, retry_after: int) -> APIError:
    return APIError(429, f"{what} (at most {limit} per key); retry later", code="quota_exceeded",
                    headers={"Retry-After": str(retry_after)})


class Quotas:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.streams: Counter[str] = Counter()  # owner -> stateless (OpenAI route) generations running
        self.sockets: Counter[str] = Counter()
        self.sessions: defaultdict[str, deque[float]] = defaultdict(deque)

    def applies(self, owner: str) -> bool:
        return owner != ANON

    def check_stream(self, owner: str, session_turns: int) -> None:
        """Refuse a new generation when ``owner`` already runs its quota (OpenAI requests plus session turns)."""
        limit = self.settings.max_streams_per_key
        if self.applies(owner) and self.streams[owner] + session_turns >= limit:
            raise _limited("too many concurrent generations", limit, self.settings.retry_after_s)

    def start_stream(self, owner: str, session_turns: int = 0) -> None:
        self.check_stream(owner, session_turns)
        self.streams[owner] += 1

    def end_stream(self, owner: str) -> None:
        self.streams[owner] -= 1
        if self.streams[owner] <= 0:
            del self.streams[owner]

    def check_readers(self, at: ActiveTurn | None) -> None:
        """Refuse one more reader of a running reply past ``max_readers_per_reply`` (each holds a buffer
        and a send loop; one key could otherwise attach thousands to one cheap reply)."""
        limit = self.settings.max_readers_per_reply
        if at is not None and at.readers >= limit:
            raise _limited("too many readers of this reply", limit, self.settings.retry_after_s)

    def new_session(self, owner: str) -> None:
        if not self.applies(owner):
            return
        limit, now = self.settings.max_sessions_per_minute, time.monotonic()
        times = self.sessions[owner]
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) >= limit:
            raise _limited("too many new sessions this minute", limit, int(60.0 - (now - times[0])) + 1)
        times.append(now)

    def open_socket(self, owner: str) -> None:
        limit = self.settings.max_sockets_per_key
        if self.applies(owner) and self.sockets[owner] >= limit:
            raise _limited("too many open WebSockets", limit, self.settings.retry_after_s)
        self.sockets[owner] += 1

    def close_socket(self, owner: str) -> None:
        self.sockets[owner] -= 1
        if self.sockets[owner] <= 0:
            del self.sockets[owner]


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
