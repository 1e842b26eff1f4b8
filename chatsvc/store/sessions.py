"""Sessions in Redis: each one's hash and message list, and each owner's index of them."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import lock_key, messages_key, owner_sessions_key, session_key, stream_prefix

# KEYS: session; ARGV: owner, then field/value pairs. Only an existing session of that owner changes (an
# HSET on an expired or foreign id would create or overwrite one).
_UPDATE_SESSION_LUA = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: session, messages, lock; ARGV: owner, the session's stream key prefix. The reply streams are
# named by turn number (and share the session's hash tag), so they are deleted without scanning.
_DELETE_SESSION_LUA = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
for t = 1, turns do redis.call('DEL', ARGV[2] .. t) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""


@dataclass
class SessionMeta:
    id: str
    owner: str
    persona: str
    system_prompt: str
    title: str
    created: float
    updated: float
    turns: int
    # The session's OpenAI ``response_format`` as JSON text ("" for none): each turn's unless its message
    # sends its own. Kept as text: the store holds it, the gateway validates it (chatsvc.schemas).
    response_format: str = ""

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "persona": self.persona, "title": self.title, "created": self.created,
                "updated": self.updated, "turns": self.turns,
                "response_format": json.loads(self.response_format) if self.response_format else None}


def _meta(raw: dict[str, str], owner: str) -> SessionMeta | None:
    if not raw or raw.get("owner") != owner:
        return None
    return SessionMeta(raw["id"], raw["owner"], raw["persona"], raw["system_prompt"], raw.get("title", ""),
                       float(raw["created"]), float(raw["updated"]), int(raw["turns"]),
                       raw.get("response_format", ""))


def new_session_id() -> str:
    return secrets.token_urlsafe(21)


class SessionStore(RedisStore):
    async def create_session(self, owner: str, persona: str, system_prompt: str, title: str = "",
                             sid: str | None = None, response_format: str = "") -> SessionMeta:
        now = time.time()
        meta = SessionMeta(sid or new_session_id(), owner, persona, system_prompt, title, now, now, 0,
                           response_format)
        key, index = session_key(meta.id), owner_sessions_key(owner)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={**dataclasses.asdict(meta), "replied": 0})
            pipe.expire(key, self.session_ttl_s)
            pipe.zadd(index, {meta.id: now})
            pipe.expire(index, self.session_ttl_s)
            await pipe.execute()
        return meta

    async def update_session(self, sid: str, owner: str, **fields: str) -> SessionMeta | None:
        """Sets the given settings (``title``, ``response_format``) of ``owner``'s session; None where there
        is no such session (expired, deleted, another owner's)."""
        unknown = set(fields) - {"title", "response_format"}
        if unknown:
            raise ValueError(f"not a session setting: {', '.join(sorted(unknown))}")
        pairs = [x for item in fields.items() for x in item]
        if not await self._script(_UPDATE_SESSION_LUA)(keys=[session_key(sid)], args=[owner, *pairs]):
            return None
        return await self.get_session(sid, owner)

    async def get_session(self, sid: str, owner: str) -> SessionMeta | None:
        """The session if it exists and belongs to ``owner`` (a foreign session looks absent)."""
        return _meta(await self.r.hgetall(session_key(sid)), owner)

    async def meta_of(self, sid: str) -> SessionMeta | None:
        """The session whoever owns it (a gateway taking over a turn acts for its owner)."""
        raw = await self.r.hgetall(session_key(sid))
        return _meta(raw, raw.get("owner", "")) if raw else None

    async def list_sessions(self, owner: str, limit: int = 100) -> list[SessionMeta]:
        index = owner_sessions_key(owner)
        ids = await self.r.zrevrange(index, 0, limit - 1)
        async with self.r.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hgetall(session_key(sid))
            raws = await pipe.execute()
        metas = [_meta(raw, owner) for raw in raws]
        stale = [sid for sid, meta in zip(ids, metas, strict=True) if meta is None]
        if stale:  # expired sessions leave the index as soon as they are seen
            await self.r.zrem(index, *stale)
        return [meta for meta in metas if meta is not None]

    async def delete_session(self, sid: str, owner: str) -> bool:
        keys = [session_key(sid), messages_key(sid), lock_key(sid)]
        if not await self._script(_DELETE_SESSION_LUA)(keys=keys, args=[owner, stream_prefix(sid)]):
            return False
        await self.r.zrem(owner_sessions_key(owner), sid)
        return True

    async def messages(self, sid: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in await self.r.lrange(messages_key(sid), 0, -1)]
