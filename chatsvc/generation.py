"""One engine request as an async stream of deltas, with metrics and guaranteed abort on exit."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

from chatsvc.errors import APIError
from chatsvc.metrics import Metrics, RequestTimer
from engine.client import EngineClient
from engine.protocol import QueueFullError, RequestDelta
from engine.request import SamplingParams


class Generation:
    """Wraps ``engine.generate``: the first delta is fetched eagerly by :meth:`start`, so admission
    errors (invalid request, full queue) surface as HTTP errors before any response is sent."""

    def __init__(self, engine: EngineClient, metrics: Metrics, request_id: str, params: SamplingParams,
                 prompt_token_ids: list[int], retry_after_s: int = 1, session_id: str | None = None) -> None:
        self.engine = engine
        self.session_id = session_id
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.retry_after_s = retry_after_s
        self._it: AsyncIterator[RequestDelta] | None = None
        self._first: RequestDelta | None = None
        self.timer = RequestTimer(metrics)
        self.reason_counts: Counter[str] = Counter()
        self.started = False  # the engine admitted the request
        self._counted = False  # in ``metrics.generations_in_flight``, until closed

    async def start(self) -> None:
        self._count(True)
        try:
            self._it = aiter(self.engine.generate(self.request_id, self.params,
                                                  prompt_token_ids=self.prompt_token_ids, session_id=self.session_id))
            self._first = await anext(self._it)
        except StopAsyncIteration:
            pass  # admitted, and already finished
        except BaseException as exc:  # refused, cancelled or failed: the engine request must not outlive this
            await self.close()
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc), code="invalid_request") from exc
            if isinstance(exc, QueueFullError):
                raise APIError(429, "the server is at capacity; retry shortly", code="queue_full",
                               headers={"Retry-After": str(self.retry_after_s)}) from exc
            raise
        self.started = True

    async def close(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        self._count(False)
        it, self._it = self._it, None
        # EngineClient.generate promises an AsyncIterator; every engine returns an async generator.
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()

    def _count(self, running: bool) -> None:
        if running != self._counted:
            self._counted = running
            step = 1 if running else -1
            self.timer.metrics.generations_in_flight += step
            self.timer.metrics.generations.inc(step)

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """All deltas; leaving the loop early (break, cancellation, error) aborts the request."""
        assert self._it is not None or self._first is not None, "call start() first"
        done = False
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._observe(first)
                yield first
            if self._it is not None:
                async for delta in self._it:
                    self._observe(delta)
                    yield delta
            done = True
        finally:
            await self.close()
            reason = self.reason_counts.most_common(1)[0][0] if self.reason_counts else "stop"
            self.timer.finish(reason if done else "abort")

    def _observe(self, delta: RequestDelta) -> None:
        self.timer.on_tokens(delta.index, len(delta.token_ids))
        if delta.finished:
            self.reason_counts[delta.finish_reason or "stop"] += 1
