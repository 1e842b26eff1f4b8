"""``EngineClient``: what the gateway needs of an engine, whichever way the engine runs, and the bounded
per-request queue its deltas wait in for their reader.

Implementations: ``engine.local_client.CoreClient`` subclasses (``AsyncEngine``: the core on a thread;
``ProcessEngine``: the core in a child process) and ``chatsvc.remote_engine.RemoteEngine`` (workers behind
Redis). This module imports neither torch nor the tokenizer, so gateway modules can name the type cheaply.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.protocol import (
    EngineStats,
    KVSnapshot,
    RequestDelta,
    StreamOverflowError,
)
from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

__all__ = ["Adoptable", "DeltaQueue", "EngineClient", "StreamCounters", "StreamLimits",
           "relay_deltas"]


@dataclass(frozen=True)
class StreamLimits:
    """How much of a request's output may wait for a reader that is slower than the engine.

    Past ``coalesce_after`` queued deltas, a new delta is merged into the last queued one of its sample
    (text appended, token ids and logprobs extended): nothing is lost, and the queue stops growing in
    items. What merging cannot bound is the output itself; past ``max_buffered`` unread entries (a token
    counts one, each logprob alternative one more) the request is aborted and its reader gets
    ``StreamOverflowError``. The default is the non-streamed logprobs cap of the gateway, so a reader has
    the same room as a non-streamed reply, and a reply without logprobs of any length fits.
    """

    coalesce_after: int = 32
    max_buffered: int = 200_000


@dataclass
class StreamCounters:
    """Per engine: deltas merged into an earlier one, and requests aborted for an overflowing reader."""

    coalesced: int = 0
    overflowed: int = 0


class _Slot:
    """A queued delta and the later ones of its sample merged into it. They are kept as a list and joined once,
    when the reader takes the slot: merging by copying would cost a slow reader's gateway time quadratic in its
    unread output (a reader that stops reading for 200,000 tokens: ~10^10 element copies on the event loop)."""

    __slots__ = ("item", "more")

    def __init__(self, item: RequestDelta | BaseException) -> None:
        self.item = item
        self.more: list[RequestDelta] = []

    def take(self) -> RequestDelta | BaseException:
        if not self.more or isinstance(self.item, BaseException):
            return self.item
        return _merge([self.item, *self.more])


def _entries(delta: RequestDelta) -> int:
    return len(delta.token_ids) + sum(len(d) for d in delta.logprobs or ())


def _merge(parts: list[RequestDelta]) -> RequestDelta:
    """One sample's deltas as one, in order: the cumulative fields (counts, finish) are the last one's."""
    logprobs = (None if all(d.logprobs is None for d in parts)
                else [lp for d in parts for lp in d.logprobs or ()])
    return dataclasses.replace(parts[-1], text="".join(d.text for d in parts),
                               token_ids=[t for d in parts for t in d.token_ids], logprobs=logprobs)


class DeltaQueue:
    """One request's deltas on their way from the engine to its reader, bounded as ``StreamLimits`` says.

    Filled with ``put_nowait`` and drained with ``get`` on the event loop (as an ``asyncio.Queue`` is); an
    exception put in it is handed to the reader after what is already queued. ``on_overflow`` is called
    once when the output passes ``max_buffered``: the engine aborts the request there, so its blocks are
    freed at once, not when the slow reader finally reads the error.
    """

    def __init__(self, limits: StreamLimits, counters: StreamCounters, on_overflow: Callable[[], None]) -> None:
        self.limits = limits
        self.counters = counters
        self.on_overflow = on_overflow
        self._slots: collections.deque[_Slot] = collections.deque()
        self._open: dict[int, _Slot] = {}  # sample index -> its last queued delta, while mergeable
        self._buffered = 0  # entries queued and not read
        self._closed = False  # overflowed: everything after is dropped
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def put_nowait(self, item: RequestDelta | BaseException) -> None:
        if self._closed:
            return
        if isinstance(item, BaseException):
            self._open.clear()  # nothing after it may be merged ahead of it
            self._append(_Slot(item))
            return
        self._buffered += _entries(item)
        if self._buffered > self.limits.max_buffered:
            self._overflow()
            return
        open_slot = self._open.get(item.index)
        # A request's last delta is never merged back: the reader stops at it, and an earlier slot would
        # put it ahead of other samples' queued deltas.
        if open_slot is not None and len(self._slots) >= self.limits.coalesce_after and not item.request_finished:
            open_slot.more.append(item)
            self.counters.coalesced += 1
        else:
            slot = _Slot(item)
            self._append(slot)
            self._open[item.index] = slot
        if item.finished or item.request_finished:
            self._open.pop(item.index, None)

    def _append(self, slot: _Slot) -> None:
        self._slots.append(slot)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _overflow(self) -> None:
        self._closed = True
        self._slots.clear()
        self._open.clear()
        self._buffered = 0
        self.counters.overflowed += 1
        self._append(_Slot(StreamOverflowError(
            f"the reader fell more than {self.limits.max_buffered} tokens and logprobs behind the engine; "
            "the request was aborted (read the stream faster, or ask for fewer logprobs)")))
        self.on_overflow()

    async def get(self) -> RequestDelta | BaseException:
        while not self._slots:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        slot = self._slots.popleft()
        item = slot.take()
        if not isinstance(item, BaseException):
            self._buffered -= _entries(item)
            if self._open.get(item.index) is slot:
                del self._open[item.index]
        return item


class EngineClient(Protocol):
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int

    async def start(self) -> None:
        """Begin serving; called once from the event loop that will consume the streams."""
        ...

    async def stop(self) -> None:
        """End every open stream and shut the engine down."""
        ...

    @property
    def is_running(self) -> bool: ...

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

        ``session_id``: the chat session the request is a turn of, if any; an engine spread over several
        workers routes a session's turns to the worker that holds its cached blocks (others ignore it).

        Raises ValueError (bad request), QueueFullError or EngineDeadError here, before anything is
        queued. Closing the iterator early aborts the request and frees its blocks.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort" and its blocks are freed."""
        ...

    async def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Compute a prefix and pin its full blocks in the prefix cache; returns the tokens pinned. With
        ``cache_salt`` the prefix is computed and pinned under that salt (a tenant's own persona), and only
        requests with the same salt hit it."""
        ...

    def unpin_prefix(self, key: str) -> None: ...

    def warm_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> None:
        """Ask the engine to bring a conversation's history (the prompt its next message extends) up its KV
        tiers ahead of that message; ``key`` names the session, ``cache_salt`` and ``shared_prefix_tokens``
        are its requests' (``SamplingParams``). Best effort: nothing waits or fails on it."""
        ...

    def stats(self) -> EngineStats:
        """The engine's latest counters (scheduler and block pool); never blocks."""
        ...

    def kv_snapshot(self) -> KVSnapshot:
        """The latest block-pool picture; asking keeps the engine refreshing it for a while."""
        ...


@runtime_checkable
class Adoptable(Protocol):
    """An engine whose requests outlive the gateway that sent them (workers behind Redis): another gateway can
    take over the stream of a request whose gateway died."""

    async def adopt(self, request_id: str, after_tokens: int) -> AsyncIterator[RequestDelta] | None:
        """The request's deltas after its first ``after_tokens`` output tokens (those the dead gateway passed
        on), to its end; closing the iterator early aborts it. None when the request is unknown (never
        dispatched, or long over)."""
        ...

    def release(self, request_id: str) -> None:
        """This gateway stops reading the request, which another gateway now relays: closing its stream here
        then neither aborts the request nor deletes what that gateway reads."""
        ...


async def relay_deltas(
    stream: DeltaQueue, on_exit: Callable[[bool], None]
) -> AsyncGenerator[RequestDelta, None]:
    """A request's deltas from its queue until the one that finishes it; an exception put in the queue is
    raised. ``on_exit(finished)`` runs however the iteration ends (an engine aborts an unfinished request
    there), so both engines' streams share one definition of "finished"."""
    finished = False
    try:
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            yield item
            if item.request_finished:
                finished = True
                return
    finally:
        on_exit(finished)
