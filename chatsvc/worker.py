"""``chatsvc worker``: one engine taking work from Redis Streams (formats and keys: ``engine.streams``).

Four tasks share the worker's event loop:

* requests: XREADGROUP on its own request stream; each ``Generate`` becomes ``engine.generate`` and a task
  that hands the request's deltas to the writer; when the request ends its entry is XACKed and deleted.
* control: XREAD on its control stream: ``Abort`` (``engine.abort``), ``Pin``/``Unpin`` (``pin_prefix``,
  ``unpin_prefix``), ``Warm`` (``warm_prefix``), ``WantSnapshot``.

An entry on either stream that does not decode (``engine.streams``: every field bounded) is answered where it
names its sender (a request: a ``TransportError`` on its output stream; a pin call: an error reply), written
to the dead-letter stream with the reason, and acked; nothing an entry holds stops either loop.
* writer: every delta handed in since its last write goes out in ONE pipelined round trip, one stream
  entry per request; the deltas of one engine step reach the relays together, so a step costs one hop.
* heartbeat: every ``ttl/4`` seconds the ``Beat`` (load: free blocks, running/waiting/swapped, pinned
  keys) is written with a time to live ``ttl``; its lapse tells gateways the worker died, and they
  re-dispatch its requests elsewhere.

A prefix named in a ``Generate`` (``pin``: the persona whose system prompt the request starts with) is
pinned once, the first time this worker serves it; the beat lists it, and the router then prefers this
worker for that persona's new sessions.

Fencing: a worker whose beat lapsed (stalled, not dead) may already have been declared dead and its
requests re-dispatched; when a beat finds it no longer registered it aborts what it runs and exits with
status 1, so no request is ever run on two workers for long, nor answered twice.

SIGTERM (``stop``) drains: the beat says ``draining`` (routers stop choosing the worker), no new entry is
read, entries already queued are answered ``WorkerGone`` (the gateway re-dispatches them), the requests
running finish, then the worker deregisters and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

from redis.exceptions import RedisError, ResponseError

from engine.client import EngineClient
from engine.protocol import (
    SNAPSHOT_WINDOW_S,
    Abort,
    Pin,
    ProtocolError,
    RequestError,
    Unpin,
    WantSnapshot,
    Warm,
)
from engine.streams import (
    DEAD_LETTER_MAXLEN,
    GROUP,
    Beat,
    Deltas,
    Generate,
    Keys,
    call_target,
    dead_letter,
    decode,
    encode,
    entries,
    raise_if_cancelled,
    read_pin,
    reply_target,
)

log = logging.getLogger("chatsvc.worker")

DEFAULT_TTL_S = 3.0
OUT_TTL_S = 300  # an output stream outlives its request this long (a gateway may be slow to read it)
REPLY_TTL_S = 60
DRAIN_TIMEOUT_S = 600.0
READ_BLOCK_MS = 1000


def worker_id(name: str | None = None) -> str:
    """Unique per process: a restarted worker is a new worker, never mistaken for its dead predecessor."""
    return f"{name or socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class OutWriter:
    """Writes the messages handed in since the last write in one round trip (MULTI/EXEC: a write Redis
    refuses, as under OOM or a missing permission, adds no entry, so a retry never doubles one), in order.

    Output it gave up on (Redis refused it past the retries) leaves a gap the gateway must not stream over:
    the stream is marked lost, nothing more is written to it but, as soon as Redis takes writes again, one
    ``WorkerGone`` error, so its gateway dispatches the request again with the tokens it did get (and its
    progress deadline covers a Redis that never comes back). The worker aborts a request whose stream is lost."""

    def __init__(self, redis: Any, ttl_s: int = OUT_TTL_S) -> None:
        self.r = redis
        self.ttl_s = ttl_s
        self._pending: dict[str, list[Deltas | RequestError]] = {}
        self._lost: dict[str, float] = {}  # output stream -> when its output was dropped
        self._notices: dict[str, RequestError] = {}  # lost streams whose gateway is not told yet
        self._wake = asyncio.Event()
        self._added = 0
        self._written = 0
        self._done = asyncio.Condition()

    def put(self, key: str, msg: Deltas | RequestError) -> None:
        self._added += 1
        if key not in self._lost:
            queued = self._pending.setdefault(key, [])
            if isinstance(msg, Deltas) and queued and isinstance(queued[-1], Deltas):  # the writer fell behind
                queued[-1] = Deltas([*queued[-1].deltas, *msg.deltas])  # one entry still
            else:
                queued.append(msg)
        self._wake.set()

    def lost(self, key: str) -> bool:
        """Output to ``key`` was dropped: the request is to be dispatched again, and aborted here."""
        return key in self._lost

    async def flushed(self) -> None:
        """Until everything handed in so far is written (or given up on)."""
        target = self._added
        async with self._done:
            await self._done.wait_for(lambda: self._written >= target)

    async def run(self) -> None:
        while True:
            raise_if_cancelled()
            if self._notices:  # lost streams' gateways are still to be told: try again soon without new output
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
            else:
                await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # the other relays of this engine step hand theirs in meanwhile
            batch, self._pending, mark = self._pending, {}, self._added
            if self._notices:
                self._expire_lost()
                for key, notice in self._notices.items():
                    batch[key] = [notice]
            if batch:
                await self._write(batch)
            async with self._done:
                self._written = mark
                self._done.notify_all()

    def _expire_lost(self) -> None:
        """Forget lost streams once they would have expired anyway (their gateways' deadlines fired)."""
        horizon = time.monotonic() - self.ttl_s
        for key in [k for k, at in self._lost.items() if at < horizon]:
            del self._lost[key]
            self._notices.pop(key, None)

    async def _write(self, batch: dict[str, list[Deltas | RequestError]]) -> None:
        for attempt in range(5):
            pipe = self.r.pipeline(transaction=True)
            now = time.time()
            for key, msgs in batch.items():
                for msg in msgs:
                    pipe.xadd(key, encode(dataclasses.replace(msg, sent=now) if isinstance(msg, Deltas) else msg))
                pipe.expire(key, self.ttl_s)
            try:
                await pipe.execute()
            except RedisError as exc:
                log.warning("could not write %d output streams (%r); retrying", len(batch), exc)
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            for key in batch:
                self._notices.pop(key, None)
            return
        fresh = [key for key in batch if key not in self._lost]
        for key in fresh:
            rid = next((m.request_id if isinstance(m, RequestError) else m.deltas[0].request_id
                        for m in batch[key] if isinstance(m, RequestError) or m.deltas), "")
            self._lost[key] = time.monotonic()
            self._notices[key] = RequestError(rid, "WorkerGone", "the worker's output was lost (Redis refused "
                                                                 "its writes): dispatch the request again")
        if fresh:
            log.error("dropped the output of %d requests (Redis refused it); their gateways will dispatch them "
                      "again", len(fresh))


class Worker:
    def __init__(self, engine: EngineClient, redis: Any, worker: str | None = None, *, keys: Keys | None = None,
                 ttl_s: float = DEFAULT_TTL_S, drain_timeout_s: float = DRAIN_TIMEOUT_S, kv_home: str = "") -> None:
        self.engine = engine
        self.r = redis
        self.id = worker or worker_id()
        self.kv_home = kv_home  # the disk tier's lasting name (engine.kv_disk.kv_home), "" without one
        self.keys = keys or Keys()
        self.ttl_s = ttl_s
        self.drain_timeout_s = drain_timeout_s
        self.writer = OutWriter(redis)
        self.pins: set[str] = set()
        self._pinning: set[str] = set()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # pins and control calls in flight
        self._kv_until = 0.0
        self._registered = False
        self.draining = False
        self.fenced = False
        self.block_size = 16

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (then drain) or the worker is fenced; the process's exit status."""
        await self.engine.start()
        self.block_size = self.engine.kv_snapshot().block_size
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists (never, for a fresh id)
            await self.r.xgroup_create(self.keys.requests(self.id), GROUP, id="0", mkstream=True)
        await self._beat()
        log.info("worker %s serving %s (beat every %.2fs, ttl %.1fs)", self.id, self.engine.model_name,
                 self.ttl_s / 4, self.ttl_s)
        reader = asyncio.create_task(self._read_requests(), name="worker-requests")
        heartbeat = asyncio.create_task(self._heartbeat(), name="worker-heartbeat")  # ends when fenced
        loops = [asyncio.create_task(self._read_control(), name="worker-control"),
                 asyncio.create_task(self.writer.run(), name="worker-writer"), heartbeat]
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([waiter, heartbeat, reader], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        reader.cancel()
        if self.fenced:
            serving = list(self._running.values())
            for request_id in list(self._running):
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)
            if serving:  # their abort deltas go out before the writer stops
                await asyncio.wait(serving, timeout=10.0)
        else:
            await self._drain()
        for task in loops:
            task.cancel()
        await asyncio.gather(reader, *loops, return_exceptions=True)
        await self._deregister()
        await self.engine.stop()
        return 1 if self.fenced else 0

    async def _drain(self) -> None:
        self.draining = True
        with contextlib.suppress(RedisError):
            await self._beat()
        log.info("worker %s draining: %d requests running", self.id, len(self._running))
        # Entries queued before routers saw the draining beat are answered, so their gateways go elsewhere.
        with contextlib.suppress(RedisError):
            resp = await self.r.xreadgroup(GROUP, self.id, {self.keys.requests(self.id): ">"}, count=1000)
            for entry_id, fields in entries(resp):
                try:
                    msg = decode(fields)
                except ProtocolError as exc:
                    await self._refuse(self.keys.requests(self.id), entry_id, fields, str(exc))
                    continue
                if isinstance(msg, Generate):
                    gone = RequestError(msg.add.request_id, "WorkerGone", "the worker is leaving")
                    self.writer.put(self.keys.out(msg.dispatch), gone)
                await self._ack(entry_id)
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=self.drain_timeout_s)
        await self.writer.flushed()

    async def _deregister(self) -> None:
        with contextlib.suppress(RedisError):
            k = self.keys
            pipe = self.r.pipeline(transaction=True)
            pipe.zrem(k.workers, self.id)
            pipe.delete(k.beat(self.id), k.requests(self.id), k.control(self.id), k.kv(self.id))
            await pipe.execute()

    # -- heartbeat --------------------------------------------------------------------------------
    def beat(self) -> Beat:
        return Beat(worker=self.id, pid=os.getpid(), host=socket.gethostname(), model_name=self.engine.model_name,
                    max_model_len=self.engine.max_model_len, block_size=self.block_size, time=time.time(),
                    draining=self.draining, pins=sorted(self.pins), stats=self.engine.stats(), kv_home=self.kv_home)

    async def _beat(self) -> bool:
        """Write the beat; False when this worker is no longer registered (declared dead meanwhile)."""
        k = self.keys
        ttl_ms = max(1, int(self.ttl_s * 1000))
        pipe = self.r.pipeline(transaction=False)
        pipe.set(k.beat(self.id), self.beat().to_json(), px=ttl_ms)
        if time.monotonic() < self._kv_until:
            pipe.set(k.kv(self.id), json.dumps(self.engine.kv_snapshot().to_json()), px=ttl_ms)
        if self._registered:
            pipe.zscore(k.workers, self.id)
        else:
            pipe.zadd(k.workers, {self.id: time.time()})
        result = await pipe.execute()
        if not self._registered:
            self._registered = True
            return True
        return result[-1] is not None

    async def _heartbeat(self) -> None:
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.ttl_s / 4)
            try:
                if not await self._beat():
                    log.error("worker %s was declared dead (its beat lapsed); aborting its requests and exiting",
                              self.id)
                    self.fenced = True
                    return
            except RedisError as exc:
                log.warning("heartbeat failed: %r", exc)

    # -- requests ---------------------------------------------------------------------------------
    async def _read_requests(self) -> None:
        key = self.keys.requests(self.id)
        while True:
            raise_if_cancelled()
            try:
                resp = await self.r.xreadgroup(GROUP, self.id, {key: ">"}, count=64, block=READ_BLOCK_MS)
            except RedisError as exc:
                log.warning("reading requests failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for entry_id, fields in entries(resp):
                try:
                    self._take(entry_id, fields)
                except Exception as exc:  # noqa: BLE001 - no entry stops the reader
                    log.exception("request entry %s failed", entry_id)
                    self._spawn(self._refuse(key, entry_id, fields, f"{type(exc).__name__}: {exc}"))

    def _take(self, entry_id: str, fields: dict[str, str]) -> None:
        try:
            msg = decode(fields)
            if not isinstance(msg, Generate):
                raise ProtocolError(f"{type(msg).__name__} on a request stream")
        except ProtocolError as exc:
            log.error("refusing request entry %s: %s", entry_id, exc)
            self._spawn(self._refuse(self.keys.requests(self.id), entry_id, fields, str(exc)))
            return
        task = asyncio.create_task(self._serve(entry_id, msg), name=f"serve-{msg.add.request_id}")
        self._running[msg.add.request_id] = task

    async def _serve(self, entry_id: str, msg: Generate) -> None:
        out, add = self.keys.out(msg.dispatch), msg.add
        try:
            try:
                stream = self.engine.generate(add.request_id, add.params, prompt_token_ids=list(add.prompt_token_ids))
            except Exception as exc:  # noqa: BLE001 - refused: the gateway maps the kind to its answer
                self.writer.put(out, RequestError.of(add.request_id, exc))
                return
            if msg.pin is not None and msg.pin not in self.pins | self._pinning:  # pinned when first served
                self._spawn(self._pin(msg.pin, None, None))
            try:
                async for delta in stream:
                    if self.writer.lost(out):  # its gateway dispatches it again: stop spending blocks on it
                        self._spawn(self.engine.abort(add.request_id))
                        async for _ in stream:
                            pass
                        break
                    self.writer.put(out, Deltas([delta]))
            except Exception as exc:  # noqa: BLE001 - the request failed; the worker serves on
                self.writer.put(out, RequestError.of(add.request_id, exc))
        finally:
            self._running.pop(add.request_id, None)
            await self.writer.flushed()
            await self._ack(entry_id)

    async def _refuse(self, stream: str, entry_id: str, fields: object, reason: str) -> None:
        """An entry this worker cannot run: its sender is told where the entry names one (so a gateway fails
        the request now instead of waiting for it), the entry goes to the dead-letter stream, and it is
        acked (a request entry) so it is never read again."""
        target = reply_target(fields)
        if target is not None:
            request_id, dispatch = target
            self.writer.put(self.keys.out(dispatch), RequestError(
                request_id, "TransportError", f"the engine worker could not decode the request: {reason}"[:1000]))
        await self._dead_letter(stream, entry_id, fields, reason)
        if stream == self.keys.requests(self.id):
            await self._ack(entry_id)

    async def _dead_letter(self, stream: str, entry_id: str, fields: object, reason: str) -> None:
        try:
            await self.r.xadd(self.keys.dead_letter, dead_letter(stream, entry_id, fields, reason),
                              maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        except RedisError as exc:
            log.warning("could not dead-letter entry %s of %s: %r", entry_id, stream, exc)

    async def _ack(self, entry_id: str) -> None:
        key = self.keys.requests(self.id)
        with contextlib.suppress(RedisError):
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(key, GROUP, entry_id)
            pipe.xdel(key, entry_id)
            await pipe.execute()

    # -- control ----------------------------------------------------------------------------------
    async def _read_control(self) -> None:
        key, last = self.keys.control(self.id), "0-0"
        while True:
            raise_if_cancelled()
            try:
                resp = await self.r.xread({key: last}, count=64, block=READ_BLOCK_MS)
            except RedisError as exc:
                log.warning("reading control messages failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for entry_id, fields in entries(resp):
                last = entry_id
                try:
                    self._control(decode(fields))
                except Exception as exc:  # noqa: BLE001 - no entry stops the control loop
                    reason = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
                    log.error("dropping control entry %s: %s", entry_id, reason)
                    # Awaited, not spawned: the dead-letter stream keeps the order the entries were read in.
                    await self._dead_letter(key, entry_id, fields, reason)
                    call = call_target(fields)
                    if call is not None:
                        self._spawn(self._answer(call, {"error": f"ProtocolError: {reason}"[:1000]}))

    def _control(self, msg: object) -> None:
        match msg:
            case Abort():
                if msg.request_id in self._running:
                    self._spawn(self.engine.abort(msg.request_id))
            case Pin():
                self._spawn(self._pin(msg.key, list(msg.prompt_token_ids), msg.call_id, msg.cache_salt))
            case Unpin():
                self.pins.discard(msg.key)
                self.engine.unpin_prefix(msg.key)
            case Warm():
                self.engine.warm_prefix(msg.key, list(msg.prompt_token_ids), msg.cache_salt, msg.shared_prefix_tokens)
            case WantSnapshot():
                self._kv_until = time.monotonic() + SNAPSHOT_WINDOW_S
            case _:
                raise ProtocolError(f"{type(msg).__name__} on a control stream")

    async def _pin(self, key: str, token_ids: list[int] | None, reply: str | None,
                   cache_salt: str | None = None) -> None:
        self._pinning.add(key)
        answer: dict[str, Any]
        try:
            if token_ids is None:
                raw = await self.r.hget(self.keys.pins, key)
                if raw is None:
                    return  # unpinned meanwhile
                pin = read_pin(raw)
                token_ids, cache_salt = list(pin.prompt_token_ids), pin.cache_salt
            answer = {"pinned": await self.engine.pin_prefix(key, token_ids, cache_salt)}
            self.pins.add(key)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, if any
            log.warning("could not pin %s: %r", key, exc)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._pinning.discard(key)
        if reply is not None:
            await self._answer(reply, answer)

    async def _answer(self, call: str, answer: dict[str, Any]) -> None:
        """The one reply to a control call that asked for it (its caller BLPOPs the list)."""
        with contextlib.suppress(RedisError):
            pipe = self.r.pipeline(transaction=False)
            pipe.rpush(self.keys.reply(call), json.dumps(answer))
            pipe.expire(self.keys.reply(call), REPLY_TTL_S)
            await pipe.execute()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
