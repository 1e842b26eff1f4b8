"""Sessions in Redis: each one's hash and message list, and each owner's index of them."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import (
    lock_key,
    messages_key,
    owner_sessions_key,
    prompt_key,
    session_key,
    stream_prefix,
)

# A shared prompt outlives every session that read it: each read sets its TTL to the session TTL plus this.
PROMPT_TTL_MARGIN_S = 24 * 3600

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

# KEYS: session, messages; ARGV: before (an absolute message index, '' for after the newest), limit, '1' to
# count the user messages. Absolute indices count the messages retention trimmed, so they never shift.
# Returns {trimmed, stored, user messages (-1 when not asked), the page's messages}.
_PAGE_LUA = """
local trimmed = tonumber(redis.call('HGET', KEYS[1], 'trimmed_messages') or '0')
local n = redis.call('LLEN', KEYS[2])
local stop = n
if ARGV[1] ~= '' then stop = math.min(n, math.max(0, tonumber(ARGV[1]) - trimmed)) end
local start = math.max(0, stop - tonumber(ARGV[2]))
local users = -1
if ARGV[3] == '1' then
  users = tonumber(redis.call('HGET', KEYS[1], 'user_messages') or '-1')
  if users < 0 then  -- a session stored before the count was kept: counted once
    users = 0
    for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
      local ok, m = pcall(cjson.decode, raw)
      if ok and type(m) == 'table' and m.role == 'user' then users = users + 1 end
    end
    if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'user_messages', users) end
  end
end
local items = {}
if stop > start then items = redis.call('LRANGE', KEYS[2], start, stop - 1) end
return {trimmed, n, users, items}
"""

log = logging.getLogger("chatsvc.store")


def prompt_sha(system_prompt: str) -> str:
    return hashlib.sha256(system_prompt.encode()).hexdigest()


@dataclass(frozen=True)
class MessagePage:
    """Consecutive messages of a session; indices are absolute (the first message ever is 0, trimmed or not)."""

    messages: list[dict[str, Any]]
    first_index: int
    message_count: int  # messages in the conversation, trimmed ones included: the newest's index + 1
    trimmed: int  # the oldest messages retention dropped: indices below this are gone
    user_messages: int = -1  # user messages in the whole conversation (-1: not counted)

    @property
    def has_more(self) -> bool:
        """Older messages are still stored."""
        return self.first_index > self.trimmed

    def public(self) -> dict[str, Any]:
        return {"messages": self.messages, "first_index": self.first_index, "has_more": self.has_more,
                "message_count": self.message_count, "trimmed_messages": self.trimmed}


@dataclass
class SessionMeta:
    id: str
    owner: str
    persona: str
    system_prompt: str  # resolved from prompt_sha by get_session and meta_of ("" in a listing)
    title: str
    created: float
    updated: float
    turns: int
    # The session's OpenAI ``response_format`` as JSON text ("" for none): each turn's unless its message
    # sends its own. Kept as text: the store holds it, the gateway validates it (chatsvc.schemas).
    response_format: str = ""
    prompt_sha: str = ""  # "" for a session that holds its prompt inline
    # Its shared prompt copy is gone (a Redis memory policy evicted it): the session and its messages still
    # read, but no turn can be generated as the model saw the earlier ones (chatsvc.turns refuses with 410).
    prompt_lost: bool = False

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "persona": self.persona, "title": self.title, "created": self.created,
                "updated": self.updated, "turns": self.turns,
                "response_format": json.loads(self.response_format) if self.response_format else None,
                **({"system_prompt_lost": True} if self.prompt_lost else {})}


def _meta(raw: dict[str, str], owner: str) -> SessionMeta | None:
    if not raw or raw.get("owner") != owner:
        return None
    return SessionMeta(raw["id"], raw["owner"], raw["persona"], raw.get("system_prompt", ""), raw.get("title", ""),
                       float(raw["created"]), float(raw["updated"]), int(raw["turns"]),
                       raw.get("response_format", ""), raw.get("prompt_sha", ""))


def new_session_id() -> str:
    return secrets.token_urlsafe(21)


class SessionStore(RedisStore):
    async def create_session(self, owner: str, persona: str, system_prompt: str, title: str = "",
                             sid: str | None = None, response_format: str = "") -> SessionMeta:
        now = time.time()
        sha = prompt_sha(system_prompt)
        meta = SessionMeta(sid or new_session_id(), owner, persona, system_prompt, title, now, now, 0,
                           response_format, sha)
        key, index = session_key(meta.id), owner_sessions_key(owner)
        fields = {"id": meta.id, "owner": owner, "persona": persona, "prompt_sha": sha, "title": title,
                  "created": now, "updated": now, "turns": 0, "response_format": response_format, "replied": 0,
                  "trimmed_messages": 0, "history_bytes": 0, "user_messages": 0}
        async with self.r.pipeline(transaction=True) as pipe:
            # The prompt is stored once, whatever number of sessions use it (personas are few, sessions many).
            pipe.set(prompt_key(sha), system_prompt, ex=self.session_ttl_s + PROMPT_TTL_MARGIN_S)
            pipe.hset(key, mapping=fields)
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
        return await self._resolved(_meta(await self.r.hgetall(session_key(sid)), owner))

    async def meta_of(self, sid: str) -> SessionMeta | None:
        """The session whoever owns it (a gateway taking over a turn acts for its owner)."""
        raw = await self.r.hgetall(session_key(sid))
        return await self._resolved(_meta(raw, raw.get("owner", "")) if raw else None)

    async def _resolved(self, meta: SessionMeta | None) -> SessionMeta | None:
        """``meta`` with its system prompt read from the shared copy, whose TTL this use refreshes (every turn
        reads its session first, so the prompt outlives the session). A session holding its prompt inline
        is returned as it is."""
        if meta is None or not meta.prompt_sha:
            return meta
        prompt = await self.r.getex(prompt_key(meta.prompt_sha), ex=self.session_ttl_s + PROMPT_TTL_MARGIN_S)
        if prompt is None:
            log.warning("system prompt %s of session %s is no longer stored", meta.prompt_sha, meta.id)
            meta.prompt_lost = True
            return meta
        meta.system_prompt = prompt
        return meta

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
        """Every stored message (tests and tools; a route reads a page)."""
        return [json.loads(m) for m in await self.r.lrange(messages_key(sid), 0, -1)]

    async def message_page(self, sid: str, limit: int, before: int | None = None,
                           count_users: bool = False) -> MessagePage:
        """Up to ``limit`` messages before the absolute index ``before`` (None: the newest), read and decoded
        alone: never the whole list. ``count_users``: also count the conversation's user messages."""
        trimmed, stored, users, raws = await self._script(_PAGE_LUA)(
            keys=[session_key(sid), messages_key(sid)],
            args=["" if before is None else before, limit, "1" if count_users else "0"])
        trimmed, stored = int(trimmed), int(stored)
        stop = trimmed + stored if before is None else max(trimmed, min(before, trimmed + stored))
        return MessagePage([json.loads(m) for m in raws], stop - len(raws), trimmed + stored, trimmed, int(users))
