"""Prefill tokens a minute per key (``max_prefill_tokens_per_minute``): an OpenAI request, a session turn
and a persona write each pay their prompt's tokens before the engine sees them. Past the budget: 429 with
``Retry-After`` (the seconds until the window has room for this prompt); a prompt larger than the whole
budget can never pass: 413 ``prompt_too_large``. Only with API keys, like the other quotas.

The window is the ``limits`` library's sliding window counter in Redis, on the store's own connection
pool (its URL, credentials, database and retries), so every gateway on one Redis charges one budget. It
holds two counters per key, this window's and the last one's, the last weighted by how much of it still
overlaps the past minute; a moving window would keep one list entry per token (100k a key). Its times are
Redis key TTLs, so gateways whose clocks differ agree on them. A charge is not given back when the engine
then refuses the request: the budget meters work asked for, and a refused burst is what it guards against."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.settings import Settings
from chatsvc.store.keys import P

if TYPE_CHECKING:
    from chatsvc.metrics import Metrics

KEY_PREFIX = P + "rate"


def seconds_until_room(window: tuple[int, float, int, float], cost: int, limit: int, period_s: float) -> float:
    """Seconds until a sliding window counter (``(previous count, its TTL, current count, its TTL)`` as
    ``limits`` reads it, TTLs in seconds) has room for ``cost`` more under ``limit``.

    The current window's key lives two periods, so it ends ``current TTL - period`` from now, when the
    previous window's TTL runs out too. Until then the previous count weighs ``its TTL / period``; after
    it, the current count becomes the previous one and decays the same way from full weight."""
    previous, previous_ttl, current, current_ttl = window
    if current + cost <= limit:
        if previous == 0:
            return 0.0
        return max(0.0, previous_ttl - (limit - current - cost) * period_s / previous)
    ends_in = max(0.0, current_ttl - period_s)
    return ends_in + period_s * (1 - (limit - cost) / current)


class Rates:
    def __init__(self, settings: Settings, redis: Any, metrics: Metrics | None = None) -> None:
        self.limit = settings.max_prefill_tokens_per_minute
        self.metrics = metrics
        self.item = RateLimitItemPerMinute(self.limit, namespace="prefill_tokens")
        self.storage = RedisStorage("async+redis://", implementation="redispy", key_prefix=KEY_PREFIX,
                                    connection_pool=redis.connection_pool)
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)

    async def charge(self, owner: str, tokens: int, param: str | None = None) -> None:
        """Charge ``owner`` ``tokens`` prompt tokens now, or refuse the request (413, 429)."""
        if owner == ANON:
            return
        if tokens > self.limit:
            self._refused()
            raise APIError(413, f"the prompt is {tokens} tokens; a key may prefill at most {self.limit} a "
                           "minute", code="prompt_too_large", param=param)
        if await self.limiter.hit(self.item, owner, cost=tokens):
            return
        self._refused()
        window = await self.storage.get_sliding_window(self.item.key_for(owner), self.item.get_expiry())
        wait = seconds_until_room(window, tokens, self.limit, self.item.get_expiry())
        raise APIError(429, f"too many prompt tokens this minute ({tokens} asked; at most {self.limit} per key); "
                       "retry later", code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def _refused(self) -> None:
        if self.metrics is not None:
            self.metrics.quota_refused.labels("prefill_tokens").inc()
