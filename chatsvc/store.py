"""Redis store: personas, sessions with their messages, per-reply event streams and the turn lock.

Keys (prefix ``chatsvc:``):
- ``personas``                 hash name -> JSON {system_prompt, description}
- ``personas:seeded``          set once the default personas were written (so deletions stick)
- ``session:{id}``             hash: id, owner, persona, system_prompt, title, created, updated, turns
- ``session:{id}:messages``    list of JSON messages
- ``session:{id}:lock``        held while a reply is generated (SET NX): the 409 guard
- ``owner:{owner}:sessions``   sorted set of session ids by creation time
- ``stream:{id}:{turn}``       Redis Stream of one reply's events, short TTL
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

P = "chatsvc:"

# KEYS: one stream key per event; ARGV: the events' JSON, then the TTL. An XADD that fails comes back
# as "!<error>" in its place (stream ids never start with "!"), so the others still stand.
_APPEND_EVENTS_LUA = """
local ttl = ARGV[#ARGV]
local out = {}
local seen = {}
for i, key in ipairs(KEYS) do
  local id = redis.pcall('XADD', key, '*', 'e', ARGV[i])
  if type(id) == 'table' and id.err then out[i] = '!' .. id.err else out[i] = id end
  seen[key] = true
end
for key in pairs(seen) do redis.pcall('EXPIRE', key, ttl) end
return out
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

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "persona": self.persona, "title": self.title, "created": self.created,
                "updated": self.updated, "turns": self.turns}


class Store:
    def __init__(self, redis: aioredis.Redis, session_ttl_s: int, stream_ttl_s: int) -> None:
        # Any: redis-py's annotations cannot express decode_responses=True (everything here is str).
        self.r: Any = redis
        self.session_ttl_s = session_ttl_s
        self.stream_ttl_s = stream_ttl_s
        self._append_script: Any = None

    @classmethod
    def from_url(cls, url: str, session_ttl_s: int = 7 * 24 * 3600, stream_ttl_s: int = 300) -> Store:
        # Short timeouts: an unreachable Redis must fail session routes quickly (503), not hang them.
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2,
                                         socket_timeout=10, health_check_interval=15)
        return cls(client, session_ttl_s, stream_ttl_s)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.r.ping())
        except Exception:
            return False

    # -- personas ---------------------------------------------------------------------------------
    async def seed_personas(self, defaults: dict[str, dict[str, str]]) -> None:
        if await self.r.set(P + "personas:seeded", "1", nx=True):
            for name, body in defaults.items():
                await self.r.hsetnx(P + "personas", name, json.dumps(body))

    async def list_personas(self) -> dict[str, dict[str, str]]:
        raw = await self.r.hgetall(P + "personas")
        return {name: json.loads(v) for name, v in sorted(raw.items())}

    async def get_persona(self, name: str) -> dict[str, str] | None:
        raw = await self.r.hget(P + "personas", name)
        return json.loads(raw) if raw else None

    async def put_persona(self, name: str, body: dict[str, str]) -> bool:
        """Returns True when the persona was created (False: replaced)."""
        return bool(await self.r.hset(P + "personas", name, json.dumps(body)))

    async def delete_persona(self, name: str) -> bool:
        return bool(await self.r.hdel(P + "personas", name))

    # -- sessions ---------------------------------------------------------------------------------
    def _skey(self, sid: str) -> str:
        return f"{P}session:{sid}"

    async def create_session(self, owner: str, persona: str, system_prompt: str, title: str = "") -> SessionMeta:
        now = time.time()
        meta = SessionMeta(secrets.token_urlsafe(18), owner, persona, system_prompt, title, now, now, 0)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self._skey(meta.id), mapping={
                "id": meta.id, "owner": owner, "persona": persona, "system_prompt": system_prompt,
                "title": title, "created": now, "updated": now, "turns": 0})
            pipe.expire(self._skey(meta.id), self.session_ttl_s)
            pipe.zadd(f"{P}owner:{owner}:sessions", {meta.id: now})
            pipe.expire(f"{P}owner:{owner}:sessions", self.session_ttl_s)
            await pipe.execute()
        return meta

    async def get_session(self, sid: str, owner: str) -> SessionMeta | None:
        """The session if it exists and belongs to ``owner`` (a foreign session looks absent)."""
        raw = await self.r.hgetall(self._skey(sid))
        if not raw or raw.get("owner") != owner:
            return None
        return SessionMeta(raw["id"], raw["owner"], raw["persona"], raw["system_prompt"], raw.get("title", ""),
                           float(raw["created"]), float(raw["updated"]), int(raw["turns"]))

    async def list_sessions(self, owner: str, limit: int = 100) -> list[SessionMeta]:
        key = f"{P}owner:{owner}:sessions"
        ids = await self.r.zrevrange(key, 0, limit - 1)
        out = []
        for sid in ids:
            meta = await self.get_session(sid, owner)
            if meta is None:
                await self.r.zrem(key, sid)  # expired: drop the stale index entry
            else:
                out.append(meta)
        return out

    async def delete_session(self, sid: str, owner: str) -> bool:
        if await self.get_session(sid, owner) is None:
            return False
        keys = [self._skey(sid), self._skey(sid) + ":messages", self._skey(sid) + ":lock"]
        keys += [k async for k in self.r.scan_iter(match=f"{P}stream:{sid}:*")]
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(*keys)
            pipe.zrem(f"{P}owner:{owner}:sessions", sid)
            await pipe.execute()
        return True

    async def messages(self, sid: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in await self.r.lrange(self._skey(sid) + ":messages", 0, -1)]

    async def begin_turn(self, sid: str, user_message: dict[str, Any], owner: str | None = None) -> int | None:
        """Take the session's lock and append the user message; None if a reply is already running.

        The lock makes a turn append exactly once under concurrent requests: the loser gets 409.
        """
        lock = self._skey(sid) + ":lock"
        if not await self.r.set(lock, "1", nx=True, ex=3600):
            return None
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.rpush(self._skey(sid) + ":messages", json.dumps(user_message))
                pipe.hincrby(self._skey(sid), "turns", 1)
                pipe.hset(self._skey(sid), "updated", time.time())
                self._touch(pipe, sid)
                if owner is not None:  # an active session keeps its owner's index alive too
                    pipe.expire(f"{P}owner:{owner}:sessions", self.session_ttl_s)
                res = await pipe.execute()
            if not await self.r.hget(self._skey(sid), "title"):
                # An untitled session is named after its first message, for the session list.
                text = " ".join(str(user_message.get("content", "")).split())
                await self.r.hset(self._skey(sid), "title", text[:60])
            return int(res[1])
        except BaseException:
            await self.r.delete(lock)
            raise

    async def rollback_turn(self, sid: str) -> None:
        """Undo begin_turn when generation could not even start (queue full, invalid request)."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.rpop(self._skey(sid) + ":messages")
            pipe.hincrby(self._skey(sid), "turns", -1)
            pipe.delete(self._skey(sid) + ":lock")
            await pipe.execute()

    async def end_turn(self, sid: str, assistant_message: dict[str, Any]) -> None:
        # Only while the session still exists: it may have been deleted mid-reply.
        if await self.r.exists(self._skey(sid)):
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.rpush(self._skey(sid) + ":messages", json.dumps(assistant_message))
                pipe.hset(self._skey(sid), "updated", time.time())
                self._touch(pipe, sid)
                pipe.delete(self._skey(sid) + ":lock")
                await pipe.execute()
        else:
            await self.r.delete(self._skey(sid) + ":messages", self._skey(sid) + ":lock")

    async def is_busy(self, sid: str) -> bool:
        return bool(await self.r.exists(self._skey(sid) + ":lock"))

    def _touch(self, pipe: Any, sid: str) -> None:
        for key in (self._skey(sid), self._skey(sid) + ":messages"):
            pipe.expire(key, self.session_ttl_s)

    # -- reply streams ----------------------------------------------------------------------------
    def stream_key(self, sid: str, turn: int) -> str:
        return f"{P}stream:{sid}:{turn}"

    async def append_event(self, sid: str, turn: int, event: dict[str, Any]) -> str:
        key = self.stream_key(sid, turn)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xadd(key, {"e": json.dumps(event)})
            pipe.expire(key, self.stream_ttl_s)
            res = await pipe.execute()
        return str(res[0])

    async def append_events(self, items: Sequence[tuple[str, str]]) -> list[str | Exception]:
        """XADD every (stream key, event JSON) in order, in one command (a Lua script: atomic, and one
        reply to parse instead of several per event). Returns each one's stream id, or the error Redis
        answered for that XADD alone; a lost connection raises.

        Each stream's TTL is refreshed once per batch, after its events.
        """
        if self._append_script is None:
            self._append_script = self.r.register_script(_APPEND_EVENTS_LUA)
        res = await self._append_script(keys=[key for key, _ in items],
                                        args=[*(data for _, data in items), self.stream_ttl_s])
        return [ResponseError(eid[1:]) if eid.startswith("!") else eid for eid in res]

    async def read_events(self, sid: str, turn: int, after: str, block_ms: int) -> list[tuple[str, dict[str, Any]]]:
        """Events after stream id ``after`` ("0" = from the start), waiting up to ``block_ms`` for new ones."""
        return [(eid, ev) for eid, ev, _ in await self.read_events_json(sid, turn, after, block_ms)]

    async def read_events_json(self, sid: str, turn: int, after: str,
                               block_ms: int) -> list[tuple[str, dict[str, Any], str]]:
        """:meth:`read_events`, with each event's JSON as stored: (stream id, event, JSON)."""
        # XREAD BLOCK 0 would wait forever: 0 here means "do not block".
        res = await self.r.xread({self.stream_key(sid, turn): after}, block=block_ms or None, count=256)
        out: list[tuple[str, dict[str, Any], str]] = []
        for _key, entries in res or []:
            out.extend((eid, json.loads(fields["e"]), fields["e"]) for eid, fields in entries)
        return out

    async def stream_exists(self, sid: str, turn: int) -> bool:
        return bool(await self.r.exists(self.stream_key(sid, turn)))


# Called once per event with (stream id, None) once it is stored, or (None, error) if it was not.
WriteCallback = Callable[[str | None, BaseException | None], None]


class EventWriter:
    """Writes reply events to their streams, coalescing everything appended while a write is in flight
    (and everything appended in the same event-loop pass) into one :meth:`Store.append_events` call.

    An engine step hands every running turn its delta at once; written one XADD transaction per delta,
    the gateway spent several socket round trips per token. Events of one stream are written in the
    order they were appended. Once a write of a stream failed, its later events are refused (they would
    leave a gap a resuming reader could not see), except a ``final`` one: the terminal event that says
    how the reply ended.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: list[tuple[str, str, bool, WriteCallback]] = []
        self._failed: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def append(self, key: str, data: str, done: WriteCallback, final: bool = False) -> None:
        """Queue one event (``data``: its JSON) for stream ``key``; ``done`` is called once it is written."""
        self._queue.append((key, data, final, done))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-writer")

    async def write(self, key: str, data: str, final: bool = False) -> str:
        """Append and wait: the event's stream id (it comes after every event appended before it)."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def done(eid: str | None, exc: BaseException | None) -> None:
            if fut.done():
                return
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(str(eid))

        self.append(key, data, done, final)
        return await fut

    def forget(self, key: str) -> None:
        """The stream gets no more events: drop its failure mark."""
        self._failed.discard(key)

    async def _run(self) -> None:
        todo: list[tuple[str, str, bool, WriteCallback]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                todo = []
                for item in batch:
                    if item[0] in self._failed and not item[2]:
                        item[3](None, RuntimeError("an earlier event of this stream was not stored"))
                    else:
                        todo.append(item)
                if not todo:
                    continue
                results: list[str | Exception]
                try:
                    results = await self.store.append_events([(key, data) for key, data, _, _ in todo])
                except Exception as exc:  # noqa: BLE001 - the whole batch is lost: every writer hears
                    results = [exc] * len(todo)
                for (key, _, _, done), res in zip(todo, results, strict=True):
                    if isinstance(res, Exception):
                        self._failed.add(key)
                        done(None, res)
                    else:
                        done(res, None)
                todo = []
        except BaseException as exc:  # cancelled (shutdown): nothing queued may wait forever
            pending, self._queue = todo + self._queue, []
            for _, _, _, done in pending:
                done(None, exc)
            raise
        finally:
            self._task = None
