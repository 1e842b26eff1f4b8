"""What every part of the store shares: one Redis connection, the gateway's identity on it, the TTLs, and
the cache of registered Lua scripts."""

from __future__ import annotations

import secrets
from typing import Any, Self

import redis.asyncio as aioredis

from chatsvc.settings import SESSION_TTL_S, STREAM_TTL_S


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
                                         socket_timeout=10, health_check_interval=15)
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
