"""Session turns in Redis: the lock that makes a session generate one reply at a time, the user message
and the reply stored with it, and the recovery of turns whose gateway died.

A dead lock's turn is recovered: the reply so far is read back from its stream and stored with
``finish_reason: "interrupted"``. Every update of more than one of a session's keys is one Lua script, so
no reader sees half of it and no check-then-write can race.

Redis Cluster: what a script cannot see in its session's hash slot is read or written beside it: the lock
holder's liveness is read first and the script refuses to act if the lock changed meanwhile; the
instance's lock index is added to before a turn begins and pruned after it ends (a stale entry is
harmless: recovery finds nothing to do); the owner index is updated after.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from chatsvc.store.keys import (
    INSTANCES,
    instance_key,
    lock_key,
    messages_key,
    owner_sessions_key,
    session_key,
    stream_prefix,
)
from chatsvc.store.liveness import LOCK_TTL_S, Liveness

LOCK_READ_TRIES = 5  # a lock that changes between reading it and acting on it is read again this often

# Shared by the turn scripts. KEYS[1..3]: session hash, its messages, its lock.
# ARGV[1]: the session's stream key prefix (the turn number follows), ARGV[2]: now, ARGV[3]: session TTL,
# ARGV[4]: stream TTL, ARGV[5]: the lock as the caller last read it ('' for none), ARGV[6]: '1' if that
# lock's holder was alive then (the caller read the holder's heartbeat key: another slot in a cluster),
# ARGV[7..9]: retention (:class:`Retention`): most messages, most bytes, floor tokens.
#
# Every message is appended by push(), which trims the list in the same script: the oldest whole turns go
# while the list holds more than the most messages or bytes, but never any of the newest messages that hold
# the floor's tokens (guessed as chatsvc.history guesses them), so what the context search can show the model
# is never trimmed. history_bytes and user_messages are kept beside the list; a session stored before they
# were gets them counted once, on its first push.
_TURN_LUA_LIB = """
local STREAM, NOW, SESSION_TTL, STREAM_TTL, SEEN, SEEN_ALIVE = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local MAX_MESSAGES, MAX_BYTES, FLOOR_TOKENS = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

local function decoded(raw)
  local ok, m = pcall(cjson.decode, raw)
  if ok and type(m) == 'table' then return m end
  return {}
end

local function guessed_tokens(m)
  local t = tonumber(m.tokens)
  if not t or t <= 0 then t = math.floor(#tostring(m.content or '') / 3) end
  return t + 5
end

local function counted()
  if redis.call('HEXISTS', KEYS[1], 'history_bytes') == 0 then
    local b = 0
    for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do b = b + #raw end
    redis.call('HSET', KEYS[1], 'history_bytes', b)
  end
  if redis.call('HEXISTS', KEYS[1], 'user_messages') == 0 then
    local users = 0
    for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
      if decoded(raw).role == 'user' then users = users + 1 end
    end
    redis.call('HSET', KEYS[1], 'user_messages', users)
  end
end

local function trim()
  local n = redis.call('LLEN', KEYS[2])
  local bytes = tonumber(redis.call('HGET', KEYS[1], 'history_bytes'))
  if n <= MAX_MESSAGES and bytes <= MAX_BYTES then return end
  local keep, tokens = n, 0  -- the messages from keep on hold the floor: none of them goes
  while keep > 0 and tokens < FLOOR_TOKENS do
    keep = keep - 1
    tokens = tokens + guessed_tokens(decoded(redis.call('LINDEX', KEYS[2], keep)))
  end
  local cut, cut_bytes, i, b = 0, 0, 0, 0
  while i < keep and (n - cut > MAX_MESSAGES or bytes - cut_bytes > MAX_BYTES) do
    b = b + #redis.call('LINDEX', KEYS[2], i)
    i = i + 1
    while i < keep do  -- the rest of the turn: up to the next user message
      local raw = redis.call('LINDEX', KEYS[2], i)
      if decoded(raw).role == 'user' then break end
      b = b + #raw
      i = i + 1
    end
    if i < keep or decoded(redis.call('LINDEX', KEYS[2], i)).role == 'user' then cut, cut_bytes = i, b end
  end
  if cut == 0 then return end
  redis.call('LTRIM', KEYS[2], cut, -1)
  redis.call('HINCRBY', KEYS[1], 'trimmed_messages', cut)
  redis.call('HINCRBY', KEYS[1], 'history_bytes', -cut_bytes)
end

local function push(raw)
  counted()
  redis.call('RPUSH', KEYS[2], raw)
  redis.call('HINCRBY', KEYS[1], 'history_bytes', #raw)
  if decoded(raw).role == 'user' then redis.call('HINCRBY', KEYS[1], 'user_messages', 1) end
  trim()
end

local function pop()
  counted()
  local raw = redis.call('RPOP', KEYS[2])
  if not raw then return end
  redis.call('HINCRBY', KEYS[1], 'history_bytes', -#raw)
  if decoded(raw).role == 'user' then redis.call('HINCRBY', KEYS[1], 'user_messages', -1) end
end

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
  push(cjson.encode(msg))
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

# ARGV[10]: user message JSON, [11]: title if untitled, [12]: lock TTL ms, [13]: our token prefix
# (instance|nonce). Returns the new turn, 0 (busy), -1 (no session) or -2 (the lock changed: read it again).
_BEGIN_TURN_LUA = _TURN_LUA_LIB + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local lock, alive = lock_state()
if lock == nil then return -2 end
if alive then return 0 end
recover_pending()
local turn = redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HSET', KEYS[1], 'replied', turn - 1, 'updated', NOW)
push(ARGV[10])
local title = redis.call('HGET', KEYS[1], 'title')
if not title or title == '' then redis.call('HSET', KEYS[1], 'title', ARGV[11]) end
redis.call('SET', KEYS[3], ARGV[13] .. '|' .. turn, 'PX', ARGV[12])
touch()
return turn
"""

# ARGV[10]: owner token, [11]: turn, [12]: assistant message JSON. Stores the reply once (a retry after a
# lost answer, or a turn recovered meanwhile, stores nothing), then releases the lock if still ours.
# Returns 1 (stored), 0 (already stored or superseded), -1 (the session was deleted) or -2 (fenced: another
# gateway holds the lock; a lock that expired with nobody taking it is still ours).
_END_TURN_LUA = _TURN_LUA_LIB + """
local token, turn, out = ARGV[10], tonumber(ARGV[11]), -1
local lock = redis.call('GET', KEYS[3])
if lock and lock ~= token then return -2 end  -- fenced: the gateway that holds the lock now stores it
if redis.call('EXISTS', KEYS[1]) == 1 then
  out = 0
  local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
  if turns == turn and replied_of(turns) < turn then
    push(ARGV[12])
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

# ARGV[10]: owner token, [11]: turn. Undoes begin_turn if that turn is still the pending one.
_ROLLBACK_TURN_LUA = _TURN_LUA_LIB + """
local token, turn = ARGV[10], tonumber(ARGV[11])
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
local out = 0
if turns == turn and replied_of(turns) < turn then
  pop()
  redis.call('HSET', KEYS[1], 'turns', turn - 1, 'replied', turn - 1)
  out = 1
end
release(token)
return out
"""

# ARGV[10]: owner token, [11]: turn, [12]: lock TTL ms. Extends our lock; takes it again if it expired
# (a long Redis outage) while the turn is still pending. 1: held, 0: lost to a recovery or a new turn.
_REFRESH_LOCK_LUA = _TURN_LUA_LIB + """
local token, turn = ARGV[10], tonumber(ARGV[11])
local lock = redis.call('GET', KEYS[3])
if lock == token then redis.call('PEXPIRE', KEYS[3], ARGV[12]) return 1 end
if lock then return 0 end
local turns = tonumber(redis.call('HGET', KEYS[1], 'turns') or '0')
if turns == turn and replied_of(turns) < turn then
  redis.call('SET', KEYS[3], token, 'PX', ARGV[12])
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


@dataclass(frozen=True)
class Retention:
    """How much of a session's history Redis keeps: the oldest whole turns are dropped past ``max_messages``
    or ``max_bytes``, never below ``floor_tokens`` (guessed) of the newest messages."""

    max_messages: int = 1000
    max_bytes: int = 1 << 20
    floor_tokens: int = 0

    @classmethod
    def for_context(cls, max_messages: int, max_bytes: int, max_model_len: int) -> Retention:
        # Twice the context: a prompt holds less than the context, and a stored count may be off by a little
        # from what the template renders; what no prompt can show is all that may go.
        return cls(max_messages, max_bytes, 2 * max_model_len)


class SessionGone(LookupError):
    """The session was deleted (or expired) between loading it and starting a turn."""


def _turn_keys(sid: str) -> list[str]:
    return [session_key(sid), messages_key(sid), lock_key(sid)]


class TurnStore(Liveness):
    # The gateway's settings and the model's context, which a remote engine learns only once a worker
    # answers (chatsvc.app sets it); unset: the default caps without a floor.
    retention_source: Callable[[], Retention] | None = None

    def retention(self) -> Retention:
        return Retention() if self.retention_source is None else self.retention_source()

    def _turn_args(self, sid: str, lock: str = "", alive: bool = False, *extra: object) -> list[object]:
        r = self.retention()
        return [stream_prefix(sid), time.time(), self.session_ttl_s, self.stream_ttl_s, lock,
                "1" if alive else "0", r.max_messages, r.max_bytes, r.floor_tokens, *extra]

    async def begin_turn(self, sid: str, user_message: dict[str, Any], owner: str | None = None) -> int | None:
        """Take the session's lock and append the user message, in one step; None if a live instance is
        already generating a reply. A lock left by a dead instance is taken over after its turn is
        recovered, so the history never holds two user messages in a row. Raises :class:`SessionGone`.
        """
        # An untitled session is named after its first message, for the session list.
        title = " ".join(str(user_message.get("content", "")).split())[:60]
        # Indexed before the lock exists, so a crash never leaves a lock its instance's index misses.
        added = await self.r.sadd(self.locks_key(), sid)  # 0: a turn of ours holds it (the script says busy)
        res = -2
        for _ in range(LOCK_READ_TRIES):
            lock, alive, _name = await self.lock_view(sid)
            res = int(await self._script(_BEGIN_TURN_LUA)(
                keys=_turn_keys(sid),
                args=self._turn_args(sid, lock, alive, json.dumps(user_message), title, LOCK_TTL_S * 1000,
                                     self.holder)))
            if res != -2:
                break
        if res <= 0 and added:
            await self.r.srem(self.locks_key(), sid)
        if res == -1:
            raise SessionGone(sid)
        if res > 0 and owner is not None:
            await self.r.expire(owner_sessions_key(owner), self.session_ttl_s)
        return res if res > 0 else None

    async def _our_turn(self, script: str, sid: str, turn: int, *extra: object) -> int:
        """Run a turn script on our own lock of ``turn``."""
        args = self._turn_args(sid, "", False, self.lock_token(turn), turn, *extra)
        return int(await self._script(script)(keys=_turn_keys(sid), args=args))

    async def rollback_turn(self, sid: str, turn: int) -> bool:
        """Undo begin_turn when generation could not even start (queue full, invalid request)."""
        out = bool(await self._our_turn(_ROLLBACK_TURN_LUA, sid, turn))
        await self.r.srem(self.locks_key(), sid)
        return out

    async def end_turn(self, sid: str, turn: int, assistant_message: dict[str, Any]) -> int:
        """Store the reply of ``turn`` and release its lock. Idempotent, so it may be retried after a
        lost answer: 1 stored now, 0 stored before (or recovered meanwhile), -1 the session is gone, -2
        fenced (another gateway took the turn over: it stores it)."""
        out = await self._our_turn(_END_TURN_LUA, sid, turn, json.dumps(assistant_message))
        await self.r.srem(self.locks_key(), sid)
        return out

    async def refresh_lock(self, sid: str, turn: int) -> bool:
        """Extend (or take back) the lock of our running ``turn``; False if it was lost."""
        return bool(await self._our_turn(_REFRESH_LOCK_LUA, sid, turn, LOCK_TTL_S * 1000))

    async def is_busy(self, sid: str) -> bool:
        """A live instance is generating a reply for the session."""
        return (await self.lock_view(sid))[1]

    async def lock_holder(self, sid: str) -> tuple[str, int, bool] | None:
        """(instance, turn, alive) of the session's lock; None when no turn holds it."""
        lock, alive, name = await self.lock_view(sid)  # a holder's name: a well-formed lock
        return None if name is None else (name, int(lock.rpartition("|")[2]), alive)

    async def take_over_turns(self, skip: Collection[str] = ()) -> list[tuple[str, int]]:
        """Take the locks of the running turns of dead instances (not ``skip``): (session id, turn) of each
        one this instance now holds. A compare-and-set on the lock as read: of several gateways sweeping at
        once, one takes each turn, and a turn recovered meanwhile (or begun anew) is left alone."""
        taken: list[tuple[str, int]] = []
        for name in await self.r.smembers(INSTANCES):
            if name == self.instance:
                continue
            for sid in await self.r.smembers(self.locks_key(name)):
                if sid in skip:
                    continue
                lock, alive, holder = await self.lock_view(sid)
                turn = lock.rpartition("|")[2]
                if alive or holder != name or not turn.isdigit():
                    continue
                # Indexed before the lock is ours, as in begin_turn; a stale entry is harmless.
                added = await self.r.sadd(self.locks_key(), sid)
                if await self._script(_TAKE_OVER_LUA)(keys=[lock_key(sid)],
                                                      args=[lock, self.lock_token(int(turn)), LOCK_TTL_S * 1000]):
                    await self.r.srem(self.locks_key(name), sid)
                    taken.append((sid, int(turn)))
                elif added:
                    await self.r.srem(self.locks_key(), sid)
        return taken

    async def recover_dead_turns(self, skip: Collection[str] = (), *, adoptable: bool = False) -> list[str]:
        """Recover every turn whose lock a dead instance holds (or held until it expired); the sessions
        in ``skip`` (this process's running turns) are left alone. Returns the recovered session ids.

        ``adoptable``: this instance takes dead instances' turns over (:meth:`take_over_turns`), so a turn
        whose lock another instance still holds, dead, is left to that sweep: an instance that stepped down
        after this beat's take-over pass read it alive would otherwise have its handed-off turn cut here."""
        recovered: list[str] = []
        for name in await self.r.smembers(INSTANCES):
            locks = self.locks_key(name)
            for sid in await self.r.smembers(locks):
                if name == self.instance and sid in skip:
                    continue
                lock, alive, holder = await self.lock_view(sid)
                if adoptable and not alive and holder == name != self.instance:
                    continue
                res = int(await self._script(_RECOVER_LUA)(keys=_turn_keys(sid),
                                                           args=self._turn_args(sid, lock, alive)))
                if res == 1:
                    recovered.append(sid)
                if res == 1 or (res == 0 and holder != name):  # -1: the lock moved; the next sweep looks again
                    await self.r.srem(locks, sid)
            if name != self.instance and not await self.r.exists(instance_key(name), locks):
                await self.r.srem(INSTANCES, name)
        return recovered
