"""asyncio facade over ``LLMEngine`` for the gateway.

The engine runs in one worker thread that owns it: requests, aborts and pins reach it as
commands through a thread-safe queue and are applied between steps, so the event loop never
waits for a step (torch releases the GIL while it computes). Each request's deltas flow back
to the event loop through its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from engine.client import (
    DeltaQueue,
    EngineClient,
    EngineDeadError,
    StreamCounters,
    StreamLimits,
    relay_deltas,
)
from engine.config import EngineConfig
from engine.distributed import RankDiedError
from engine.engine import LLMEngine, RequestDelta
from engine.request import SamplingParams, SequenceGroup
from engine.scheduler import QueueFullError

log = logging.getLogger("chatsvc.engine")

__all__ = ["AsyncEngine", "RequestDelta", "QueueFullError", "EngineDeadError"]


class AsyncEngine(EngineClient):
    def __init__(self, llm_engine: LLMEngine, stream_limits: StreamLimits | None = None) -> None:
        self.engine = llm_engine
        self.stream_limits = stream_limits or StreamLimits()
        self.stream_counters = StreamCounters()
        self.tokenizer = llm_engine.tokenizer
        self.model_name = llm_engine.model_name
        self.max_model_len = llm_engine.max_model_len
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any] | None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, DeltaQueue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pin_ids = itertools.count()
        self._pending = 0  # requests submitted but not yet handed to the scheduler
        self._stats: dict[str, Any] = llm_engine.stats()
        self._snapshot: dict[str, Any] = llm_engine.kv_snapshot()
        self._snapshot_wanted = 0.0
        self._heartbeat = time.monotonic()  # the last step, or idle tick, of the engine thread

    @classmethod
    def from_config(cls, config: EngineConfig, *, fault_request_prefix: str | None = None,
                    stream_limits: StreamLimits | None = None) -> AsyncEngine:
        return cls(LLMEngine(config, fault_request_prefix=fault_request_prefix), stream_limits)

    @classmethod
    def from_args(cls, model: str | None = None, *, fault_request_prefix: str | None = None,
                  stream_limits: StreamLimits | None = None, **settings: Any) -> AsyncEngine:
        """Keyword form: the settings are ``EngineConfig``'s fields."""
        return cls.from_config(EngineConfig(model=model, **settings), fault_request_prefix=fault_request_prefix,
                               stream_limits=stream_limits)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._publish(force=False)
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                self._heartbeat = time.monotonic()
                continue
            try:
                deltas = self.engine.step()
            except RankDiedError as exc:  # the model lost a shard: the engine is down, not one batch
                log.error("engine stopped: %s", exc)
                self._fail_running(exc)
                break
            except Exception as exc:  # noqa: BLE001 - one bad batch must not take the server down
                log.exception("engine step failed outside the model run; failing the requests it held")
                self._fail_running(exc)
                continue
            self._heartbeat = time.monotonic()
            self._deliver(deltas)
            for request_id, error in self.engine.take_failures():  # requests a step isolated and failed
                self._send(request_id, error)
            self._publish(force=False)
        # Shutting down: end every open stream.
        for request_id in list(self._streams):
            self._deliver(self.engine.abort_request(request_id))

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            # A caller that stopped waiting cancels its future; resolving it then would raise
            # InvalidStateError here and end the engine thread.
            # The command still runs (an abort must happen whoever waits for it); after
            # set_running_or_notify_cancel() returns True the future can no longer be cancelled.
            live = fut is not None and fut.set_running_or_notify_cancel()
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                if live:
                    fut.set_exception(exc)  # type: ignore[union-attr]
            else:
                if live:
                    fut.set_result(result)  # type: ignore[union-attr]

    def _fail_running(self, exc: Exception) -> None:
        for group in list(self.engine.scheduler.running):
            self.engine.abort_request(group.request_id)
            self._send(group.request_id, RuntimeError(f"engine error: {exc}"))

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            self._send(delta.request_id, delta)

    def _send(self, request_id: str, item: RequestDelta | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _publish(self, force: bool) -> None:
        self._stats = self.engine.stats()
        if force or time.monotonic() - self._snapshot_wanted < 2.0:
            self._snapshot = self.engine.kv_snapshot()

    def _submit(self, fn: Callable[[], Any], want_result: bool = False) -> Future[Any] | None:
        fut: Future[Any] | None = Future() if want_result else None
        self._commands.put((fn, fut))
        self._wakeup.set()
        return fut

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        sampling_params: SamplingParams,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        *,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request; its deltas stream from the returned iterator.

        Raises ValueError (bad request) or QueueFullError here, before anything is queued.
        Closing the iterator early aborts the request and frees its blocks.
        """
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = self.engine.make_request(request_id, sampling_params, prompt, prompt_token_ids)
        waiting = self._stats.get("requests_waiting", 0) + self._pending
        if waiting >= self.engine.scheduler_config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.engine.scheduler_config.max_waiting} requests)")
        stream = DeltaQueue(self.stream_limits, self.stream_counters, lambda: self._abort_soon(request_id))
        self._streams[request_id] = stream
        self._pending += 1
        self._submit(lambda: self._add(group))
        return self._stream(request_id, stream)

    def _add(self, group: SequenceGroup) -> None:
        self._pending -= 1
        try:
            self.engine.add_group(group)
        except Exception as exc:  # noqa: BLE001 - e.g. the queue filled up meanwhile
            self._send(group.request_id, exc)

    def _stream(self, request_id: str, stream: DeltaQueue) -> AsyncIterator[RequestDelta]:
        def on_exit(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_soon(request_id)

        return relay_deltas(stream, on_exit)

    def _abort_soon(self, request_id: str) -> None:
        self._submit(lambda: self._deliver(self.engine.abort_request(request_id)))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort" and its blocks are freed."""
        fut = self._submit(lambda: self._deliver(self.engine.abort_request(request_id)), want_result=True)
        assert fut is not None
        await asyncio.wrap_future(fut)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.is_running:
            raise EngineDeadError("engine is not running")
        fut = self._submit(fn, want_result=True)
        assert fut is not None
        return await asyncio.wrap_future(fut)

    # -- prefixes ---------------------------------------------------------------------------------
    async def pin_prefix(self, key: str, prompt_token_ids: list[int]) -> int:
        """Compute a prefix (a persona's system prompt) and pin its full blocks; returns tokens pinned."""
        ids = list(prompt_token_ids)
        if len(ids) >= self.engine.block_size_tokens_min():
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            async for _ in self.generate(f"pin-{next(self._pin_ids)}-{key}", params, prompt_token_ids=ids):
                pass
        pinned: int = await self._call(lambda: self.engine.pin_prefix(key, ids))
        return pinned

    def unpin_prefix(self, key: str) -> None:
        self._submit(lambda: self.engine.unpin_prefix(key))

    # -- numbers ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        state = "running" if self.is_running else "stopped"
        return {**self._stats, "engine_state": state,
                "last_step_age_s": time.monotonic() - self._heartbeat,
                "max_waiting": self.engine.scheduler_config.max_waiting,
                "stream_deltas_coalesced": self.stream_counters.coalesced,
                "streams_overflowed": self.stream_counters.overflowed}

    def kv_snapshot(self) -> dict[str, Any]:
        """The latest block-pool picture; asking keeps the engine thread refreshing it."""
        if time.monotonic() - self._snapshot_wanted > 2.0:
            # First ask after a quiet spell: have the engine thread take a fresh one now.
            self._submit(lambda: self._publish(force=True))
        self._snapshot_wanted = time.monotonic()
        return self._snapshot
