"""Personas in Redis: the shared ones (one hash, seeded once with the defaults) and each owner's own."""

from __future__ import annotations

import json

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import PERSONAS, owner_personas_key

SEEDED_FIELD = ":seeded"  # in the personas hash; ':' is not allowed in a persona's name
# KEYS: personas hash; ARGV: the seeded flag's field, then name, JSON, name, JSON, ...
_SEED_PERSONAS_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], '1') == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: the scope's hash; ARGV: name, JSON, most personas. 1 created, 0 replaced, -1 refused (full): the
# count and the write in one step, so concurrent PUTs cannot both take the last place.
_PUT_LIMITED_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return -1
end
return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
"""


class PersonaLimitReached(Exception):
    """The scope already holds as many personas as it may."""


def _key(owner: str | None) -> str:
    """The hash of ``owner``'s personas; the shared ones for None."""
    return PERSONAS if owner is None else owner_personas_key(owner)


class PersonaStore(RedisStore):
    """Persona bodies by name: ``owner=None`` is the shared scope, any other owner has a scope of its own."""

    async def seed_personas(self, defaults: dict[str, dict[str, str]]) -> None:
        """Write the default shared personas once per Redis: a default deleted later stays deleted."""
        args = [SEEDED_FIELD, *(v for name, body in defaults.items() for v in (name, json.dumps(body)))]
        await self._script(_SEED_PERSONAS_LUA)(keys=[PERSONAS], args=args)

    async def list_personas(self, owner: str | None = None) -> dict[str, dict[str, str]]:
        """The scope's personas by name, in name order."""
        raw = await self.r.hgetall(_key(owner))
        return {name: json.loads(body) for name, body in sorted(raw.items()) if name != SEEDED_FIELD}

    async def get_persona(self, name: str, owner: str | None = None) -> dict[str, str] | None:
        if name == SEEDED_FIELD:
            return None
        raw = await self.r.hget(_key(owner), name)
        return None if raw is None else dict(json.loads(raw))

    async def put_persona(self, name: str, body: dict[str, str], owner: str | None = None,
                          limit: int | None = None) -> bool:
        """Returns True when the persona was created (False: replaced). With ``limit``, a new persona is
        refused (:class:`PersonaLimitReached`) once the scope holds that many."""
        key = _key(owner)
        if limit is None:
            return bool(await self.r.hset(key, name, json.dumps(body)))
        created = int(await self._script(_PUT_LIMITED_LUA)(keys=[key], args=[name, json.dumps(body), limit]))
        if created < 0:
            raise PersonaLimitReached(limit)
        return bool(created)

    async def persona_room(self, name: str, owner: str, limit: int) -> bool:
        """Whether ``owner`` may write ``name`` now (it exists, or there is room): a cheap early look,
        so a PUT that would be refused runs no prefill; :meth:`put_persona` decides atomically."""
        key = _key(owner)
        return bool(await self.r.hexists(key, name)) or int(await self.r.hlen(key)) < limit

    async def delete_persona(self, name: str, owner: str | None = None) -> bool:
        return bool(await self.r.hdel(_key(owner), name))
