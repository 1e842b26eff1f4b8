"""Reply streams in Redis: one Redis Stream of events per reply (what a resuming client reads), the
leases of its readers on other gateways, and the :class:`EventWriter` that batches the writes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.crc import key_slot
from redis.exceptions import ResponseError

from chatsvc.store.base import RedisStore
from chatsvc.store.keys import readers_key, stream_key

T = TypeVar("T")

# KEYS: one stream key per event, then one lock key per event; ARGV: the events' JSON, then each one's fence
# (the writer's lock token, '' for none), then the TTL. An XADD that fails comes back as "!<error>" in its place
# (stream ids never start with "!"), so the others still stand. Fencing: an event whose lock is another's
# token, or whose lock is gone once the reply ended (its terminal event written), is refused ("!FENCED"):
# a gateway that lost its turn never writes into the reply after the gateway that took it over.
_APPEND_EVENTS_LUA = """
local n = #KEYS / 2
local ttl = ARGV[#ARGV]
local out, seen, fenced = {}, {}, {}
for i = 1, n do
  local key, token = KEYS[i], ARGV[n + i]
  if token ~= '' and fenced[key] == nil then
    local lock = redis.call('GET', KEYS[n + i])
    local ok = lock == token
    if not lock then  -- expired in an outage, nobody took it: still ours unless the reply ended
      ok = true
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
      if last then
        local good, ev = pcall(cjson.decode, last[2][2])
        if good and type(ev) == 'table' and (ev.type == 'done' or ev.type == 'error') then ok = false end
      end
    end
    fenced[key] = not ok
  end
  if token ~= '' and fenced[key] then
    out[i] = '!FENCED the reply is written by the gateway that holds the session lock now'
  else
    local id = redis.pcall('XADD', key, '*', 'e', ARGV[i])
    if type(id) == 'table' and id.err then out[i] = '!' .. id.err else out[i] = id end
    seen[key] = true
  end
end
for key in pairs(seen) do redis.pcall('EXPIRE', key, ttl) end
return out
"""


class Fenced(RuntimeError):
    """An event of a turn whose lock this gateway no longer holds: it was not written, and the turn must stop."""


# An event to append: (stream key, its JSON) or (stream key, its JSON, (lock key, the writer's lock token)).
Fence = tuple[str, str]
EventItem = tuple[str, str] | tuple[str, str, Fence | None]


class StreamStore(RedisStore):
    async def append_events(self, items: Sequence[EventItem]) -> list[str | Exception]:
        """XADD every (stream key, event JSON) in order, in one command (a Lua script: atomic, and one
        reply to parse instead of several per event). Returns each one's stream id, or the error Redis
        answered for that XADD alone; a lost connection raises.

        Each stream's TTL is refreshed once per batch, after its events. A script touches the streams of
        one hash slot only (so a Redis Cluster can run it): a batch of several sessions is one script call
        per slot, all sent in one pipeline (one round trip, as one call was).
        """
        script = self._script(_APPEND_EVENTS_LUA)
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(key_slot(item[0].encode()), []).append(i)
        fences = [item[2] if len(item) > 2 else None for item in items]  # a 2-tuple has no fence
        calls = [([*(items[i][0] for i in idxs), *((fences[i] or (items[i][0], ""))[0] for i in idxs)],
                  [*(items[i][1] for i in idxs), *((fences[i] or ("", ""))[1] for i in idxs), self.stream_ttl_s])
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
                if eid.startswith("!FENCED "):
                    out[i] = Fenced(eid.removeprefix("!FENCED "))
                else:
                    out[i] = ResponseError(eid[1:]) if eid.startswith("!") else eid
        return out

    async def read_events_json(self, sid: str, turn: int, after: str,
                               block_ms: int) -> list[tuple[str, dict[str, Any], str]]:
        """Events after stream id ``after`` ("0" = from the start), waiting up to ``block_ms`` for new ones:
        (stream id, event, its JSON as stored)."""
        # XREAD BLOCK 0 would wait forever: 0 here means "do not block".
        res = await self.r.xread({stream_key(sid, turn): after}, block=block_ms or None, count=256)
        out: list[tuple[str, dict[str, Any], str]] = []
        for _key, entries in res or []:
            out.extend((eid, json.loads(fields["e"]), fields["e"]) for eid, fields in entries)
        return out

    async def stream_exists(self, sid: str, turn: int) -> bool:
        return bool(await self.r.exists(stream_key(sid, turn)))

    async def hold_reader(self, sid: str, turn: int, reader: str, lease_s: float) -> None:
        """Count ``reader`` as a reader of the reply for ``lease_s`` seconds (renewed by calling again)."""
        key = readers_key(sid, turn)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {reader: int((time.time() + lease_s) * 1000)})
            pipe.expire(key, self.stream_ttl_s)
            await pipe.execute()

    async def drop_reader(self, sid: str, turn: int, reader: str) -> None:
        await self.r.zrem(readers_key(sid, turn), reader)

    async def readers(self, sid: str, turn: int) -> int:
        """Readers whose lease still runs (a gateway that died with readers stops renewing theirs)."""
        key = readers_key(sid, turn)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, "-inf", int(time.time() * 1000))
            pipe.zcard(key)
            return int((await pipe.execute())[1])


# Called once per event with (stream id, None) once it is stored, or (None, error) if it was not.
WriteCallback = Callable[[str | None, BaseException | None], None]


def settle(fut: asyncio.Future[T], result: T, exc: BaseException | None) -> None:
    """Complete ``fut`` as a :data:`WriteCallback` was told: with ``result``, or ``exc`` (a cancellation
    cancels it); a future already done is left alone."""
    if fut.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        fut.cancel()
    elif exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class EventWriter:
    """Writes reply events to their streams, coalescing everything appended while a write is in flight
    (and everything appended in the same event-loop pass) into one :meth:`StreamStore.append_events` call.

    An engine step hands every running turn its delta at once; written one XADD transaction per delta,
    the gateway spent several socket round trips per token. Events of one stream are written in the
    order they were appended. Once a write of a stream failed, its later events are refused (they would
    leave a gap a resuming reader could not see), except a ``final`` one: the terminal event that says
    how the reply ended.
    """

    def __init__(self, store: StreamStore) -> None:
        self.store = store
        self._queue: list[tuple[str, str, bool, WriteCallback, Fence | None]] = []
        self._failed: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def append(self, key: str, data: str, done: WriteCallback, final: bool = False,
               fence: Fence | None = None) -> None:
        """Queue one event (``data``: its JSON) for stream ``key``; ``done`` is called once it is written.
        ``fence`` (lock key, the writer's lock token): written only while that lock is the writer's
        (else ``done`` gets ``Fenced``)."""
        self._queue.append((key, data, final, done, fence))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-writer")

    async def write(self, key: str, data: str, final: bool = False) -> str:
        """Append and wait: the event's stream id (it comes after every event appended before it)."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.append(key, data, lambda eid, exc: settle(fut, str(eid), exc), final)
        return await fut

    def forget(self, key: str) -> None:
        """The stream gets no more events: drop its failure mark."""
        self._failed.discard(key)

    async def _run(self) -> None:
        todo: list[tuple[str, str, bool, WriteCallback, Fence | None]] = []
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
                    results = await self.store.append_events([(key, data, fence) for key, data, _, _, fence in todo])
                except Exception as exc:  # noqa: BLE001 - the whole batch is lost: every writer hears
                    results = [exc] * len(todo)
                for (key, _, _, done, _), res in zip(todo, results, strict=True):
                    if isinstance(res, Exception):
                        self._failed.add(key)
                        done(None, res)
                    else:
                        done(res, None)
                todo = []
        except BaseException as exc:  # cancelled (shutdown): nothing queued may wait forever
            pending, self._queue = todo + self._queue, []
            for _, _, _, done, _ in pending:
                done(None, exc)
            raise
        finally:
            self._task = None
