"""``EngineClient``: what the gateway needs of an engine, whichever way the engine runs.

Two implementations: ``engine.async_engine.AsyncEngine`` (the step loop on a thread of the
gateway's process) and ``engine.engine_process.ProcessEngine`` (the step loop in a child process).
This module imports neither torch nor the tokenizer, so gateway modules can name the type cheaply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.engine import RequestDelta
    from engine.tokenizer import Tokenizer

__all__ = ["EngineClient", "EngineDeadError", "relay_deltas"]


class EngineDeadError(RuntimeError):
    """The engine is not running (never started, stopped, or its thread/process died)."""


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

    async def pin_prefix(self, key: str, prompt_token_ids: list[int]) -> int:
        """Compute a prefix and pin its full blocks in the prefix cache; returns the tokens pinned."""
        ...

    def unpin_prefix(self, key: str) -> None: ...

    def stats(self) -> dict[str, Any]:
        """The engine's latest counters (scheduler and block pool); never blocks."""
        ...

    def kv_snapshot(self) -> dict[str, Any]:
        """The latest block-pool picture; asking keeps the engine refreshing it for a while."""
        ...


async def relay_deltas(
    stream: asyncio.Queue[RequestDelta | BaseException], on_exit: Callable[[bool], None]
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
