"""Redis store: personas, sessions with their messages, per-reply event streams and the turn lock.

Keys (prefix ``chatsvc:``; ``{id}`` is written with its braces, a Redis Cluster hash tag):
- ``personas``                 hash name -> JSON {system_prompt, description}; the field ``:seeded`` (never
                               a persona name) is set once the defaults were written (so deletions stick)
- ``session:{id}``             hash: id, owner, persona, system_prompt, title, created, updated, turns,
                               replied (the last turn whose reply is stored: ``turns - 1`` while one runs)
- ``session:{id}:messages``    list of JSON messages
- ``session:{id}:lock``        held while a reply is generated: the 409 guard. Its value is the owner
                               token ``instance|nonce|turn``; it has a short TTL its owner refreshes
- ``owner:<owner>:sessions``   sorted set of session ids by creation time
- ``stream:{id}:<turn>``       Redis Stream of one reply's events, short TTL
- ``instance:<name>``          the nonce of the live gateway process called ``name``, short TTL (heartbeat)
- ``instance:<name>:locks``    session ids whose lock that instance took (found again without SCAN)
- ``instances``                names of instances that may hold locks
- ``stream:{id}:<turn>:readers`` sorted set: readers of a running reply on gateways other than the one
                               generating it -> their lease's end (ms); the generating gateway's abort grace
                               counts them (``readers``)
- ``instance:<name>:control``  list of JSON requests to the gateway ``name`` about the turns it generates
                               (``cancel``, ``detach``), pushed by other gateways (``send_control``)

A lock is dead when ``instance:<name>`` no longer holds its nonce: the process stopped heartbeating, or a
process with the same name (same host and port) started since. A dead lock's turn is recovered: the reply
so far is read back from its stream and stored with ``finish_reason: "interrupted"``. Every update of
more than one of a session's keys is one Lua script, so no reader sees half of it and no check-then-write
can race.

Redis Cluster: every key a script touches is one session's (all tagged ``{id}``, so in one hash slot) or
the personas hash alone. What a script cannot see there is read or written beside it: the lock holder's
liveness is read first and the script refuses to act if the lock changed meanwhile; the instance's lock
index is added to before a turn begins and pruned after it ends (a stale entry is harmless: recovery
finds nothing to do); the owner index is updated after. Ids issued before the hash tag (24 characters;
new ones have 28) keep their untagged keys, so existing sessions need no migration.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

P = "chatsvc:"
LEGACY_ID_LEN = 24  # secrets.token_urlsafe(18): the ids of sessions stored before keys were hash-tagged
LOCK_TTL_S = 30  # a lock its owner stopped refreshing frees itself this soon
INSTANCE_TTL_S = 10  # an instance that stopped heartbeating counts as dead this soon
LOCK_READ_TRIES = 5  # a lock that changes between reading it and acting on it is read again this often

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

# Shared by the turn scripts. KEYS[1..3]: session hash, its messages, its lock.
# ARGV[1]: the session's stream key prefix (the turn number follows), ARGV[2]: now, ARGV[3]: session TTL,
# ARGV[4]: stream TTL, ARGV[5]: the lock as the caller last read it ('' for none), ARGV[6]: '1' if that
# lock's holder was alive then (the caller read the holder's heartbeat key: another slot in a cluster).
_TURN_LUA_LIB = """
local STREAM, NOW, SESSION_TTL, STREAM_TTL, SEEN, SEEN_ALIVE = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]

-- The lock now, and whether its holder is alive; nil when it is not the lock the caller judged (retry).
local function lock_state()
  local lock = redis.call('GET', KEYS[3])
  if (lock or '') ~= SEEN then return nil end
  return lock, lock ~= false and SEEN_ALIVE == '1'
end

local function replied_of(turns)
  local r = redis.call('HGET', KEYS[1], 'replied')
  if r then return tonumber(r) end
  return turns  -- a session written before replies were tracked: nothing pending
end

-- Compare-and-delete of our lock (the caller takes it out of our instance's lock index).
local function release(token)
  if redis.call('GET', KEYS[3]) == token then redis.call('DEL', KEYS[3]) end
end

local function touch()
  redis.call('EXPIRE', KEYS[1], SESSION_TTL)
  redis.call('EXPIRE', KEYS[2], SESSION_TTL)
end

-- The pending turn (a user message without its reply) gets the reply its stream holds, as interrupted.
local function recover_pending()
  local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
  if replied_of(turns) >= turns then return 0 end
  local skey = STREAM .. turns
  local parts, tokens = {}, 0
  for _, entry in ipairs(redis.call('XRANGE', skey, '-', '+')) do
    local ok, ev = pcall(cjson.decode, entry[2][2])
    if ok and type(ev) == 'table' and ev.type == 'delta' then
      parts[#parts + 1] = tostring(ev.text or '')
      tokens = tokens + (tonumber(ev.tokens) or 0)
    end
  end
  local msg = {role = 'assistant', content = table.concat(parts), created = tonumber(NOW), tokens = tokens,
               finish_reason = 'interrupted', prompt_tokens = 0, cached_tokens = 0}
  local encoded = cjson.encode(msg)
  redis.call('RPUSH', KEYS[2], encoded)
  redis.call('HSET', KEYS[1], 'replied', turns, 'updated', NOW)
  touch()
  -- A client resuming this reply hears that it ended instead of waiting for more.
  local done = {type = 'done', finish_reason = 'interrupted', message = msg,
                usage = {prompt_tokens = 0, completion_tokens = tokens, total_tokens = tokens,
                         prompt_tokens_details = {cached_tokens = 0}}}
  redis.call('XADD', skey, '*', 'e', cjson.encode(done))
  redis.call('EXPIRE', skey, STREAM_TTL)
  return 1
end
"""

# ARGV[7]: user message JSON, [8]: title if untitled, [9]: lock TTL ms, [10]: our token prefix
# (instance|nonce). Returns the new turn, 0 (busy), -1 (no session) or -2 (the lock changed: read it again).
_BEGIN_TURN_LUA = _TURN_LUA_LIB + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local lock, alive = lock_state()
if lock == nil then return -2 end
if alive then return 0 end
recover_pending()
local turn = redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HSET', KEYS[1], 'replied', turn - 1, 'updated', NOW)
redis.call('RPUSH', KEYS[2], ARGV[7])
local title = redis.call('HGET', KEYS[1], 'title')
if not title or title == '' then redis.call('HSET', KEYS[1], 'title', ARGV[8]) end
redis.call('SET', KEYS[3], ARGV[10] .. '|' .. turn, 'PX', ARGV[9])
touch()
return turn
"""

# ARGV[7]: owner token, [8]: turn, [9]: assistant message JSON. Stores the reply once (a retry after a
# lost answer, or a turn recovered meanwhile, stores nothing), then releases the lock if still ours.
# Returns 1 (stored), 0 (already stored or superseded) or -1 (the session was deleted).
_END_TURN_LUA = _TURN_LUA_LIB + """
local token, turn, out = ARGV[7], tonumber(ARGV[8]), -1
if redis.call('EXISTS', KEYS[1]) == 1 then
  out = 0
  local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
  if turns == turn and replied_of(turns) < turn then
    redis.call('RPUSH', KEYS[2], ARGV[9])
    redis.call('HSET', KEYS[1], 'replied', turn, 'updated', NOW)
    touch()
    out = 1
  end
else
  redis.call('DEL', KEYS[2])  -- deleted mid-reply: no orphan message list
end
release(token)
return out
"""

# ARGV[7]: owner token, [8]: turn. Undoes begin_turn if that turn is still the pending one.
_ROLLBACK_TURN_LUA = _TURN_LUA_LIB + """
local token, turn = ARGV[7], tonumber(ARGV[8])
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
local out = 0
if turns == turn and replied_of(turns) < turn then
  redis.call('RPOP', KEYS[2])
  redis.call('HSET', KEYS[1], 'turns', turn - 1, 'replied', turn - 1)
  out = 1
end
release(token)
return out
"""

# ARGV[7]: owner token, [8]: turn, [9]: lock TTL ms. Extends our lock; takes it again if it expired
# (a long Redis outage) while the turn is still pending. 1: held, 0: lost to a recovery or a new turn.
_REFRESH_LOCK_LUA = _TURN_LUA_LIB + """
local token, turn = ARGV[7], tonumber(ARGV[8])
local lock = redis.call('GET', KEYS[3])
if lock == token then redis.call('PEXPIRE', KEYS[3], ARGV[9]) return 1 end
if lock then return 0 end
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
if turns == turn and replied_of(turns) < turn then
  redis.call('SET', KEYS[3], token, 'PX', ARGV[9])
  return 1
end
return 0
"""

# Recovers the session's pending turn unless a live instance holds its lock. 1: recovered (or nothing
# left to do), 0: alive, -1: the lock changed since the caller read it.
_RECOVER_LUA = _TURN_LUA_LIB + """
local lock, alive = lock_state()
if lock == nil then return -1 end
if alive then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then recover_pending() end
if lock then redis.call('DEL', KEYS[3]) end
return 1
"""

# KEYS[1]: a session's lock. ARGV[1]: the lock as read (its holder dead), [2]: the taker's token, [3]: lock
# TTL ms. 1: taken, 0: it changed meanwhile (recovered, taken or begun anew by another instance).
_TAKE_OVER_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
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

SEEDED_FIELD = ":seeded"  # in the personas hash; ':' is not allowed in a persona's name
# KEYS: personas hash; ARGV: '1' if an older server seeded them (its own flag key), then name, JSON, ...
_SEED_PERSONAS_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], '1') == 0 or ARGV[2] == '1' then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


def id_tag(sid: str) -> str:
    """A session id as its keys hold it: a hash tag, so a Redis Cluster keeps them in one slot."""
    return sid if len(sid) == LEGACY_ID_LEN else "{" + sid + "}"


def session_key(sid: str) -> str:
    """The session's hash; its messages and lock are this key with ``:messages`` and ``:lock``."""
    return f"{P}session:{id_tag(sid)}"


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


class SessionGone(LookupError):
    """The session was deleted (or expired) between loading it and starting a turn."""


class Store:
    def __init__(self, redis: aioredis.Redis, session_ttl_s: int, stream_ttl_s: int,
                 instance: str | None = None) -> None:
        # Any: redis-py's annotations cannot express decode_responses=True (everything here is str).
        self.r: Any = redis
        self.session_ttl_s = session_ttl_s
        self.stream_ttl_s = stream_ttl_s
        # The instance name: stable across restarts where it can be (host:port), so a restarted gateway
        # recovers its predecessor's turns at once; the nonce tells this process from that predecessor.
        self.instance = (instance or secrets.token_hex(6)).replace("|", "_")
        self.nonce = secrets.token_hex(8)
        self._me = f"{self.instance}|{self.nonce}"
        self._scripts: dict[str, Any] = {}

    @classmethod
    def from_url(cls, url: str, session_ttl_s: int = 7 * 24 * 3600, stream_ttl_s: int = 300,
                 instance: str | None = None) -> Store:
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
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.r.register_script(source)
        return script

    # -- personas ---------------------------------------------------------------------------------
    async def seed_personas(self, defaults: dict[str, dict[str, str]]) -> None:
        # Servers before the flag moved into the hash kept it in a key of its own (another cluster slot);
        # it only ever goes from absent to present, so reading it first cannot race.
        legacy = "1" if await self.r.exists(P + "personas:seeded") else "0"
        args = [SEEDED_FIELD, legacy, *(v for name, body in defaults.items() for v in (name, json.dumps(body)))]
        await self._script(_SEED_PERSONAS_LUA)(keys=[P + "personas"], args=args)

    async def list_personas(self) -> dict[str, dict[str, str]]:
        raw = await self.r.hgetall(P + "personas")
        return {name: json.loads(v) for name, v in sorted(raw.items()) if name != SEEDED_FIELD}

    async def get_persona(self, name: str) -> dict[str, str] | None:
        raw = None if name == SEEDED_FIELD else await self.r.hget(P + "personas", name)
        return json.loads(raw) if raw else None

    async def put_persona(self, name: str, body: dict[str, str]) -> bool:
        """Returns True when the persona was created (False: replaced)."""
        return bool(await self.r.hset(P + "personas", name, json.dumps(body)))

    async def delete_persona(self, name: str) -> bool:
        return bool(await self.r.hdel(P + "personas", name))

    # -- sessions ---------------------------------------------------------------------------------
    def _skey(self, sid: str) -> str:
        return session_key(sid)

    def messages_key(self, sid: str) -> str:
        return session_key(sid) + ":messages"

    def lock_key(self, sid: str) -> str:
        return session_key(sid) + ":lock"

    def _turn_keys(self, sid: str) -> list[str]:
        return [self._skey(sid), self.messages_key(sid), self.lock_key(sid)]

    def _turn_args(self, sid: str, lock: str = "", alive: bool = False, *extra: object) -> list[object]:
        return [self.stream_prefix(sid), time.time(), self.session_ttl_s, self.stream_ttl_s, lock,
                "1" if alive else "0", *extra]

    async def _lock_view(self, sid: str) -> tuple[str, bool, str | None]:
        """(the session's lock, '' for none; whether its holder is alive; the holder's instance name)."""
        lock = await self.r.get(self.lock_key(sid))
        if lock is None:
            return "", False, None
        name, sep, rest = lock.partition("|")
        nonce, sep2, turn = rest.partition("|")
        if not (sep and sep2 and turn.isdigit()):
            return lock, False, None
        if f"{name}|{nonce}" == self._me:
            return lock, True, name
        return lock, await self.r.get(f"{P}instance:{name}") == nonce, name

    def _locks_key(self, name: str | None = None) -> str:
        return f"{P}instance:{name or self.instance}:locks"

    async def create_session(self, owner: str, persona: str, system_prompt: str, title: str = "") -> SessionMeta:
        now = time.time()
        meta = SessionMeta(secrets.token_urlsafe(21), owner, persona, system_prompt, title, now, now, 0)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self._skey(meta.id), mapping={
                "id": meta.id, "owner": owner, "persona": persona, "system_prompt": system_prompt,
                "title": title, "created": now, "updated": now, "turns": 0, "replied": 0})
            pipe.expire(self._skey(meta.id), self.session_ttl_s)
            pipe.zadd(f"{P}owner:{owner}:sessions", {meta.id: now})
            pipe.expire(f"{P}owner:{owner}:sessions", self.session_ttl_s)
            await pipe.execute()
        return meta

    @staticmethod
    def _meta(raw: dict[str, str], owner: str) -> SessionMeta | None:
        if not raw or raw.get("owner") != owner:
            return None
        return SessionMeta(raw["id"], raw["owner"], raw["persona"], raw["system_prompt"], raw.get("title", ""),
                           float(raw["created"]), float(raw["updated"]), int(raw["turns"]))

    async def get_session(self, sid: str, owner: str) -> SessionMeta | None:
        """The session if it exists and belongs to ``owner`` (a foreign session looks absent)."""
        return self._meta(await self.r.hgetall(self._skey(sid)), owner)

    async def list_sessions(self, owner: str, limit: int = 100) -> list[SessionMeta]:
        key = f"{P}owner:{owner}:sessions"
        ids = await self.r.zrevrange(key, 0, limit - 1)
        async with self.r.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hgetall(self._skey(sid))
            raws = await pipe.execute()
        out, stale = [], []
        for sid, raw in zip(ids, raws, strict=True):
            meta = self._meta(raw, owner)
            if meta is None:
                stale.append(sid)
            else:
                out.append(meta)
        if stale:  # expired sessions leave the index as soon as they are seen
            await self.r.zrem(key, *stale)
        return out

    async def delete_session(self, sid: str, owner: str) -> bool:
        if not await self._script(_DELETE_SESSION_LUA)(keys=self._turn_keys(sid), args=[owner, self.stream_prefix(sid)]):
            return False
        await self.r.zrem(f"{P}owner:{owner}:sessions", sid)
        return True

    async def messages(self, sid: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in await self.r.lrange(self.messages_key(sid), 0, -1)]

    def lock_token(self, turn: int) -> str:
        return f"{self.instance}|{self.nonce}|{turn}"

    async def begin_turn(self, sid: str, user_message: dict[str, Any], owner: str | None = None) -> int | None:
        """Take the session's lock and append the user message, in one step; None if a live instance is
        already generating a reply. A lock left by a dead instance is taken over after its turn is
        recovered, so the history never holds two user messages in a row. Raises :class:`SessionGone`.
        """
        # An untitled session is named after its first message, for the session list.
        title = " ".join(str(user_message.get("content", "")).split())[:60]
        # Indexed before the lock exists, so a crash never leaves a lock its instance's index misses.
        added = await self.r.sadd(self._locks_key(), sid)  # 0: a turn of ours holds it (the script says busy)
        res = -2
        for _ in range(LOCK_READ_TRIES):
            lock, alive, _name = await self._lock_view(sid)
            res = int(await self._script(_BEGIN_TURN_LUA)(
                keys=self._turn_keys(sid),
                args=self._turn_args(sid, lock, alive, json.dumps(user_message), title, LOCK_TTL_S * 1000,
                                     self._me)))
            if res != -2:
                break
        if res <= 0 and added:
            await self.r.srem(self._locks_key(), sid)
        if res == -1:
            raise SessionGone(sid)
        if res > 0 and owner is not None:
            await self.r.expire(f"{P}owner:{owner}:sessions", self.session_ttl_s)
        return res if res > 0 else None

    async def rollback_turn(self, sid: str, turn: int) -> bool:
        """Undo begin_turn when generation could not even start (queue full, invalid request)."""
        out = bool(await self._script(_ROLLBACK_TURN_LUA)(
            keys=self._turn_keys(sid), args=self._turn_args(sid, "", False, self.lock_token(turn), turn)))
        await self.r.srem(self._locks_key(), sid)
        return out

    async def end_turn(self, sid: str, turn: int, assistant_message: dict[str, Any]) -> int:
        """Store the reply of ``turn`` and release its lock. Idempotent, so it may be retried after a
        lost answer: 1 stored now, 0 stored before (or recovered meanwhile), -1 the session is gone."""
        out = int(await self._script(_END_TURN_LUA)(
            keys=self._turn_keys(sid),
            args=self._turn_args(sid, "", False, self.lock_token(turn), turn, json.dumps(assistant_message))))
        await self.r.srem(self._locks_key(), sid)
        return out

    async def refresh_lock(self, sid: str, turn: int) -> bool:
        """Extend (or take back) the lock of our running ``turn``; False if it was lost."""
        return bool(await self._script(_REFRESH_LOCK_LUA)(
            keys=self._turn_keys(sid),
            args=self._turn_args(sid, "", False, self.lock_token(turn), turn, LOCK_TTL_S * 1000)))

    async def is_busy(self, sid: str) -> bool:
        """A live instance is generating a reply for the session."""
        return (await self._lock_view(sid))[1]

    async def lock_holder(self, sid: str) -> tuple[str, int, bool] | None:
        """(instance, turn, alive) of the session's lock; None when no turn holds it."""
        lock, alive, name = await self._lock_view(sid)
        turn = lock.rpartition("|")[2]
        if name is None or not turn.isdigit():
            return None
        return name, int(turn), alive

    async def meta_of(self, sid: str) -> SessionMeta | None:
        """The session whoever owns it (a gateway taking over a turn acts for its owner)."""
        raw = await self.r.hgetall(self._skey(sid))
        return self._meta(raw, raw.get("owner", "")) if raw else None

    async def take_over_turns(self, skip: Collection[str] = ()) -> list[tuple[str, int]]:
        """Take the locks of the running turns of dead instances (not ``skip``): (session id, turn) of each
        one this instance now holds. A compare-and-set on the lock as read: of several gateways sweeping at
        once, one takes each turn, and a turn recovered meanwhile (or begun anew) is left alone."""
        taken: list[tuple[str, int]] = []
        for name in await self.r.smembers(P + "instances"):
            if name == self.instance:
                continue
            for sid in await self.r.smembers(self._locks_key(name)):
                if sid in skip:
                    continue
                lock, alive, holder = await self._lock_view(sid)
                turn = lock.rpartition("|")[2]
                if alive or holder != name or not turn.isdigit():
                    continue
                # Indexed before the lock is ours, as in begin_turn; a stale entry is harmless.
                added = await self.r.sadd(self._locks_key(), sid)
                if await self._script(_TAKE_OVER_LUA)(keys=[self.lock_key(sid)],
                                                      args=[lock, self.lock_token(int(turn)), LOCK_TTL_S * 1000]):
                    await self.r.srem(self._locks_key(name), sid)
                    taken.append((sid, int(turn)))
                elif added:
                    await self.r.srem(self._locks_key(), sid)
        return taken

    # -- instances --------------------------------------------------------------------------------
    async def heartbeat(self) -> None:
        """Say this instance is alive (and, on the first beat, that its predecessor of the same name is not)."""
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(f"{P}instance:{self.instance}", self.nonce, ex=INSTANCE_TTL_S)
            pipe.sadd(P + "instances", self.instance)
            await pipe.execute()

    async def retire(self) -> None:
        """At a clean shutdown: this instance holds nothing any more."""
        key = f"{P}instance:{self.instance}"
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.scard(key + ":locks")
            current, held = await pipe.execute()
        if current == self.nonce and held == 0:
            await self.r.delete(key)

    async def recover_dead_turns(self, skip: Collection[str] = ()) -> list[str]:
        """Recover every turn whose lock a dead instance holds (or held until it expired); the sessions
        in ``skip`` (this process's running turns) are left alone. Returns the recovered session ids."""
        recovered: list[str] = []
        for name in await self.r.smembers(P + "instances"):
            locks = self._locks_key(name)
            for sid in await self.r.smembers(locks):
                if name == self.instance and sid in skip:
                    continue
                lock, alive, holder = await self._lock_view(sid)
                res = int(await self._script(_RECOVER_LUA)(keys=self._turn_keys(sid),
                                                           args=self._turn_args(sid, lock, alive)))
                if res == 1:
                    recovered.append(sid)
                if res == 1 or (res == 0 and holder != name):  # -1: the lock moved; the next sweep looks again
                    await self.r.srem(locks, sid)
            if name != self.instance and not await self.r.exists(f"{P}instance:{name}", locks):
                await self.r.srem(P + "instances", name)
        return recovered

    # -- reply streams ----------------------------------------------------------------------------
    def stream_prefix(self, sid: str) -> str:
        return f"{P}stream:{id_tag(sid)}:"

    def stream_key(self, sid: str, turn: int) -> str:
        return f"{self.stream_prefix(sid)}{turn}"

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

        Each stream's TTL is refreshed once per batch, after its events. A script touches the streams of
        one hash slot only (so a Redis Cluster can run it): a batch of several sessions is one script call
        per slot, all sent in one pipeline (one round trip, as one call was).
        """
        script = self._script(_APPEND_EVENTS_LUA)
        groups: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(items):
            groups.setdefault(key_slot(key.encode()), []).append(i)
        calls = [([items[i][0] for i in idxs], [*(items[i][1] for i in idxs), self.stream_ttl_s])
                 for idxs in groups.values()]
        if len(calls) == 1:
            replies = [await script(keys=calls[0][0], args=calls[0][1])]
        else:
            async with self.r.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    await script(keys=keys, args=args, client=pipe)
                replies = await pipe.execute()
        out: list[str | Exception] = [""] * len(items)
        for idxs, res in zip(groups.values(), replies, strict=True):
            for i, eid in zip(idxs, res, strict=True):
                out[i] = ResponseError(eid[1:]) if eid.startswith("!") else eid
        return out

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

    # -- readers and control across gateways ---------------------------------------------------------
    def _readers_key(self, sid: str, turn: int) -> str:
        return self.stream_key(sid, turn) + ":readers"

    async def hold_reader(self, sid: str, turn: int, reader: str, lease_s: float) -> None:
        """Count ``reader`` as a reader of the reply for ``lease_s`` seconds (renewed by calling again)."""
        key = self._readers_key(sid, turn)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {reader: int((time.time() + lease_s) * 1000)})
            pipe.expire(key, self.stream_ttl_s)
            await pipe.execute()

    async def drop_reader(self, sid: str, turn: int, reader: str) -> None:
        await self.r.zrem(self._readers_key(sid, turn), reader)

    async def readers(self, sid: str, turn: int) -> int:
        """Readers whose lease still runs (a gateway that died with readers stops renewing theirs)."""
        key = self._readers_key(sid, turn)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, "-inf", int(time.time() * 1000))
            pipe.zcard(key)
            return int((await pipe.execute())[1])

    async def send_control(self, instance: str, message: dict[str, Any]) -> None:
        key = f"{P}instance:{instance}:control"
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.rpush(key, json.dumps(message))
            pipe.expire(key, INSTANCE_TTL_S * 6)
            await pipe.execute()

    async def next_control(self, timeout_s: float) -> dict[str, Any] | None:
        """The next control request to this instance, waiting up to ``timeout_s`` for one."""
        got = await self.r.blpop([f"{P}instance:{self.instance}:control"], timeout=timeout_s)
        return None if got is None else dict(json.loads(got[1]))


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
