"""``CoreClient``: the client half of a transport that reaches one ``EngineCore`` (a thread or a child process).

It holds everything the gateway side of such a transport does, once: validating a request against the
core's limits before it is queued, the waiting-queue check (counting the adds still in flight), one bounded
``DeltaQueue`` per open request, calls with replies (abort, pin), pinning by generating the prefix first,
routing each ``StepOutput`` to its streams and calls, failing every open stream when the core dies, and
the stats the gateway reads. A transport subclass adds only its channel (``_send``), its lifecycle and its
state. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from engine.client import DeltaQueue, EngineClient, StreamCounters, StreamLimits, relay_deltas
from engine.protocol import (
    SNAPSHOT_WINDOW_S,
    Abort,
    AddRequest,
    Command,
    EngineDeadError,
    EngineInfo,
    EngineStats,
    KVSnapshot,
    Pin,
    QueueFullError,
    RequestDelta,
    StepOutput,
    Unpin,
    WantSnapshot,
    Warm,
)
from engine.request import RequestLimits, SamplingParams, make_request

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

__all__ = ["CoreClient"]


class CoreClient(EngineClient):
    """Subclasses call ``_install`` with the core's ``EngineInfo``, route its outputs to ``_on_output`` on the
    event loop, call ``_fail_open`` when the core is gone, implement ``_send`` and keep ``_state``."""

    def __init__(self, tokenizer: Tokenizer, info: EngineInfo, stream_limits: StreamLimits | None) -> None:
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.stream_limits = stream_limits or StreamLimits()
        self.stream_counters = StreamCounters()
        self.restarts = 0
        self._streams: dict[str, DeltaQueue] = {}
        self._calls: dict[str, asyncio.Future[int | None]] = {}
        self._call_ids = itertools.count()
        self._pin_ids = itertools.count()
        self._pins: dict[str, tuple[list[int], str | None]] = {}  # replayed into a replacement core
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "loaded"  # -> running (<-> restarting: a process engine), -> failed, -> stopped
        self._install(info)

    def _install(self, info: EngineInfo) -> None:
        self.info = info
        self._limits = RequestLimits(info.max_num_seqs, info.vocab_size, info.max_model_len)
        self._stats = info.stats
        self._snapshot = info.snapshot
        self._snapshot_asked = 0.0
        self._heartbeat = time.monotonic()
        self._adds_sent = 0
        self._adds_seen = 0

    # -- what a transport provides ----------------------------------------------------------------
    def _send(self, cmd: Command) -> None:
        """Put a command on the channel; EngineDeadError when the channel is gone."""
        raise NotImplementedError

    @property
    def state(self) -> str:
        """loaded (not started yet), running, restarting, failed or stopped."""
        return self._state

    @property
    def is_running(self) -> bool:
        return self.state == "running"

    # -- outputs, on the event loop ---------------------------------------------------------------
    def _on_output(self, out: StepOutput) -> None:
        if out.stats is not None:
            self._stats = out.stats
        if out.snapshot is not None:
            self._snapshot = out.snapshot
        self._heartbeat = out.heartbeat
        self._adds_seen = out.adds_seen
        for delta in out.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
        for error in out.errors:
            stream = self._streams.get(error.request_id)
            if stream is not None:
                stream.put_nowait(error.exception())
        for reply in out.replies:
            fut = self._calls.pop(reply.call_id, None)
            if fut is None or fut.done():
                continue
            if reply.error is not None:
                fut.set_exception(reply.error.exception())
            else:
                fut.set_result(reply.result)

    def _fail_open(self, exc: EngineDeadError) -> None:
        """The core is gone: every open stream and pending call raises ``exc``."""
        for stream in self._streams.values():
            stream.put_nowait(exc)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()

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
        """As ``EngineClient.generate``; ``aclose()`` on the stream aborts the request."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running ({self.state})")
        return self._generate(request_id, sampling_params, prompt, prompt_token_ids)

    def _generate(self, request_id: str, sampling_params: SamplingParams, prompt: str | None,
                  prompt_token_ids: list[int] | None) -> AsyncGenerator[RequestDelta, None]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = make_request(self._limits, self.tokenizer.encode, request_id, sampling_params, prompt,
                             prompt_token_ids)
        # Adds the core has not taken in yet are not in its stats' waiting count.
        waiting = self._stats.requests_waiting + self._adds_sent - self._adds_seen
        if waiting >= self.info.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.info.max_waiting} requests)")
        stream = DeltaQueue(self.stream_limits, self.stream_counters, lambda: self._abort_quietly(request_id))
        self._send(AddRequest(request_id, sampling_params, group.prompt_token_ids, prompt, group.arrival_time))
        self._adds_sent += 1
        self._streams[request_id] = stream

        def on_exit(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

        return relay_deltas(stream, on_exit)

    def _abort_quietly(self, request_id: str) -> None:
        if self.is_running:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort(request_id))

    async def _call(self, make: Callable[[str], Command], internal: bool = False) -> int | None:
        """Send a command and await its reply; ``internal`` calls also run while pins are replayed."""
        if self._loop is None or not (self.is_running or (internal and self.state == "restarting")):
            raise EngineDeadError(f"engine is not running ({self.state})")
        call_id = str(next(self._call_ids))
        fut: asyncio.Future[int | None] = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(make(call_id))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        return await fut

    async def abort(self, request_id: str) -> None:
        await self._call(lambda call_id: Abort(request_id, call_id))

    # -- prefixes ---------------------------------------------------------------------------------
    async def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Compute a prefix (a persona's system prompt) and pin its full blocks; returns tokens pinned."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running ({self.state})")
        ids = list(prompt_token_ids)
        pinned = await self._pin(key, ids, cache_salt)
        self._pins[key] = (ids, cache_salt)
        return pinned

    async def _pin(self, key: str, ids: list[int], cache_salt: str | None) -> int:
        if len(ids) >= self.info.block_size:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, cache_salt=cache_salt)
            async for _ in self._generate(f"pin-{next(self._pin_ids)}-{key}", params, None, ids):
                pass
        return int(await self._call(lambda call_id: Pin(key, ids, call_id, cache_salt), internal=True) or 0)

    def unpin_prefix(self, key: str) -> None:
        self._pins.pop(key, None)
        if self.is_running:
            with contextlib.suppress(EngineDeadError):  # a dead engine holds no pins
                self._send(Unpin(key))

    def warm_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> None:
        if self.is_running:
            with contextlib.suppress(EngineDeadError):  # a hint: a dead engine has nothing to warm
                self._send(Warm(key, list(prompt_token_ids), cache_salt, shared_prefix_tokens))

    # -- numbers ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The core's latest counters, with this client's view: state, restarts, the age of the core's last
        output (its heartbeat: it only grows while the core is idle, stuck or dead), stream counters."""
        return dataclasses.replace(
            self._stats, runtime=self.info.runtime, engine_state=self.state, engine_restarts=self.restarts,
            last_step_age_s=time.monotonic() - self._heartbeat, max_waiting=self.info.max_waiting,
            stream_deltas_coalesced=self.stream_counters.coalesced,
            streams_overflowed=self.stream_counters.overflowed)

    def kv_snapshot(self) -> KVSnapshot:
        """The latest block-pool picture; asking keeps the core attaching fresh ones for a while."""
        now = time.monotonic()
        if self.is_running and now - self._snapshot_asked > SNAPSHOT_WINDOW_S / 2:
            self._snapshot_asked = now
            with contextlib.suppress(EngineDeadError):  # the last picture is still the best answer
                self._send(WantSnapshot())
        return self._snapshot
