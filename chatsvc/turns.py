"""Session turns run as server-side tasks that write each reply to a Redis Stream.

Clients (SSE or WebSocket) only *read* that stream, from the start or from the last event id they
saw, so a reconnecting client gets the rest of the same reply without a second generation.

Abort policy: a turn counts its readers. An explicit cancel aborts at once, and so does a clean
(1000) WebSocket close by the last reader. When the last reader vanishes otherwise (SSE disconnect,
a page reload's 1001, a dropped socket), the turn keeps generating for ``abort_grace_s`` and is
aborted unless a client resumes it within that time. Either way the assistant message is stored
with the text so far.

Several gateways on one Redis (any of them serves any session): the gateway that generates a turn holds
its lock and counts its own readers; a reader on another gateway holds a lease in Redis (renewed by its
gateway's keep-alive, so a dead gateway's readers lapse), and the grace counts those too. A cancel, or a
clean close by a last reader, on another gateway is pushed to the generating gateway's control list (its
name is in the lock), which acts on it at once. With an engine whose requests outlive their gateway
(``engine.client.Adoptable``: workers behind Redis), the keep-alive of a surviving gateway takes over the
turns of a dead one: it takes the lock (compare-and-set, so one gateway gets each turn), re-reads the
reply's events so far, and relays the rest of the request's output from where the dead gateway stopped,
then stores the reply once. Otherwise a dead gateway's turn is recovered as ``interrupted``.

Fencing: every event a turn writes, and its stored reply, carry the turn's lock token, checked in the
Lua script. A gateway that lost the lock (it stalled past the TTL while another gateway took the turn over)
has its first write refused and stops relaying at once; its request, which the other gateway relays, is
released rather than aborted.

Crash safety (see :mod:`chatsvc.store`): a turn is registered before the engine sees its request, its
lock is refreshed by the registry's keep-alive task, which also recovers the turns of dead instances.
If Redis is unreachable, generation goes on and the finished reply waits in memory while
``end_turn`` (idempotent) is retried for up to ``STORE_RETRY_S``.

Events are written through the registry's :class:`EventWriter` (one Redis command for the deltas of
all turns that arrive together). A reader in this process of a turn running here follows the turn's
in-memory log of stored events instead of polling Redis per token; it sees the same ids and events,
and falls back to the Redis stream if the turn ends without its terminal event in that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import RedisError

from chatsvc.cache_isolation import CacheIsolation
from chatsvc.errors import APIError
from chatsvc.generation import Generation
from chatsvc.history import fit_conversation, fit_stored_history
from chatsvc.metrics import Metrics
from chatsvc.offload import Offload
from chatsvc.quotas import Lease
from chatsvc.rates import Rates
from chatsvc.schemas import SessionMessage, resolve_max_tokens, session_not_found, usage
from chatsvc.settings import Settings
from chatsvc.store import EventWriter, SessionGone, SessionMeta, Store
from chatsvc.store.base import retried
from chatsvc.store.keys import lock_key, stream_key
from chatsvc.store.streams import Fenced, settle
from chatsvc.tools import parse_reply, unknown_tool_results
from chatsvc.warm import SessionWarmer
from chatsvc.wire import delta_event
from engine.client import Adoptable, EngineClient
from engine.protocol import RequestDelta

log = logging.getLogger("chatsvc.turns")
T = TypeVar("T")
TERMINAL = ("done", "error")
# Instance heartbeat and lock refresh period: several beats fit in store.liveness's INSTANCE_TTL_S and
# LOCK_TTL_S, so one slow beat (or a short Redis hiccup) neither makes this instance look dead nor loses a lock.
HEARTBEAT_S = 3.0
STORE_RETRY_S = 60.0  # how long a finished reply waits in memory for an unreachable Redis
FENCED = -2  # end_turn's answer when another gateway holds the turn's lock
READER_LEASE_S = 10.0  # a reader on another gateway counts this long after its gateway last renewed it
PEER_POLL_S = 0.5  # how often a turn without local readers looks for readers on other gateways
CONTROL_BLOCK_S = 1.0
CANCEL_WAIT_S = 30.0  # how long a cancel sent to another gateway waits for its turn to end
HAND_OFF_S = 10.0  # a hand-off Redis does not let finish this soon gives up (TurnRegistry.hand_off)
_STREAM_ID = re.compile(r"\d+-\d+")


def event_id(turn: int, stream_id: str) -> str:
    return f"{turn}:{stream_id}"


def parse_event_id(value: str | None) -> tuple[int | None, str]:
    """``"turn:stream-id"`` -> (turn, stream id); a bare stream id means the latest turn."""
    if not value:
        return None, "0"
    turn, sep, sid = value.partition(":")
    if sep and turn.isdigit():
        return int(turn), sid or "0"
    return None, value


def _stream_id_key(sid: str) -> tuple[int, int]:
    ms, _, seq = sid.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class ActiveTurn:
    session_id: str
    turn: int
    request_id: str
    truncated_turns: int = 0  # oldest turns left out of the prompt to fit the context
    owner: str = ""  # whose session: /v1/kv names only the caller's own requests
    readers: int = 1
    task: asyncio.Task[None] | None = None
    grace: asyncio.Task[None] | None = None
    # A task cancelled before its first step never runs its cleanup, so aborts before that set a flag.
    running: bool = False
    abort_requested: bool = False
    interrupted: bool = False  # ended by the gateway's shutdown, not by a client: stored as "interrupted"
    # Stored events in stream order, (stream id, event, its JSON): what local readers follow.
    log: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as the log grows
    closed: bool = False  # no more events will be logged
    unwritten: int = 0  # events handed to the writer and not yet stored (or failed)
    drained: asyncio.Future[None] | None = None
    write_error: BaseException | None = None  # the first failed event write (logged once)
    stored: int | None = None  # end_turn's answer once the reply is stored
    lease: Lease = field(default_factory=Lease)  # the owner's quota place, given back when the turn ends
    fenced: bool = False  # another gateway holds the session lock now: this one writes nothing more
    storing: bool = False  # relaying is over; the reply is being stored
    relayed: bool = False  # every delta is in (its request ended): a drain's hand-off leaves it to be stored here

    def wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class TurnRegistry:
    def __init__(self, engine: EngineClient, store: Store, metrics: Metrics, settings: Settings,
                 offload: Offload | None = None, isolation: CacheIsolation | None = None) -> None:
        self.engine = engine
        # Salts each turn's prefix-cache hashes with its owner's salt (None: unit tests without an engine).
        self.isolation = isolation
        # Where a turn's prompt is tokenized (its worker threads hold tokenizer copies); else a default thread.
        self.offload = offload
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.active: dict[str, ActiveTurn] = {}
        self.warmer = SessionWarmer(engine, store, offload, isolation)
        self.writer = EventWriter(store)
        self.store_retry_s = STORE_RETRY_S
        self._keepalive: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._holds: dict[str, tuple[str, int]] = {}  # reader id -> (session, turn) generated elsewhere
        self.rates: Rates | None = None  # charges each turn's prompt tokens (None: unit tests without one)

    async def open(self) -> None:
        """Announce this instance and recover what dead ones left (before the first request, so a restarted
        gateway finds its predecessor's sessions free), then keep that up: heartbeat, lock refresh, recovery."""
        if self._keepalive is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):  # Redis away at start-up: the loop catches up later
                    await self._beat()
            self._keepalive = asyncio.create_task(self._keep_alive(), name="turns-keepalive")
            self._listener = asyncio.create_task(self._listen(), name="turns-control")

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._beat()

    async def _beat(self) -> None:
        try:
            await self.store.heartbeat()
            for at in list(self.active.values()):
                if at.stored is None and not await self.store.refresh_lock(at.session_id, at.turn):
                    if await self.store.lock_holder(at.session_id) is not None:
                        self._fence(at)  # another gateway took the turn over
                    elif not at.storing:  # while storing, end_turn's own release of the lock fails the refresh
                        log.warning("turn %s lost its lock (recovered or deleted?)", at.request_id)
            for reader, (sid, turn) in list(self._holds.items()):
                await self.store.hold_reader(sid, turn, reader, READER_LEASE_S)
            adoptable = isinstance(self.engine, Adoptable)
            if adoptable:
                for sid, turn in await self.store.take_over_turns(skip=set(self.active)):
                    await self._take_over(sid, turn)
            for sid in await self.store.recover_dead_turns(skip=set(self.active), adoptable=adoptable):
                log.warning("recovered the interrupted reply of session %s", sid)
        except RedisError as exc:
            log.warning("Redis unreachable for the turn keep-alive: %r", exc)
        except Exception:  # noqa: BLE001 - the keep-alive must outlive any one bad beat
            log.exception("turn keep-alive failed")

    async def start(self, meta: SessionMeta, sampling: SessionMessage, lease: Lease | None = None) -> ActiveTurn:
        """Validate, store the user message (or tool result), admit the request and start generating (one
        reader attached).

        The turn is registered (busy, cancellable) before the engine sees the request; admission errors
        (invalid request, full queue) still come back from here, with the user message rolled back.
        ``lease`` (the owner's quota place) is given back exactly once: here if no turn starts, else when
        the turn ends."""
        lease = lease or Lease()
        try:
            return await self._start(meta, sampling, lease)
        except BaseException:
            if meta.id not in self.active or self.active[meta.id].lease is not lease:
                await lease.release()
            raise

    async def _start(self, meta: SessionMeta, sampling: SessionMessage, lease: Lease) -> ActiveTurn:
        content = sampling.content
        if len(content) > self.settings.max_message_chars:
            raise APIError(413, f"message exceeds {self.settings.max_message_chars} characters",
                           code="message_too_large", param="content")
        if meta.id in self.active:
            raise APIError(409, "a reply is already being generated for this session", code="session_busy")
        if meta.prompt_lost:
            raise APIError(410, "this session's system prompt is no longer stored (evicted from Redis); its "
                           "messages can still be read: start a new session to go on", code="system_prompt_lost")
        message = sampling.stored()
        tools = sampling.tool_dicts() if sampling.calls_tools() else None
        tok = self.engine.tokenizer
        max_len = self.engine.max_model_len
        room = sampling.max_tokens or min(self.settings.default_session_max_tokens, max_len // 4)

        def tokenize(history: list[dict[str, Any]]) -> tuple[list[int], int]:
            return fit_conversation(tok, meta.system_prompt, history, message, max_len, room, tools)

        async def fit(history: list[dict[str, Any]]) -> tuple[list[int], int]:
            # A long history and message take the tokenizer a while (it releases the GIL): not on the loop.
            return await (self.offload.run(tokenize, history) if self.offload is not None
                          else asyncio.to_thread(tokenize, history))

        # Only the newest messages the context can hold are read and decoded (chatsvc.history).
        prompt_ids, truncated, history = await fit_stored_history(
            lambda n: self.store.message_page(meta.id, n, count_users=True), fit)
        if unknown_tool_results([*history, message]) == len(history):
            raise APIError(400, f"tool_call_id {sampling.tool_call_id!r} matches no tool call of this session",
                           code="invalid_value", param="tool_call_id")
        content_tokens = len(await (self.offload.run(tok.encode, content) if self.offload is not None
                                    else asyncio.to_thread(tok.encode, content)))
        max_tokens = resolve_max_tokens(sampling.max_tokens, len(prompt_ids), self.engine.max_model_len,
                                        self.settings.default_session_max_tokens)
        params = sampling.sampling_params(max_tokens)
        if self.isolation is not None:
            params = self.isolation.apply(meta.owner, params, prompt_ids)
        if self.rates is not None:  # the turn's prefill, charged before anything is stored
            await self.rates.charge(meta.owner, len(prompt_ids), "content")
        user_msg = {**message, "created": time.time(), "tokens": content_tokens}
        try:
            turn = await self.store.begin_turn(meta.id, user_msg, meta.owner)
        except SessionGone as exc:
            raise session_not_found(meta.id) from exc
        if turn is None or meta.id in self.active:
            raise APIError(409, "a reply is already being generated for this session", code="session_busy")
        at = ActiveTurn(meta.id, turn, f"{meta.id}-{turn}", truncated_turns=truncated, owner=meta.owner,
                        lease=lease)
        gen = Generation(self.engine, self.metrics, at.request_id, params, prompt_ids, self.settings.retry_after_s,
                         session_id=meta.id)
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.active[meta.id] = at
        at.task = asyncio.create_task(self._run(at, gen, admitted), name=f"turn-{at.request_id}")
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            self.detach(at, abort_now=False)  # the caller left before it could read: the grace applies
            raise
        return at

    async def _run(self, at: ActiveTurn, gen: Generation, admitted: asyncio.Future[None]) -> None:
        """Start the engine request, then relay its reply. A request the engine refuses ends the turn here:
        it is rolled back and ``admitted`` carries the error to :meth:`start`."""
        at.running = True
        try:
            if at.abort_requested:
                raise asyncio.CancelledError
            await gen.start()
        except asyncio.CancelledError:
            await gen.close()  # cancelled before it began: stored as aborted
        except BaseException as exc:
            self.active.pop(at.session_id, None)
            await at.lease.release()
            try:
                await self.store.rollback_turn(at.session_id, at.turn)
            except RedisError:
                log.exception("could not roll back turn %s", at.request_id)
            admitted.set_exception(exc)
            return
        admitted.set_result(None)
        await self._relay(at, gen.deltas() if gen.started else None, gen.close, [], "abort",
                          len(gen.prompt_token_ids))

    async def _relay(self, at: ActiveTurn, deltas: AsyncIterator[RequestDelta] | None,
                     close: Callable[[], Awaitable[None]] | None, parts: list[str], reason: str,
                     prompt_len: int) -> None:
        """Pass a reply's deltas to its readers, then store it: the path of a turn generated here and of one
        taken over from a dead gateway. ``reason`` is the finish reason if no delta is read at all."""
        at.running = True
        last: RequestDelta | None = None
        key = stream_key(at.session_id, at.turn)
        try:
            if deltas is not None and not at.abort_requested:
                reason = "abort"
                async for d in deltas:
                    if at.fenced:
                        break  # let go while a Redis command swallowed the cancel: not one event more
                    last = d
                    parts.append(d.text)
                    if d.finished:
                        reason = d.finish_reason or "stop"
                    # Not awaited: deltas of every turn that arrive together share one Redis command.
                    # A failed write (Redis away) does not stop the reply: it is kept here and stored at
                    # the end; readers then miss deltas but get the whole message in the done event.
                    n = len(d.token_ids)
                    self._emit(at, key, {"type": "delta", "text": d.text, "tokens": n}, delta_event(d.text, n))
                at.relayed = not at.fenced
                if at.unwritten:
                    at.drained = asyncio.get_running_loop().create_future()
                    await at.drained
        except asyncio.CancelledError:
            reason = "abort"
        except Exception:
            log.exception("turn %s failed", at.request_id)
            reason = "error"
        finally:
            if close is not None:
                await close()
        if at.interrupted and reason == "abort":
            reason = "interrupted"
        await self._store_reply(at, key, parts, reason, last, prompt_len)

    def _fence(self, at: ActiveTurn) -> None:
        """The turn's lock is another gateway's now (this one stalled past its TTL and the turn was taken
        over, or recovered): stop relaying at once and write nothing more."""
        if at.fenced:
            return
        log.warning("turn %s lost its lock to another gateway: no longer relaying it", at.request_id)
        self._let_go(at)

    def _let_go(self, at: ActiveTurn) -> None:
        """Stop relaying the turn and write nothing more; its request, which another gateway relays (or is
        about to), is released rather than aborted."""
        at.fenced = True
        if isinstance(self.engine, Adoptable):
            self.engine.release(at.request_id)
        at.abort_requested = True
        if at.running and not at.storing and at.task is not None:
            at.task.cancel()

    async def hand_off(self) -> int:
        """At the end of a drain: leave the turns still running to the other gateways instead of cutting them,
        through the take-over of a dead gateway's turns. Only with an engine whose requests outlive this gateway,
        and while another gateway lives to take them. Relaying stops, each turn's events so far are stored
        (the gateway that takes it over counts the tokens already sent from them), and this instance then counts
        as dead, so the others' next keep-alive beat takes the turns over rather than one a heartbeat's TTL
        later. A local reader's place is held in Redis for a reader lease, so the taker's grace does not abort
        the reply while its client moves over. A turn whose events did not all reach Redis (the taker could
        not tell what was sent) is cut and stored here first, as :meth:`shutdown` would. Returns the turns
        handed off."""
        if not isinstance(self.engine, Adoptable) or not self.active:
            return 0
        handed: list[ActiveTurn] = []
        try:
            async with asyncio.timeout(HAND_OFF_S):
                if not await self.store.peers_alive():
                    log.warning("no other gateway is alive: the turns still running are not handed off")
                    return 0
                # Nothing of this instance beats any more, or it would look alive again once it stepped down.
                await self._stop_background()
                tasks = [at.task for at in self.active.values() if at.task is not None]
                for at in list(self.active.values()):
                    if at.storing or at.relayed:
                        continue  # its request ended: stored here, its lock released
                    if at.write_error is None:
                        handed.append(at)
                        self._let_go(at)
                    else:
                        at.interrupted = True
                        self._abort(at)
                if tasks:
                    await asyncio.wait(tasks)  # not gather: a timeout here must not cancel a reply being stored
                for at in handed:
                    if at.unwritten:  # the taker must find every event this gateway relayed
                        at.drained = asyncio.get_running_loop().create_future()
                        await at.drained
                    if at.readers > 0:
                        await self.store.hold_reader(at.session_id, at.turn, f"{self.store.instance}|handoff",
                                                     READER_LEASE_S)
                await self.store.step_down()
        except (RedisError, TimeoutError) as exc:
            # What was let go is taken over once this instance's heartbeat lapses, as after a crash.
            log.warning("could not finish handing the running turns off: %r", exc)
            return 0
        log.warning("handed %d running turns off to the other gateways", len(handed))
        return len(handed)

    async def _store_reply(self, at: ActiveTurn, key: str, parts: list[str], reason: str, last: RequestDelta | None,
                           prompt_len: int) -> None:
        """Store the reply (once), write its done event, and let the turn go; a fenced turn stores nothing
        (the gateway that holds its lock does)."""
        at.storing = True
        u = usage(last.prompt_tokens if last else prompt_len,
                  last.completion_tokens if last else 0, last.cached_tokens if last else 0)
        # A reply written under a tool grammar that called tools is stored as its calls: a reply's text starts
        # with a call only then (the grammar keeps text from starting with one), which holds for a turn taken
        # over from a dead gateway too.
        content, calls = parse_reply("".join(parts))
        if calls and reason == "stop":
            reason = "tool_calls"
        msg = {"role": "assistant", "content": content or "", "created": time.time(),
               "tokens": u["completion_tokens"], "finish_reason": reason, "prompt_tokens": u["prompt_tokens"],
               "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
        if calls:
            msg["tool_calls"] = calls
        try:
            if at.fenced:
                return
            deadline = time.monotonic() + self.store_retry_s
            at.stored = await self._retrying(at, deadline, lambda: self.store.end_turn(at.session_id, at.turn, msg))
            if at.stored == FENCED:
                self._fence(at)
                return
            done: dict[str, Any] = {"type": "done", "finish_reason": reason, "usage": u, "message": msg}
            if at.truncated_turns:
                done["truncated_turns"] = at.truncated_turns
            await self._retrying(at, deadline, lambda: self._write_final(at, key, done))
        except Exception:
            log.exception("could not store the reply of %s", at.request_id)
        finally:
            at.closed = True
            at.wake()
            self.writer.forget(key)
            self.active.pop(at.session_id, None)
            if at.grace is not None:
                at.grace.cancel()
            await at.lease.release()

    async def _take_over(self, sid: str, turn: int) -> None:
        """Generate the rest of a turn whose gateway died (its lock is ours now), as :meth:`_run` would have."""
        assert isinstance(self.engine, Adoptable)
        meta = await self.store.meta_of(sid)
        at = ActiveTurn(sid, turn, f"{sid}-{turn}", owner=meta.owner if meta else "", readers=0)
        after = "0"
        while events := await self.store.read_events_json(sid, turn, after, block_ms=0):
            at.log.extend(events)  # local readers follow the whole reply from this log
            after = events[-1][0]
        parts = [str(ev.get("text", "")) for _, ev, _ in at.log if ev.get("type") == "delta"]
        done = sum(int(ev.get("tokens", 0)) for _, ev, _ in at.log if ev.get("type") == "delta")
        ended = next((ev for _, ev, _ in at.log if ev.get("type") in TERMINAL), None)
        if ended is not None:
            # Stored before its done event was written (only the lock's release was lost): end_turn stores
            # nothing again, and gives the lock back.
            await self.store.end_turn(sid, turn, dict(ended.get("message") or {"role": "assistant", "content": ""}))
            return
        try:
            stream = await self.engine.adopt(at.request_id, done)
        except Exception as exc:  # noqa: BLE001 - the lock is ours now: the turn is stored either way
            log.warning("could not take over the request of %s: %r", at.request_id, exc)
            stream = None
        log.warning("took over turn %s of a dead gateway after %d tokens (%s)", at.request_id, done,
                    "relaying the rest" if stream is not None else "its request is gone: storing it interrupted")
        self.active[sid] = at
        relay = self._relay(at, stream, getattr(stream, "aclose", None), parts, "interrupted", 0)
        at.task = asyncio.create_task(relay, name=f"turn-{at.request_id}")
        at.grace = asyncio.create_task(self._grace(at))  # no reader here yet: readers elsewhere may count

    async def _retrying(self, at: ActiveTurn, deadline: float, op: Callable[[], Awaitable[T]]) -> T:
        """``op()``, retried with backoff while Redis is unreachable or refuses writes (``retried``: out of
        memory, read-only or too few replicas during a failover, loading), until ``deadline`` (then it raises).
        Only idempotent writes are retried: one that timed out may still have been applied."""
        delay = 0.1
        while True:
            try:
                return await op()
            except RedisError as exc:
                if not retried(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("Redis unreachable or refusing writes while storing %s (%r); retrying in %.1fs",
                            at.request_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _write_final(self, at: ActiveTurn, key: str, done: dict[str, Any]) -> None:
        stored = asyncio.get_running_loop().create_future()
        self._emit(at, key, done, json.dumps(done), stored)
        await stored

    def _emit(self, at: ActiveTurn, key: str, ev: dict[str, Any], data: str,
              stored: asyncio.Future[None] | None = None) -> None:
        """Hand one event to the writer; once stored it joins the turn's log and wakes its readers."""

        def written(eid: str | None, exc: BaseException | None) -> None:
            at.unwritten -= 1
            if isinstance(exc, Fenced):
                self._fence(at)
            if eid is not None:
                at.log.append((eid, ev, data))
                at.wake()
            elif at.write_error is None:
                at.write_error = exc
                log.warning("events of %s are not reaching Redis (%r): the reply is kept for its done event",
                            at.request_id, exc)
            if at.unwritten == 0 and at.drained is not None and not at.drained.done():
                at.drained.set_result(None)
            if stored is not None:
                settle(stored, None, exc)

        at.unwritten += 1
        fence = (lock_key(at.session_id), self.store.lock_token(at.turn))
        self.writer.append(key, data, written, final=stored is not None, fence=fence)

    # -- readers ----------------------------------------------------------------------------------
    def attach(self, session_id: str, turn: int) -> ActiveTurn | None:
        at = self.active.get(session_id)
        if at is None or at.turn != turn:
            return None
        at.readers += 1
        if at.grace is not None:
            at.grace.cancel()
            at.grace = None
        return at

    def detach(self, at: ActiveTurn, abort_now: bool) -> None:
        at.readers -= 1
        if at.readers > 0 or at.task is None or at.task.done():
            return
        if abort_now:
            self._abort(at)
        elif at.grace is None:
            at.grace = asyncio.create_task(self._grace(at))

    async def attach_remote(self, session_id: str, turn: int) -> str | None:
        """Hold a place, as a reader, on a turn another gateway generates (one whose lock is that turn's):
        the reader id to give back with :meth:`detach_remote`; None when no gateway generates the turn."""
        holder = await self.store.lock_holder(session_id)
        if holder is None or holder[1] != turn:
            return None
        reader = f"{self.store.instance}|{secrets.token_hex(6)}"
        self._holds[reader] = (session_id, turn)
        await self.store.hold_reader(session_id, turn, reader, READER_LEASE_S)
        return reader

    def detach_remote(self, reader: str, abort_now: bool) -> None:
        """Give a place on another gateway's turn back; that gateway's grace (or ``abort_now``) takes it from
        there."""
        held = self._holds.pop(reader, None)
        if held is not None:
            asyncio.create_task(self._detach_remote(*held, reader, abort_now))

    async def _detach_remote(self, session_id: str, turn: int, reader: str, abort_now: bool) -> None:
        try:
            await self.store.drop_reader(session_id, turn, reader)
            if abort_now:
                await self._tell_holder(session_id, turn, "detach")
        except Exception as exc:  # noqa: BLE001 - its lease lapses by itself
            log.warning("could not give a reader's place back: %r", exc)

    async def _tell_holder(self, session_id: str, turn: int, op: str) -> bool:
        holder = await self.store.lock_holder(session_id)
        if holder is None or holder[1] != turn or not holder[2]:
            return False
        await self.store.send_control(holder[0], {"op": op, "session_id": session_id, "turn": turn})
        return True

    async def _remote_readers(self, at: ActiveTurn) -> int:
        try:
            return await self.store.readers(at.session_id, at.turn)
        except RedisError as exc:  # cannot tell: the grace goes on as if there were none
            log.warning("could not count the other gateways' readers of %s: %r", at.request_id, exc)
            return 0

    async def _grace(self, at: ActiveTurn) -> None:
        await asyncio.sleep(self.settings.abort_grace_s)
        while at.readers <= 0 and at.task is not None and not at.task.done():
            if not await self._remote_readers(at):
                log.info("no reader came back for %s: aborting", at.request_id)
                self._abort(at)
                return
            # Read on another gateway: watch until that reader leaves, then grant it a whole grace too.
            while at.readers <= 0 and not at.task.done() and await self._remote_readers(at):
                await asyncio.sleep(PEER_POLL_S)
            await asyncio.sleep(self.settings.abort_grace_s)

    async def _listen(self) -> None:
        """Act on the other gateways' requests about the turns generated here (cancel, last reader gone)."""
        while True:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # redis-py may swallow a cancel mid-command
                raise asyncio.CancelledError
            try:
                msg = await self.store.next_control(CONTROL_BLOCK_S)
            except RedisError as exc:
                log.warning("Redis unreachable for the control list: %r", exc)
                await asyncio.sleep(CONTROL_BLOCK_S)
                continue
            if msg is None:
                continue
            at = self.active.get(str(msg.get("session_id")))
            if at is None or at.turn != msg.get("turn"):
                continue
            # A cancel aborts; a clean close by a reader elsewhere aborts if that reader was the last one.
            last_gone = msg.get("op") == "detach" and at.readers <= 0 and not await self._remote_readers(at)
            if msg.get("op") == "cancel" or last_gone:
                self._abort(at)

    @staticmethod
    def _abort(at: ActiveTurn) -> None:
        at.abort_requested = True
        if at.running and at.task is not None:
            at.task.cancel()

    async def cancel(self, session_id: str) -> bool:
        at = self.active.get(session_id)
        if at is None or at.task is None:
            return await self._cancel_elsewhere(session_id)
        self._abort(at)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(at.task)
        return True

    async def _cancel_elsewhere(self, session_id: str) -> bool:
        """Cancel the turn another live gateway generates, and wait (bounded) until it is stored."""
        holder = await self.store.lock_holder(session_id)
        if holder is None or holder[0] == self.store.instance or not await self._tell_holder(
                session_id, holder[1], "cancel"):
            return False
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and await self.store.lock_holder(session_id) == holder:
            await asyncio.sleep(0.05)
        return True

    async def shutdown(self) -> None:
        tasks = [at.task for at in self.active.values() if at.task is not None]
        for at in list(self.active.values()):
            at.interrupted = True  # what a drain did not finish in time, or a shutdown without one
            self._abort(at)
        await asyncio.gather(*tasks, return_exceptions=True)
        if await self._stop_background():
            with contextlib.suppress(RedisError):
                await self.store.retire()

    async def _stop_background(self) -> bool:
        """Stop the keep-alive and the control listener; whether they ran."""
        background = [t for t in (self._listener, self._keepalive) if t is not None]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        self._listener = self._keepalive = None
        return bool(background)

    async def follow_json(self, session_id: str, turn: int,
                          after: str) -> AsyncIterator[tuple[str, dict[str, Any], str]]:
        """Events of one reply after stream id ``after``, until its done/error event (or until it is gone):
        (event id, event, its JSON as stored)."""
        at = self.active.get(session_id)
        if at is not None and at.turn == turn and (after == "0" or _STREAM_ID.fullmatch(after)):
            # The turn runs here: follow its log; what it holds is exactly the stream's content so far.
            mark = _stream_id_key(after)
            i = next((j for j, (sid, _, _) in enumerate(at.log) if _stream_id_key(sid) > mark), len(at.log))
            while True:
                while i < len(at.log):
                    sid, ev, data = at.log[i]
                    i += 1
                    after = sid
                    yield event_id(turn, sid), ev, data
                    if ev["type"] in TERMINAL:
                        return
                if at.closed:
                    break  # ended without its terminal event logged: Redis says what is left
                await at.changed.wait()
        async for item in self._follow_redis(session_id, turn, after):
            yield item

    async def _follow_redis(self, session_id: str, turn: int,
                            after: str) -> AsyncIterator[tuple[str, dict[str, Any], str]]:
        while True:
            events = await self.store.read_events_json(session_id, turn, after, block_ms=1000)
            if not events:
                at = self.active.get(session_id)
                holder = None if at is not None else await self.store.lock_holder(session_id)
                if (at is None or at.turn != turn) and (holder is None or holder[1] != turn):
                    # Finished (or never ran): drain what is left without blocking, then stop. A turn whose
                    # lock is held runs on another gateway, or is about to be taken over or recovered.
                    events = await self.store.read_events_json(session_id, turn, after, block_ms=0) \
                        if await self.store.stream_exists(session_id, turn) else []
                    if not events:
                        # The reply ended without its done/error event (the server restarted
                        # mid-reply, or the stream expired): say so rather than go quiet.
                        ended = {"type": "error", "code": "stream_ended",
                                 "message": "this reply is no longer being generated; send the message again"}
                        yield event_id(turn, after), ended, json.dumps(ended)
                        return
            for sid, ev, data in events:
                after = sid
                yield event_id(turn, sid), ev, data
                if ev.get("type") in TERMINAL:
                    return
