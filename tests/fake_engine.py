"""A small deterministic engine behind the ``EngineClient`` protocol, for the gateway's unit tests.

It does no model work: every request gets the tokens of :data:`REPLY` (the real tiny tokenizer's
ids), one token per delta per sample, ``step_s`` apart, and stops with "stop" at the end of the
reply or "length" at ``max_tokens`` (``ignore_eos`` repeats the reply up to ``max_tokens``). It
refuses what the real engines refuse with the same exceptions (ValueError, QueueFullError,
EngineDeadError) and records what it was asked, so tests can check what the gateway sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gateway_fixtures import LiveServer
from tiny_model import make_tiny_tokenizer

from engine.client import EngineClient
from engine.protocol import EngineDeadError, EngineStats, KVSnapshot, QueueFullError, RequestDelta
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer

REPLY = "Hello! How are you today?"


def tiny_tokenizer(directory: Path) -> Tokenizer:
    make_tiny_tokenizer(directory)
    return Tokenizer.from_dir(directory)


@dataclass
class Submitted:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    max_tokens: int
    finish_reasons: dict[int, str] = field(default_factory=dict)  # per sample, once it finished


class FakeEngine(EngineClient):
    def __init__(self, tokenizer: Tokenizer, max_model_len: int = 512, block_size: int = 16,
                 step_s: float = 0.0, max_running: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.step_s = step_s
        self.max_running = max_running
        self.reply_ids = tokenizer.encode(REPLY)
        self.submitted: dict[str, Submitted] = {}
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.pins: dict[str, list[int]] = {}
        self.warms: list[tuple[str, list[int]]] = []
        self._running = False

    def reset(self) -> None:
        """Back to the defaults a test may have changed (pace and capacity)."""
        self.step_s, self.max_running = 0.0, None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    # -- requests ----------------------------------------------------------------------------------
    def generate(self, request_id: str, sampling_params: SamplingParams, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None, *,
                 session_id: str | None = None) -> AsyncIterator[RequestDelta]:
        if not self._running:
            raise EngineDeadError("the fake engine is not running")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(prompt or "")
        if not ids:
            raise ValueError("the prompt is empty")
        room = self.max_model_len - len(ids)
        max_tokens = room if sampling_params.max_tokens is None else sampling_params.max_tokens
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens exceeds {self.max_model_len}")
        if self.max_running is not None and len(self.running) >= self.max_running:
            raise QueueFullError("the fake engine is full")
        sub = Submitted(request_id, sampling_params, ids, max_tokens)
        self.submitted[request_id] = sub
        self.running.add(request_id)
        return self._stream(sub)

    def completion_ids(self, ignore_eos: bool, max_tokens: int) -> list[int]:
        """The tokens every sample of a request gets."""
        if ignore_eos:
            return (self.reply_ids * (max_tokens // len(self.reply_ids) + 1))[:max_tokens]
        return self.reply_ids[:max_tokens]

    def finish_reason(self, ignore_eos: bool, max_tokens: int) -> str:
        return "length" if ignore_eos or max_tokens < len(self.reply_ids) else "stop"

    async def _stream(self, sub: Submitted) -> AsyncIterator[RequestDelta]:
        params = sub.params
        out = self.completion_ids(params.ignore_eos, sub.max_tokens)
        reason = self.finish_reason(params.ignore_eos, sub.max_tokens)
        try:
            for step, tid in enumerate(out):
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                last = step == len(out) - 1
                for index in range(params.n):
                    if last:
                        sub.finish_reasons[index] = reason
                    yield RequestDelta(
                        request_id=sub.request_id, index=index, text=self.tokenizer.decode([tid]), token_ids=[tid],
                        finished=last, finish_reason=reason if last else None,
                        logprobs=None if params.logprobs is None else [self._logprobs(tid, params.logprobs)],
                        prompt_tokens=len(sub.prompt_token_ids), completion_tokens=step + 1, cached_tokens=0,
                        request_finished=last and index == params.n - 1)
        finally:
            self.running.discard(sub.request_id)
            if len(sub.finish_reasons) < params.n:
                self.aborted.append(sub.request_id)

    @staticmethod
    def _logprobs(tid: int, top: int) -> dict[int, float]:
        """The sampled token at -0.5, then ``top`` other tokens at -1, -2, ..."""
        return {tid: -0.5, **{tid + k: -float(k) for k in range(1, top + 1)}}

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        if self.max_running is not None and len(self.running) >= self.max_running:
            raise QueueFullError("the fake engine is full")  # a real pin is a prefill request like any other
        full = len(prompt_token_ids) // self.block_size * self.block_size
        self.pins[key] = list(prompt_token_ids[:full])
        return full

    def unpin_prefix(self, key: str) -> None:
        self.pins.pop(key, None)

    def warm_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> None:
        self.warms.append((key, list(prompt_token_ids)))

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=64,
                           kv_blocks_free=64 - sum(len(p) // self.block_size for p in self.pins.values()),
                           requests_running=len(self.running))

    def kv_snapshot(self) -> KVSnapshot:
        blocks = iter(range(64))
        pins = {k: [next(blocks) for _ in range(len(v) // self.block_size)] for k, v in self.pins.items()}
        return KVSnapshot(block_size=self.block_size, num_blocks=64, pins=pins,
                          requests={rid: [next(blocks)] for rid in sorted(self.running)})


@contextmanager
def fake_gateway(redis_url: str, tokenizer_dir: Path, max_model_len: int = 512,
                 **settings: Any) -> Iterator[LiveServer]:
    """The real gateway app over a FakeEngine (as ``.engine``), served by uvicorn, its Redis database
    emptied first and the default personas pinned before it is handed out."""
    import redis

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store

    redis.Redis.from_url(redis_url).flushdb()
    engine = FakeEngine(tiny_tokenizer(tokenizer_dir), max_model_len=max_model_len)
    app = create_app(engine, Store.from_url(redis_url), Settings(web_dir=Path("/nonexistent"),
                                                                   **{"max_pinned_fraction": 1.0, **settings}))
    with LiveServer(app) as live:
        wait_for(lambda: len(app.state.gateway.personas.pinned) >= 3, timeout=30)
        live.engine = engine  # type: ignore[attr-defined]
        yield live


@contextmanager
def fake_gateways(redis_url: str, tokenizer_dir: Path, settings: Any, count: int = 2,
                  **engine_kw: Any) -> Iterator[list[LiveServer]]:
    """``count`` real gateway apps, each over a FakeEngine of its own (as ``.engine``), on one Redis database
    (emptied first): what one gateway counts in Redis, the others see."""
    import redis

    from chatsvc.app import create_app
    from chatsvc.store import Store

    redis.Redis.from_url(redis_url).flushdb()
    tok = tiny_tokenizer(tokenizer_dir)
    with ExitStack() as stack:
        lives = []
        for _ in range(count):
            engine = FakeEngine(tok, **engine_kw)
            live = stack.enter_context(LiveServer(create_app(engine, Store.from_url(redis_url, 3600, 60), settings)))
            live.engine = engine  # type: ignore[attr-defined]
            lives.append(live)
        yield lives


@pytest.fixture(name="engine")
def engine_fixture(server: LiveServer) -> Iterator[FakeEngine]:
    """The module's ``server`` fixture's fake engine, reset after each test."""
    eng: FakeEngine = server.engine  # type: ignore[attr-defined]
    yield eng
    eng.reset()


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()
