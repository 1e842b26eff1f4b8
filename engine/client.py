"""``EngineClient``: what the gateway needs of an engine, whichever way the engine runs.

Two implementations: ``engine.async_engine.AsyncEngine`` (the step loop on a thread of the
gateway's process) and ``engine.engine_process.ProcessEngine`` (the step loop in a child process).
This module imports neither torch nor the tokenizer, so gateway modules can name the type cheaply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.engine import RequestDelta
    from engine.tokenizer import Tokenizer

__all__ = ["EngineClient", "EngineDeadError"]


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
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request; its deltas stream from the returned iterator.

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
