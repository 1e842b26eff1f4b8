"""What every part of the store shares: one Redis connection, the gateway's identity on it, the TTLs, and
the cache of registered Lua scripts."""

from __future__ import annotations

import secrets
from typing import Any, Self

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    BusyLoadingError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chatsvc.settings import SESSION_TTL_S, STREAM_TTL_S

# What Redis answers when it refuses a command without applying it: memory pressure (OOM under maxmemory), a
# replica or a Sentinel failover in progress (READONLY, MASTERDOWN), a restart still loading its data
# (LOADING). Any command, idempotent or not, may be sent again after one of these.
REFUSED_ERRORS: tuple[type[Exception], ...] = (OutOfMemoryError, ReadOnlyError, MasterDownError, BusyLoadingError)
# What a write that must not be lost (a finished reply) is retried on until its deadline: the refusals above,
# and a connection lost or timed out (then only idempotent writes are retried: one may have been applied).
RETRIED_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, *REFUSED_ERRORS)
# Each command rides out a short refusal by itself (about a second): a failover's switch, a moment over
# maxmemory. A longer one is the caller's (a finished reply waits in memory: chatsvc.turns).
COMMAND_RETRIES = 4


def command_retry() -> Retry:
    """redis-py's retry of each command, on connection errors and timeouts (its defaults) and refusals."""
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), COMMAND_RETRIES)


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
    def from_url(cls, url: str, session_ttl_s: int = SESSION_TTL_S, stream_ttl_s: int = STREAM_TTL_S,
                 instance: str | None = None) -> Self:
        # Short timeouts: an unreachable Redis must fail session routes quickly (503), not hang them.
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2,
                                         socket_timeout=10, health_check_interval=15, retry=command_retry(),
                                         retry_on_error=list(REFUSED_ERRORS))
        return cls(client, session_ttl_s, stream_ttl_s, instance)

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
