"""``RemoteEngine``: the ``EngineClient`` of a gateway without a model (``chatsvc serve --engine redis``).

Requests go to engine workers (``chatsvc.worker``) over Redis Streams; keys and message formats are in
``engine.streams``. The gateway keeps the tokenizer (it renders chats and counts tokens) and no model.

Worker view. A monitor task reads every worker's beat each ``poll_s`` seconds: load, pinned prefixes,
limits. A registered worker without a beat is dead: the monitor deletes its keys (any gateway may; it is
idempotent), and every stream this gateway reads from it fails over.

Placement (``chatsvc.router.Router``): the session's last worker (``route:session:{sid}`` in Redis, so any
gateway finds it), else a worker that has the request's persona pinned, else the least loaded, all under a
load bound. A request whose prompt starts with a pinned prefix (``pin_prefix``: personas) names it in its
``Generate``; the worker pins it the first time it serves it. No worker alive: the request waits up to
``wait_for_worker_s`` for one, then ``EngineDeadError`` (the gateway's 503 with Retry-After).

Failover. A stream whose worker dies (its beat lapses) or leaves before starting it (``WorkerGone``) is
dispatched again, to another worker, with the prompt plus the tokens already streamed and the rest of
``max_tokens`` (and of ``min_tokens``). The new worker recomputes those tokens' KV as a prompt (the path a
recompute preemption takes) and continues; deltas keep counting prompt and completion tokens of the
original request, so the caller sees one stream with no token twice and none missing. Greedy sampling
gives the same reply as an uninterrupted run. A seeded sampled stream goes on where it was: the sampler
draws one number per token from a seeded row's generator, so the re-dispatch carries the count of tokens
already sampled (``SamplingParams.seed_offset``) and the new worker's generator skips that many draws; the
reply equals an uninterrupted run's with the same seed. The new worker decodes only its own tokens, so
after a failover the gateway re-derives each delta's text with one detokenizer over all the reply's tokens
(a character split over the failover point is whole, a stop string straddling it ends the stream). Not
exact across a failover, and documented as such: output-token penalties (presence, frequency) no longer see
the tokens before the failover (they are prompt tokens there). A request of ``n > 1`` fails with
``EngineDeadError`` instead.

Progress deadline. A dispatch whose worker beats but sends nothing for ``progress_timeout_s`` (plus the
worker's measured prefill time of the prompt, before the first entry) is taken for lost (``WorkerStalled``):
its worker wedged, its entry was dropped (another format version), or its output was lost. It is aborted
there and failed over like a dead worker's, to another one; when no other worker is live the request fails
with ``EngineDeadError``. An output entry this side cannot decode is dead-lettered and fails the request with
``TransportError`` (an engine failure, the gateway's 503); a request that would not decode on the worker is
refused before it is sent (``ProtocolError``, the caller's 400).

A full queue. A worker that refuses a request before it started (``QueueFullError``) is left out and the
request placed again among the others; only when every live worker refused it does the caller get
``QueueFullError`` (the gateway's 429).

Take-over (``adopt``). A worker writes a request's output stream whether anyone reads it or not, and
``route:request:{rid}`` names the dispatch (with the tokens streamed before it, after a failover). When the
gateway that dispatched a request dies, another gateway's session turns (``chatsvc.turns``) take the turn
over and call ``adopt`` with the count of tokens the dead gateway passed on: the stream is read from its
start and the deltas up to that count skipped (the dead gateway stored one event per delta, so the count
falls on a delta boundary). Not built: an adopted stream whose worker dies too is not dispatched again (the
turn ends with the reply so far), and output streams are not trimmed as they are read (take-over needs them
whole; each expires ``OUT_TTL_S`` after its request ends).

Bounded output. The stream is pulled: the gateway XREADs a batch (at most 256 entries) only when its caller
asks for the next delta, so a caller that never reads holds one batch in the gateway, and the worker writes
on into Redis. To bound that as the local engines' ``DeltaQueue`` does, the monitor looks at each stream
whose caller has not pulled for a second (one XREVRANGE: the worker's last entry) and, once the worker has
written more than ``stream_limits.max_buffered`` entries (tokens and their logprob alternatives) past what
the caller read, aborts the request on its worker (its blocks are freed at once) and the caller's next pull
raises ``StreamOverflowError``. Adopted streams (take-over) are not watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from chatsvc.redis_client import RedisTarget, connect
from chatsvc.router import Router
from chatsvc.settings import SESSION_TTL_S
from engine.client import EngineClient, StreamCounters, StreamLimits
from engine.detokenizer import IncrementalDetokenizer
from engine.protocol import (
    MAX_TOKEN_ID,
    SNAPSHOT_WINDOW_S,
    Abort,
    AddRequest,
    EngineDeadError,
    EngineStats,
    KVSnapshot,
    PoolView,
    ProtocolError,
    QueueFullError,
    RequestError,
    StreamOverflowError,
    TransportError,
    Unpin,
    WantSnapshot,
    Warm,
    encode_command,
    parse,
)
from engine.request import RequestLimits, SamplingParams, make_request
from engine.streams import (
    DEAD_LETTER_MAXLEN,
    Beat,
    Deltas,
    Generate,
    Keys,
    dead_letter,
    decode,
    encode,
    entries,
    pin_value,
    raise_if_cancelled,
    read_pin,
)

if TYPE_CHECKING:
    from engine.protocol import RequestDelta
    from engine.tokenizer import Tokenizer

log = logging.getLogger("chatsvc.remote")

__all__ = ["RemoteEngine", "WorkerLost", "WorkerStalled"]

POLL_S = 0.25
WAIT_FOR_WORKER_S = 10.0
# No entry from a dispatch's worker for this long (plus its measured prefill time of the prompt, before the
# first one): the dispatch is taken for lost. Above any step a healthy worker takes, and above a request's wait
# in a worker's queue under the load it is sized for; a request queued longer than this is moved.
PROGRESS_TIMEOUT_S = 120.0
# Entries a worker control stream keeps (about: trimmed a node at a time); far more than a live worker lags.
CONTROL_MAXLEN = 1000
ROUTE_TTL_S = 24 * 3600
# The counters that add up over workers; the others (estimates, thread counts) are per engine.
_SUMMED = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "cpu_blocks_total", "cpu_blocks_free",
           "requests_running", "requests_waiting", "requests_swapped", "prefix_cache_queried_tokens",
           "prefix_cache_hit_tokens", "preemptions_swap", "preemptions_recompute", "max_waiting",
           "kv_host_blocks_total", "kv_host_blocks_cached", "kv_host_bytes", "kv_host_hit_blocks",
           "kv_host_offloaded_blocks", "kv_disk_blocks", "kv_disk_bytes", "kv_disk_hit_blocks",
           "kv_disk_spilled_blocks", "kv_disk_failed_loads", "kv_disk_dropped_files", "kv_disk_write_failures",
           "kv_disk_load_seconds", "kv_warm_loaded_blocks", "kv_warm_read_blocks", "kv_host_preloaded_blocks")


class WorkerLost(Exception):
    """The worker of a dispatch died, or left without running it: dispatch it again elsewhere."""


class WorkerStalled(WorkerLost):
    """The worker of a dispatch is alive (it beats) but sent nothing for it within the progress deadline: it
    is wedged, or the request's entry or its output was lost on the way. Aborted there, dispatched elsewhere."""


@dataclasses.dataclass
class _Reader:
    """How far the caller of one open stream has read, for the slow-reader bound."""

    worker: str
    dispatch: str
    base: int  # output tokens of earlier dispatches (failover)
    per_token: int  # entries one token costs: itself and its logprob alternatives
    read: int = 0  # output tokens handed to the caller
    pulled: float = dataclasses.field(default_factory=time.monotonic)
    overflowed: bool = False


class RemoteEngine(EngineClient):
    def __init__(self, redis: Any, tokenizer: Tokenizer, model_name: str, *, max_model_len: int = 2048,
                 keys: Keys | None = None, router: Router | None = None, session_ttl_s: int = SESSION_TTL_S,
                 poll_s: float = POLL_S, wait_for_worker_s: float = WAIT_FOR_WORKER_S,
                 stream_limits: StreamLimits | None = None, control_maxlen: int = CONTROL_MAXLEN,
                 progress_timeout_s: float = PROGRESS_TIMEOUT_S) -> None:
        self.r = redis
        self.progress_timeout_s = progress_timeout_s
        self.control_maxlen = control_maxlen
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len  # until a worker says what it serves
        self.keys = keys or Keys()
        self.router = router or Router()
        self.session_ttl_s = session_ttl_s
        self.poll_s = poll_s
        self.wait_for_worker_s = wait_for_worker_s
        self.workers: dict[str, Beat] = {}  # the live workers' last beats
        self.stream_limits = stream_limits or StreamLimits()
        self.stream_counters = StreamCounters()
        self._readers: dict[str, _Reader] = {}  # request id -> its caller's progress (streams this gateway reads)
        self.failovers = 0
        self.hop_seconds = 0.0  # worker write -> gateway read, summed over output entries (one per step)
        self.hop_entries = 0
        self._pins: dict[str, list[int]] = {}  # pin key -> prefix token ids (the Redis hash, refreshed)
        self._pending: Counter[str] = Counter()  # this gateway's open dispatches per worker
        self._pinning: dict[str, set[str]] = {}  # pins this gateway's requests asked of each worker
        self._kv: dict[str, KVSnapshot] = {}
        self._kv_asked = 0.0
        self._monitor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unpinning: dict[str, asyncio.Task[Any]] = {}
        self._started = False
        self._stopping = False
        self._released: set[str] = set()  # requests another gateway relays now (this one lost the turn)

    @classmethod
    def from_url(cls, url: str | RedisTarget, model: str | None = None, **kwargs: Any) -> RemoteEngine:
        """A gateway's client: the model's tokenizer (no weights are read) and a Redis connection pool, on a Redis
        URL or a :class:`RedisTarget` (Sentinels, credentials)."""
        from engine.model_files import load_tokenizer, resolve_model_path

        tokenizer, config = load_tokenizer(model)
        tokenizer.eos_token_ids = config.eos_token_ids
        name = config.name or Path(resolve_model_path(model)).stem
        client = connect(url if isinstance(url, RedisTarget) else RedisTarget(url=url))
        kwargs.setdefault("max_model_len", config.max_position_embeddings)
        return cls(client, tokenizer, name, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        with contextlib.suppress(Exception):
            await self.refresh()
        self._monitor = asyncio.create_task(self._watch(), name="remote-engine-monitor")

    async def stop(self) -> None:
        self._stopping = True
        self._started = False
        for task in [self._monitor, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._monitor, *self._tasks] if t is not None], return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.r.aclose()

    @property
    def is_running(self) -> bool:
        return self._started and any(not w.draining for w in self.workers.values())

    async def _watch(self) -> None:
        while not self._stopping:
            raise_if_cancelled()
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
                await self._bound_slow_readers()
            except Exception as exc:  # noqa: BLE001 - Redis away: keep the last view, try again
                log.warning("could not read the workers' beats: %r", exc)

    async def refresh(self) -> None:
        """Read every worker's beat; bury the workers whose beat lapsed."""
        k = self.keys
        ids: list[str] = await self.r.zrange(k.workers, 0, -1)
        pipe = self.r.pipeline(transaction=False)
        pipe.mget([k.beat(i) for i in ids] or [k.beat("")])
        pipe.hgetall(k.pins)
        if time.monotonic() - self._kv_asked < SNAPSHOT_WINDOW_S:
            pipe.mget([k.kv(i) for i in ids] or [k.kv("")])
        results = await pipe.execute()
        beats, pins = results[0], results[1]
        live: dict[str, Beat] = {}
        for wid, raw in zip(ids, beats, strict=False):
            if raw is None:
                await self._bury(wid)
                continue
            try:
                live[wid] = Beat.from_json(raw)
            except ProtocolError as exc:
                log.error("ignoring worker %s: its beat is malformed (%s)", wid, exc)
        self.workers = live
        self._pins = {}
        for key, raw in pins.items():
            try:
                self._pins[key] = list(read_pin(raw).prompt_token_ids)
            except ProtocolError as exc:
                log.error("ignoring pin %s: %s", key, exc)
        if len(results) > 2:
            kv: dict[str, KVSnapshot] = {}
            for wid, raw in zip(ids, results[2], strict=False):
                if raw:
                    with contextlib.suppress(ProtocolError, ValueError):
                        kv[wid] = KVSnapshot.from_json(json.loads(raw))
            self._kv = kv
        if live:
            self.max_model_len = min(b.max_model_len for b in live.values())
            self.model_name = next(iter(live.values())).model_name
        self._pinning = {wid: keys for wid, keys in self._pinning.items() if wid in live}

    async def _bury(self, wid: str) -> None:
        log.warning("engine worker %s stopped beating: removing it", wid)
        k = self.keys
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(k.workers, wid)
        pipe.delete(k.requests(wid), k.control(wid), k.kv(wid))
        await pipe.execute()

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        sampling_params: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        *,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        if not self._started:
            raise EngineDeadError("the gateway's engine client is not started")
        # The workers hold the other limits (max_num_seqs, the vocabulary) and refuse a request past them.
        limits = RequestLimits(sys.maxsize, MAX_TOKEN_ID + 1, self.max_model_len)
        group = make_request(limits, self.tokenizer.encode, request_id, sampling_params, prompt,
                             prompt_token_ids)
        # Held to the bounds the worker decodes it with (ProtocolError: a ValueError, the caller's 400), so a
        # request the worker would refuse as malformed is refused here, before it is sent.
        parse(AddRequest, encode_command(AddRequest(request_id, sampling_params, group.prompt_token_ids)))
        return self._stream(request_id, sampling_params, group.prompt_token_ids, session_id)

    async def _stream(self, request_id: str, params: SamplingParams, prompt_ids: list[int],
                      session_id: str | None) -> AsyncGenerator[RequestDelta, None]:
        pin = self._pin_of(prompt_ids)
        streamed: list[int] = []  # token ids already passed on (n == 1)
        where: tuple[str, str] | None = None  # (worker, dispatch) of the live dispatch
        finished = False
        failover = False
        detok: IncrementalDetokenizer | None = None  # after a failover: the text as one worker would have made it
        refused: set[str] = set()  # workers whose queue was full for this request
        stalled: set[str] = set()  # workers that let a dispatch of it pass its progress deadline
        try:
            while True:
                worker = await self._place(session_id, pin, failover, refused | stalled)
                base = len(streamed)
                answered = False
                where = (worker.worker, secrets.token_hex(8))
                reader = self._readers[request_id] = _Reader(worker.worker, where[1], base,
                                                             1 + (params.logprobs or 0), read=base)
                msg = Generate(AddRequest(request_id, self._rest(params, base), prompt_ids + streamed), where[1], pin)
                await self._send(worker, msg, session_id, base, len(prompt_ids))
                try:
                    async for delta in self._read(*where, base, len(prompt_ids)):
                        cut = detok is not None and self._retext(detok, delta)
                        if params.n == 1:
                            streamed.extend(delta.token_ids)
                        answered = True
                        yield delta
                        reader.read, reader.pulled = delta.completion_tokens, time.monotonic()
                        if reader.overflowed:
                            raise StreamOverflowError(
                                f"request {request_id}: the reader fell more than "
                                f"{self.stream_limits.max_buffered} entries behind; aborted")
                        if delta.request_finished:
                            finished = not cut  # a stream cut here still runs on its worker
                            return
                    raise WorkerLost("the output stream ended without the request's end")
                except QueueFullError:
                    if answered:
                        raise
                    # Refused before it started: another worker may have room; 429 once every one is full.
                    self._pending[worker.worker] -= 1
                    await self._end(request_id, where, aborted=False)
                    where = None
                    refused.add(worker.worker)
                    if all(w in refused for w, beat in self.workers.items() if not beat.draining):
                        raise
                    log.info("worker %s refused request %s (queue full); trying another", worker.worker, request_id)
                except WorkerLost as exc:
                    self._pending[worker.worker] -= 1
                    # A dead worker has nothing to abort; a stalled one may still run it (and hold its blocks).
                    await self._end(request_id, where, aborted=isinstance(exc, WorkerStalled))
                    where = None
                    if isinstance(exc, WorkerStalled):
                        stalled.add(worker.worker)
                        if all(w in stalled for w, beat in self.workers.items() if not beat.draining):
                            raise EngineDeadError(f"request {request_id}: {exc}, and no other engine worker "
                                                  "is live") from None
                    if params.n != 1:
                        raise EngineDeadError(f"engine worker {worker.worker} was lost: {exc}") from None
                    self.failovers += 1
                    log.warning("request %s lost its worker %s (%s) after %d tokens; dispatching it again",
                                request_id, worker.worker, exc, len(streamed))
                    failover = True
                    if detok is None:
                        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params,
                                                       eos_token_ids=self.tokenizer.eos_token_ids)
                        detok.step(streamed)  # what was sent so far: the same state the first worker had
        finally:
            self._readers.pop(request_id, None)
            if where is not None:
                self._pending[where[0]] -= 1
                if request_id in self._released:
                    self._released.discard(request_id)
                else:
                    await self._end(request_id, where, aborted=not finished)

    async def _bound_slow_readers(self) -> None:
        """Abort the requests whose caller stopped reading while their worker wrote on: past
        ``stream_limits.max_buffered`` unread entries (as the local engines' ``DeltaQueue``), so a reader
        that never reads holds neither the worker's blocks nor Redis memory for long. Only streams whose
        caller has not pulled for a second are looked at: one XREVRANGE each."""
        now = time.monotonic()
        slow = [(rid, r) for rid, r in self._readers.items() if not r.overflowed and now - r.pulled > 1.0]
        if not slow:
            return
        pipe = self.r.pipeline(transaction=False)
        for _rid, r in slow:
            pipe.xrevrange(self.keys.out(r.dispatch), count=1)
        for (rid, r), last in zip(slow, await pipe.execute(), strict=True):
            try:
                msg = decode(last[0][1]) if last else None
            except ProtocolError:
                continue  # its reader meets the entry and fails the request
            if not isinstance(msg, Deltas) or not msg.deltas:
                continue
            unread = (msg.deltas[-1].completion_tokens + r.base - r.read) * r.per_token
            if unread > self.stream_limits.max_buffered:
                log.warning("request %s: its reader is %d entries behind; aborting it", rid, unread)
                r.overflowed = True
                self.stream_counters.overflowed += 1
                await self._tell(self.r, r.worker, Abort(rid))

    @staticmethod
    def _retext(detok: IncrementalDetokenizer, delta: RequestDelta) -> bool:
        """A failed-over delta's text as the first worker's detokenizer would have made it: the new worker
        decodes only its own tokens, so it would drop a character split over the failover point and miss a
        stop string that straddles it. True: the stream ends here (such a stop string), not on the worker."""
        step = detok.step(delta.token_ids)
        delta.text = step.text_delta
        if step.stop_str is not None:
            cut = not delta.finished
            delta.finished = delta.request_finished = True
            delta.finish_reason, delta.stop_reason = "stop", step.stop_str
            return cut
        if delta.finished and not step.stopped:
            delta.text += detok.flush()
        return False

    @staticmethod
    def _rest(params: SamplingParams, done: int) -> SamplingParams:
        """The parameters of what is left after ``done`` tokens were streamed."""
        if not done:
            return params
        max_tokens = None if params.max_tokens is None else max(1, params.max_tokens - done)
        # A seeded row draws one number per token: the new worker's generator skips the ``done`` drawn before;
        # a grammar starts past the ``done`` tokens, which are the end of the new prompt.
        carried = params.seed is not None or params.grammar is not None
        offset = params.seed_offset + done if carried else params.seed_offset
        return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - done),
                                   seed_offset=offset)

    def _pin_of(self, prompt_ids: list[int]) -> str | None:
        """The longest pinned prefix the prompt starts with (a persona's system prompt)."""
        return max((key for key, ids in self._pins.items() if prompt_ids[: len(ids)] == ids),
                   key=lambda key: len(self._pins[key]), default=None)

    async def _place(self, session_id: str | None, pin: str | None, failover: bool,
                     refused: set[str] | frozenset[str] = frozenset()) -> Beat:
        session_home = None
        if session_id is not None and not failover:
            session_home = await self.r.get(self.keys.session(session_id))
        deadline = time.monotonic() + self.wait_for_worker_s
        while True:
            raise_if_cancelled()
            candidates = [b for b in self.workers.values() if b.worker not in refused]
            worker = self.router.choose(candidates, pending=self._pending, pinning=self._pinning,
                                        session_home=session_home, pin=pin, failover=failover)
            if worker is not None:
                if pin is not None and pin not in worker.pins:
                    self._pinning.setdefault(worker.worker, set()).add(pin)
                self._pending[worker.worker] += 1
                return worker
            if time.monotonic() >= deadline or self._stopping:
                raise EngineDeadError("no engine worker is alive")
            await asyncio.sleep(self.poll_s)

    async def _send(self, worker: Beat, msg: Generate, session_id: str | None, base: int, prompt_len: int) -> None:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        route = {"worker": worker.worker, "dispatch": msg.dispatch, "base": base, "prompt_tokens": prompt_len}
        pipe.set(k.request(msg.add.request_id), json.dumps(route), ex=ROUTE_TTL_S)
        if session_id is not None:
            pipe.set(k.session(session_id), worker.home, ex=self.session_ttl_s)
        pipe.xadd(k.requests(worker.worker), encode(msg))
        await pipe.execute()

    async def _read(self, worker: str, dispatch: str, base: int,
                    prompt_len: int) -> AsyncGenerator[RequestDelta, None]:
        """The dispatch's deltas until its last; WorkerLost when the worker dies or leaves first. Their counts
        are the original request's: ``base`` output tokens streamed before this dispatch (failover), and the
        original prompt's ``prompt_len`` tokens (0: unknown, keep the worker's)."""
        key, last = self.keys.out(dispatch), "0-0"
        block_ms = max(1, int(self.poll_s * 1000))
        beat = self.workers.get(worker)
        # Before the first entry the worker computes the prompt: its measured prefill time is added.
        first_s = prompt_len * beat.stats.prefill_seconds_per_token if beat is not None else 0.0
        progressed = time.monotonic()
        while True:
            raise_if_cancelled()
            if self._stopping:
                raise EngineDeadError("the gateway's engine client was stopped")
            try:
                resp = await self.r.xread({key: last}, count=256, block=block_ms)
            except RedisError:
                if self._stopping:
                    raise EngineDeadError("the gateway's engine client was stopped") from None
                raise
            if resp:
                progressed, first_s = time.monotonic(), 0.0
            elif worker not in self.workers:
                raise WorkerLost(f"worker {worker} stopped beating")
            elif time.monotonic() - progressed > self.progress_timeout_s + first_s:
                raise WorkerStalled(f"worker {worker} sent nothing for {time.monotonic() - progressed:.0f}s "
                                    f"(progress deadline {self.progress_timeout_s + first_s:.0f}s)")
            for entry_id, fields in entries(resp):
                last = entry_id
                try:
                    msg = decode(fields)
                except ProtocolError as exc:
                    await self._dead_letter(key, entry_id, fields, str(exc))
                    raise TransportError(f"worker {worker} sent an entry this gateway cannot decode: {exc}") from None
                if isinstance(msg, RequestError):
                    if msg.kind == "WorkerGone":
                        raise WorkerLost(msg.message)
                    raise msg.exception()
                if isinstance(msg, Deltas):
                    if msg.sent:
                        self.hop_seconds += max(0.0, time.time() - msg.sent)
                        self.hop_entries += 1
                    for delta in msg.deltas:
                        delta.completion_tokens += base
                        if prompt_len:
                            delta.prompt_tokens = prompt_len
                            delta.cached_tokens = min(delta.cached_tokens, prompt_len)
                        yield delta

    async def _end(self, request_id: str, where: tuple[str, str], aborted: bool) -> None:
        """Forget a dispatch; one that did not finish is aborted on its worker (frees its blocks)."""
        k = self.keys
        try:
            pipe = self.r.pipeline(transaction=False)
            if aborted:
                self._tell(pipe, where[0], Abort(request_id))
            pipe.delete(k.request(request_id), k.out(where[1]))
            await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the stream is over either way; its keys expire
            log.warning("could not clean up request %s: %r", request_id, exc)

    async def adopt(self, request_id: str, after_tokens: int) -> AsyncGenerator[RequestDelta, None] | None:
        """Take over the stream of a request another gateway dispatched and stopped reading (it died): its
        deltas after the first ``after_tokens`` output tokens, read from the dispatch's output stream, which
        the worker writes whether anyone reads it or not. None when no dispatch of it is recorded."""
        if not self._started:
            raise EngineDeadError("the gateway's engine client is not started")
        raw = await self.r.get(self.keys.request(request_id))
        if raw is None:
            return None
        route = json.loads(raw)
        return self._adopted(request_id, route["worker"], route["dispatch"], int(route.get("base", 0)),
                             int(route.get("prompt_tokens", 0)), after_tokens)

    async def _adopted(self, request_id: str, worker: str, dispatch: str, base: int, prompt_len: int,
                       after: int) -> AsyncGenerator[RequestDelta, None]:
        where = (worker, dispatch)
        finished = False
        self._pending[worker] += 1
        try:
            async for delta in self._read(worker, dispatch, base, prompt_len):
                if delta.completion_tokens <= after:
                    if not delta.request_finished:
                        continue  # passed on by the gateway that died
                    # Its tokens went out already; what is left to say is how the request ended.
                    delta.text, delta.token_ids, delta.logprobs = "", [], None
                yield delta
                if delta.request_finished:
                    finished = True
                    return
            raise WorkerLost("the output stream ended without the request's end")
        except WorkerLost as exc:
            finished = not isinstance(exc, WorkerStalled)  # a dead worker has nothing to abort
            raise EngineDeadError(f"engine worker {worker} of an adopted request was lost: {exc}") from None
        finally:
            self._pending[worker] -= 1
            if request_id in self._released:
                self._released.discard(request_id)
            else:
                await self._end(request_id, where, aborted=not finished)

    def release(self, request_id: str) -> None:
        """Stop reading ``request_id`` without aborting it or deleting its keys: another gateway took its turn
        over (this one lost the session lock) and relays it now."""
        self._released.add(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it runs (this gateway's or another's)."""
        raw = await self.r.get(self.keys.request(request_id))
        if raw is not None:
            await self._tell(self.r, json.loads(raw)["worker"], Abort(request_id))

    # -- prefixes ---------------------------------------------------------------------------------
    async def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Register a prefix; each worker pins it when it first serves a request that starts with it.

        Returns the tokens a worker pins: the prefix's full blocks."""
        ids = [int(t) for t in prompt_token_ids]
        unpinning = self._unpinning.get(key)
        if unpinning is not None:  # a re-pin (a persona changed) must land after the unpin before it
            await asyncio.gather(unpinning, return_exceptions=True)
        await self.r.hset(self.keys.pins, key, pin_value(key, ids, cache_salt))
        self._pins[key] = ids
        return len(ids) // self._block_size() * self._block_size()

    def unpin_prefix(self, key: str) -> None:
        self._pins.pop(key, None)
        for pinning in self._pinning.values():
            pinning.discard(key)
        task = self._tell_workers(Unpin(key), lambda pipe: pipe.hdel(self.keys.pins, key))
        self._unpinning[key] = task
        task.add_done_callback(lambda t: self._unpinning.pop(key, None) if self._unpinning.get(key) is t else None)

    def _block_size(self) -> int:
        return next((b.block_size for b in self.workers.values()), KVSnapshot().block_size)

    # -- numbers ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The workers' counters summed, plus each worker's own (``workers``) and the routing decisions."""
        beats = list(self.workers.values())
        summed = {name: sum(getattr(b.stats, name) for b in beats) for name in _SUMMED}
        return EngineStats(
            **summed, engine_state="running" if self.is_running else "no workers",
            last_step_age_s=max((b.stats.last_step_age_s for b in beats), default=0.0),
            runtime=next((b.stats.runtime for b in beats if b.stats.runtime), None),
            workers={b.worker: b.stats.worker_view(tuple(b.pins), b.draining) for b in beats},
            route_decisions=dict(self.router.decisions), failovers=self.failovers,
            hop_seconds=self.hop_seconds, hop_entries=self.hop_entries,
            stream_deltas_coalesced=self.stream_counters.coalesced,
            streams_overflowed=self.stream_counters.overflowed)

    def kv_snapshot(self) -> KVSnapshot:
        """The workers' block pools side by side: block ids are offset by each pool's start (``pools``)."""
        now = time.monotonic()
        if self._started and now - self._kv_asked > SNAPSHOT_WINDOW_S / 2:
            self._kv_asked = now
            self._tell_workers(WantSnapshot())
        merged = KVSnapshot(block_size=self._block_size())
        offset = cpu_used = 0
        for wid in sorted(self._kv):
            snap = self._kv[wid]
            merged.pools.append(PoolView(wid, offset, snap.num_blocks))
            merged.state.extend(snap.state)
            merged.refcounts.extend(snap.refcounts)
            for rid, blocks in snap.requests.items():
                merged.requests[rid] = [offset + b for b in blocks]
            for key, blocks in snap.pins.items():
                merged.pins.setdefault(key, []).extend(offset + b for b in blocks)
            offset += snap.num_blocks
            cpu_used += snap.cpu_used
        return dataclasses.replace(merged, num_blocks=offset, cpu_used=cpu_used)

    def warm_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> None:
        """Sent to the worker the session's last turn ran on (``key`` is the session id), which the router
        prefers for its next turn; a session with no live worker on record has nothing to warm."""
        async def send() -> None:
            worker = await self.r.get(self.keys.session(key))
            if worker is not None:
                worker = worker.decode() if isinstance(worker, bytes) else str(worker)
            if worker in self.workers:
                await self._tell(self.r, worker, Warm(key, list(prompt_token_ids), cache_salt, shared_prefix_tokens))

        self._spawn(send())

    def _tell_workers(self, msg: Unpin | WantSnapshot, first: Callable[[Any], object] = lambda pipe: None,
                      ) -> asyncio.Task[Any]:
        """Send ``msg`` to every live worker's control stream, in one pipeline after ``first(pipe)``."""
        workers = list(self.workers)

        async def send() -> None:
            pipe = self.r.pipeline(transaction=False)
            first(pipe)
            for wid in workers:
                self._tell(pipe, wid, msg)
            await pipe.execute()

        return self._spawn(send())

    def _tell(self, target: Any, worker: str, msg: Abort | Unpin | Warm | WantSnapshot) -> Any:
        """Append ``msg`` to ``worker``'s control stream (on ``target``: the connection or a pipeline). The
        stream is trimmed to about ``control_maxlen`` entries: a worker acts on each as it reads it, so only
        entries long read (or a dead worker's) are dropped, and the stream never grows without bound."""
        return target.xadd(self.keys.control(worker), encode(msg), maxlen=self.control_maxlen, approximate=True)

    async def _dead_letter(self, stream: str, entry_id: str, fields: object, reason: str) -> None:
        log.error("undecodable entry %s on %s: %s", entry_id, stream, reason)
        try:
            await self.r.xadd(self.keys.dead_letter, dead_letter(stream, entry_id, fields, reason),
                              maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        except RedisError as exc:
            log.warning("could not dead-letter entry %s of %s: %r", entry_id, stream, exc)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
