"""``AsyncEngine``: the engine core on a thread of the gateway's process (``chatsvc serve --engine thread``).

The channel is a thread-safe queue of commands one way and ``call_soon_threadsafe`` the other; the core
(``engine.core.EngineCore``) runs the loop on its own thread, and torch releases the GIL while it computes,
so the event loop never waits for a step. Everything else is ``engine.local_client.CoreClient``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import Any

from engine.client import StreamLimits
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.distributed import RankDiedError
from engine.engine import LLMEngine
from engine.local_client import CoreClient
from engine.protocol import Command, EngineDeadError, Shutdown, StepOutput

log = logging.getLogger("chatsvc.engine")

__all__ = ["AsyncEngine"]

IDLE_TICK_S = 0.5  # an idle core's wait for a command; the stop of a closed event loop is noticed this soon
STOP_TIMEOUT_S = 30.0


class _ThreadChannel:
    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Any) -> None:
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.loop = loop
        self.deliver = deliver
        self.closed = False

    def receive(self, wait: bool) -> list[Command] | None:
        commands: list[Command] = []
        try:
            if wait:
                commands.append(self.inbox.get(timeout=IDLE_TICK_S))
            while True:
                commands.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return None if self.closed and not commands else commands

    def send(self, out: StepOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.deliver, out)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.closed = True


class AsyncEngine(CoreClient):
    def __init__(self, llm_engine: LLMEngine, stream_limits: StreamLimits | None = None) -> None:
        self.engine = llm_engine
        self.core = EngineCore(llm_engine)
        super().__init__(llm_engine.tokenizer, self.core.info(), stream_limits)
        log.info("engine thread: %s; %s", self.info.model_name, self.info.runtime_summary)
        self._channel: _ThreadChannel | None = None
        self._thread: threading.Thread | None = None

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

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._channel = _ThreadChannel(self._loop, self._on_output)
        self._thread = threading.Thread(target=self._run, args=(self._channel,), name="engine-loop", daemon=True)
        self._state = "running"
        self._thread.start()

    def _run(self, channel: _ThreadChannel) -> None:
        try:
            self.core.run(channel)
        except RankDiedError:
            pass  # the core failed its requests and said why
        finally:
            if self._state == "running":
                self._state = "failed"
            # Every stream still open ends, however the loop ended.
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
                channel.loop.call_soon_threadsafe(self._fail_open, EngineDeadError("engine loop ended"))

    async def stop(self) -> None:
        if self._thread is None or self._channel is None:
            self._state = "stopped"
            return
        self._channel.inbox.put(Shutdown())
        self._state = "stopped"
        await asyncio.to_thread(self._thread.join, STOP_TIMEOUT_S)
        self._thread = None

    def _send(self, cmd: Command) -> None:
        if self._channel is None or self._state not in ("running", "loaded"):
            raise EngineDeadError(f"engine is not running ({self._state})")
        self._channel.inbox.put(cmd)

