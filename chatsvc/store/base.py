"""What every part of the store shares: one Redis connection, the gateway's identity on it, the TTLs, and
the cache of registered Lua scripts."""

from __future__ import annotations

import secrets
from typing import Any, Self

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chatsvc.redis_client import RedisTarget, connect, refused
from chatsvc.settings import SESSION_TTL_S, STREAM_TTL_S


def retried(exc: BaseException) -> bool:
    """Whether a write that must not be lost (a finished reply) is sent again after ``exc``, until its deadline:
    on a refusal Redis answers without applying the command (chatsvc.redis_client.refused), and on a connection
    lost or timed out (then only idempotent writes are retried: one may have been applied)."""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) or refused(exc)


class RedisStore:
    def __init__(self, redis: aioredis.Redis, session_ttl_s: int = SESSION_TTL_S,
                 stream_ttl_s: int = STREAM_TTL_S, instance: str | None = None) -> None:
        # Any: redis-py's annotations cannot express decode_responses=True (everything here is str).
        self.r: Any = redis
        self.session_ttl_s = session_ttl_s
        self.stream_ttl_s = stream_ttl_s
        # The instance name: stable across restarts where it can be (host:port), so a restarted gateway
        # recovers its predecessor's turns at once; the nonce tells this process from that predecessor.
        self.instance = (instance or secrets.token_hex(6)).replace("|", "_")
        self.nonce = secrets.token_hex(8)
        self._scripts: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: str | RedisTarget, session_ttl_s: int = SESSION_TTL_S,
                 stream_ttl_s: int = STREAM_TTL_S, instance: str | None = None) -> Self:
        """On a Redis URL, or a :class:`RedisTarget` (Sentinels, credentials)."""
        target = url if isinstance(url, RedisTarget) else RedisTarget(url=url)
        # A short timeout: an unreachable Redis must fail session routes quickly (503), not hang them.
        return cls(connect(target, socket_timeout=10), session_ttl_s, stream_ttl_s, instance)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.r.ping())
        except Exception:
            return False

    def _script(self, source: str) -> Any:
        if source not in self._scripts:
            self._scripts[source] = self.r.register_script(source)
        return self._scripts[source]
