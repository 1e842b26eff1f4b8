"""Which gateway processes are alive: instance heartbeats, the owner tokens of session locks and whether
a lock's holder still lives, and the control channel through which gateways ask each other about the
turns they generate.

A lock is dead when ``instance:<name>`` no longer holds its nonce: the process stopped heartbeating, or a
process with the same name (same host and port) started since.
"""

from __future__ import annotations

import json
from typing import Any

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import INSTANCES, control_key, instance_key, lock_key, locks_key

LOCK_TTL_S = 30  # a lock its owner stopped refreshing frees itself this soon
INSTANCE_TTL_S = 10  # an instance that stopped heartbeating counts as dead this soon
CONTROL_TTL_S = INSTANCE_TTL_S * 6  # requests to a gateway that stopped reading them are dropped this soon

# Compare-and-delete: a successor of the same name that beats meanwhile stays alive.
_STEP_DOWN_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Liveness(RedisStore):
    @property
    def holder(self) -> str:
        """This process as a lock names it: ``instance|nonce``."""
        return f"{self.instance}|{self.nonce}"

    def lock_token(self, turn: int) -> str:
        return f"{self.holder}|{turn}"

    def locks_key(self, name: str | None = None) -> str:
        """The index of the sessions whose lock the instance ``name`` (default: this one) took."""
        return locks_key(name or self.instance)

    async def heartbeat(self) -> None:
        """Say this instance is alive (and, on the first beat, that its predecessor of the same name is not)."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(instance_key(self.instance), self.nonce, ex=INSTANCE_TTL_S)
            pipe.sadd(INSTANCES, self.instance)
            await pipe.execute()

    async def retire(self) -> None:
        """At a clean shutdown: this instance holds nothing any more."""
        key = instance_key(self.instance)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.scard(locks_key(self.instance))
            current, held = await pipe.execute()
        if current == self.nonce and held == 0:
            await self.r.delete(key)

    async def step_down(self) -> None:
        """Count as dead from now on, locks held or not: the other gateways' next sweep takes this instance's
        turns over, instead of after its heartbeat's TTL. Only once nothing here heartbeats or writes any more."""
        await self._script(_STEP_DOWN_LUA)(keys=[instance_key(self.instance)], args=[self.nonce])

    async def peers_alive(self) -> bool:
        """Another instance heartbeats: one that can take this one's turns over."""
        names = [n for n in await self.r.smembers(INSTANCES) if n != self.instance]
        async with self.r.pipeline(transaction=False) as pipe:  # not MGET: the keys lie in several cluster slots
            for name in names:
                pipe.exists(instance_key(name))
            return any(await pipe.execute())

    async def lock_view(self, sid: str) -> tuple[str, bool, str | None]:
        """(the session's lock, '' for none; whether its holder is alive; the holder's instance name)."""
        lock = await self.r.get(lock_key(sid))
        if lock is None:
            return "", False, None
        name, sep, rest = lock.partition("|")
        nonce, sep2, turn = rest.partition("|")
        if not (sep and sep2 and turn.isdigit()):
            return lock, False, None
        if f"{name}|{nonce}" == self.holder:
            return lock, True, name
        return lock, await self.r.get(instance_key(name)) == nonce, name

    async def send_control(self, instance: str, message: dict[str, Any]) -> None:
        """Push a request (``cancel``, ``detach``) to the gateway ``instance`` about a turn it generates."""
        key = control_key(instance)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.rpush(key, json.dumps(message))
            pipe.expire(key, CONTROL_TTL_S)
            await pipe.execute()

    async def next_control(self, timeout_s: float) -> dict[str, Any] | None:
        """The next control request to this instance, waiting up to ``timeout_s`` for one."""
        got = await self.r.blpop([control_key(self.instance)], timeout=timeout_s)
        return None if got is None else dict(json.loads(got[1]))
