"""Per-key quotas: concurrent generations (counted in requests and in sequences), requests waiting for the
engine, new sessions per minute, live sessions, open WebSockets, open ``/v1/kv/stream`` connections, readers of a reply.
Only with API keys (without them there is one owner, the operator). Past a quota: 429 with Retry-After (a
WS error frame), counted in ``chatsvc_quota_refused_total{quota}``.

Every quota but the waiting share (a share of this gateway's engine queue) and the readers of a reply (a
turn generated here) lives in Redis (:mod:`chatsvc.store.quotas`), so every gateway on one Redis counts the
same places, and a place is taken in one atomic step before the work it pays for starts. A place is given
back exactly once through its :class:`Lease`; the gateway renews the places it holds, so a crashed
gateway's places lapse ``quota_lease_ttl_s`` after its last renewal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.settings import Settings
from chatsvc.store.keys import quota_key
from chatsvc.store.quotas import QuotaPlace, QuotaStore

if TYPE_CHECKING:
    from chatsvc.metrics import Metrics
    from chatsvc.turns import ActiveTurn
    from engine.client import EngineClient

log = logging.getLogger("chatsvc.quotas")
UNLIMITED = 1 << 30
SESSION_WINDOW_MS = 60_000


class Lease:
    """Places held in the shared quotas, given back exactly once (idempotent :meth:`release`)."""

    def __init__(self, quotas: Quotas | None = None, place: QuotaPlace | None = None) -> None:
        self._quotas, self._place = quotas, place

    @property
    def held(self) -> bool:
        return self._place is not None

    async def release(self) -> None:
        place, self._place = self._place, None
        if place is not None and self._quotas is not None:
            await self._quotas.give_back(place)


class Quotas:
    def __init__(self, settings: Settings, store: QuotaStore, metrics: Metrics | None = None,
                 engine: EngineClient | None = None) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.engine = engine  # whose waiting queue the waiting share is of
        self.waiting: Counter[str] = Counter()  # owner -> requests admitted that have no first token yet
        self.held: set[QuotaPlace] = set()  # places this gateway holds and renews
        self._renewer: asyncio.Task[None] | None = None
        self._giving_back: set[asyncio.Task[None]] = set()  # referenced until done (the loop holds weak refs)

    def _limited(self, quota: str, what: str, limit: int, retry_after: int | None = None) -> APIError:
        if self.metrics is not None:
            self.metrics.quota_refused.labels(quota).inc()
        return APIError(429, f"{what} (at most {limit} per key); retry later", code="quota_exceeded",
                        headers={"Retry-After": str(retry_after or self.settings.retry_after_s)})

    def applies(self, owner: str) -> bool:
        return owner != ANON

    @property
    def _ttl_ms(self) -> int:
        return int(self.settings.quota_lease_ttl_s * 1000)

    # -- places in Redis --------------------------------------------------------------------------
    async def give_back(self, place: QuotaPlace) -> None:
        """Give ``place`` back; a caller cancelled meanwhile (a client gone, a stream closed in the middle
        of its cleanup) does not stop it."""
        self.held.discard(place)
        task = asyncio.create_task(self._give_back(place))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)
        await asyncio.shield(task)

    async def _give_back(self, place: QuotaPlace) -> None:
        try:
            await self.store.give_back_place(place)
        except RedisError as exc:  # not renewed any more: it lapses by itself
            log.warning("could not give back a quota place (it lapses in %.0f s): %r",
                        self.settings.quota_lease_ttl_s, exc)

    async def open(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew(), name="quota-renewer")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None

    async def _renew(self) -> None:
        # Three renewals fit in a place's lifetime: one slow or failed renewal does not let it lapse.
        while True:
            await asyncio.sleep(self.settings.quota_lease_ttl_s / 3)
            try:
                await self.store.renew_places(list(self.held), self._ttl_ms)
            except RedisError as exc:
                log.warning("could not renew quota places: %r", exc)

    # -- the quotas -------------------------------------------------------------------------------
    async def reserve_generation(self, owner: str, sequences: int = 1) -> Lease:
        """One of ``owner``'s concurrent generations, weighing ``sequences`` (n, best_of or beam width):
        past ``max_streams_per_key`` requests or ``max_sequences_per_key`` sequences, 429."""
        if not self.applies(owner):
            return Lease()
        s = self.settings
        got = await self.store.take_place(owner, "generations", secrets.token_hex(8), sequences,
                                          s.max_streams_per_key, s.max_sequences_per_key, self._ttl_ms)
        if isinstance(got, QuotaPlace):
            self.held.add(got)
            return Lease(self, got)
        if got.by_weight:
            raise self._limited("sequences", f"too many concurrent sequences ({sequences} asked)",
                                s.max_sequences_per_key)
        raise self._limited("streams", "too many concurrent generations", s.max_streams_per_key)

    async def new_session(self, owner: str) -> None:
        """One of ``owner``'s new sessions this minute (a sliding window: places lapse after a minute)."""
        if not self.applies(owner):
            return
        limit = self.settings.max_sessions_per_minute
        got = await self.store.take_place(owner, "sessions", secrets.token_hex(8), 1, limit, UNLIMITED,
                                          SESSION_WINDOW_MS)
        if not isinstance(got, QuotaPlace):
            raise self._limited("sessions", "too many new sessions this minute", limit, got.wait_ms // 1000 + 1)

    # A live session holds a place named by its id, lapsing when the session would expire (its idle TTL,
    # renewed by each turn) and given back when it is deleted.
    def _session_place(self, owner: str, sid: str) -> QuotaPlace:
        return QuotaPlace(quota_key(owner, "live_sessions"), f"{sid}:1")

    async def live_session(self, owner: str, sid: str) -> None:
        """Count a new session ``sid`` against ``owner``'s live sessions (429 past ``max_live_sessions_per_key``)."""
        if not self.applies(owner):
            return
        limit = self.settings.max_live_sessions_per_key
        got = await self.store.take_place(owner, "live_sessions", sid, 1, limit, UNLIMITED,
                                          self.settings.session_ttl_s * 1000)
        if not isinstance(got, QuotaPlace):
            raise self._limited("live_sessions", "too many live sessions; delete some", limit,
                                self.settings.retry_after_s)

    async def session_used(self, owner: str, sid: str) -> None:
        """A turn renews the session's TTL; its place lives as long."""
        if self.applies(owner):
            await self.store.renew_places([self._session_place(owner, sid)], self.settings.session_ttl_s * 1000)

    async def session_gone(self, owner: str, sid: str) -> None:
        if self.applies(owner):
            await self.store.give_back_place(self._session_place(owner, sid))

    async def open_socket(self, owner: str) -> Lease:
        return await self._connection(owner, "sockets", "too many open WebSockets",
                                      self.settings.max_sockets_per_key)

    async def open_kv_stream(self, owner: str) -> Lease:
        return await self._connection(owner, "kv_streams", "too many open /v1/kv/stream connections",
                                      self.settings.max_kv_streams_per_key)

    async def _connection(self, owner: str, kind: str, what: str, limit: int) -> Lease:
        if not self.applies(owner):
            return Lease()
        place = await self.store.take_place(owner, kind, secrets.token_hex(8), 1, limit, UNLIMITED, self._ttl_ms)
        if not isinstance(place, QuotaPlace):
            raise self._limited(kind, what, limit)
        self.held.add(place)
        return Lease(self, place)

    # -- this gateway's own -----------------------------------------------------------------------
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
            self.waiting[owner] -= 1
            if self.waiting[owner] <= 0:
                del self.waiting[owner]

    def check_readers(self, at: ActiveTurn | None) -> None:
        """Refuse one more reader of a running reply past ``max_readers_per_reply`` (each holds a buffer
        and a send loop; one key could otherwise attach thousands to one cheap reply)."""
        limit = self.settings.max_readers_per_reply
        if at is not None and at.readers >= limit:
            raise self._limited("readers", "too many readers of this reply", limit)


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
