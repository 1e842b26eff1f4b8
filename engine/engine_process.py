"""``ProcessEngine``: the engine core in a child process (``chatsvc serve``'s default), and its supervision.

The gateway's process keeps the event loop, HTTP/SSE, Redis and tokenization; the child
(``engine.process_child``, started with multiprocessing "spawn") owns the model, the KV cache and the
scheduler. The two never contend for one GIL: the child's torch ops get every core (``engine_threads``) while
the parent's torch stays at one thread. The child's environment (allocator, OpenMP waits) is
``engine.process_env``'s.

The channel is one duplex pipe of ``engine.protocol`` messages: commands to the child, one ``StepOutput`` per
step back. A reader thread blocks on ``recv()`` (which releases the GIL) and hands each output to the event
loop with one ``call_soon_threadsafe``; from there ``engine.local_client.CoreClient`` routes it. When the
child exits for any reason the pipe reads EOF: every open stream raises ``EngineDeadError`` and
``is_running`` turns False.

Supervision. A child that exits while the engine is serving (not through ``stop()``) is replaced: a new
child is spawned with the same arguments (``state`` is "restarting" while it loads), the prefixes pinned
through ``pin_prefix`` are pinned again in it, and only then does ``is_running`` turn True. Restarts are
bounded: when the child has died ``MAX_DEATHS`` times within ``DEATH_WINDOW_S`` seconds (a failed restart
counts as a death), the engine stays down in state "failed"; the process stays up, not ready (``/ready``
answers 503 with the reason), so that an outside supervisor watching readiness restarts the whole service
with the logs of the last crash still at hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from engine.client import StreamLimits
from engine.config import EngineConfig
from engine.local_client import CoreClient
from engine.model_files import load_tokenizer
from engine.process_child import Failed, Ready, child_main
from engine.process_env import child_environment, default_engine_threads, environ, find_tcmalloc
from engine.protocol import PROTOCOL_VERSION, Command, EngineDeadError, EngineInfo, Shutdown, StepOutput
from engine.tokenizer import Tokenizer

log = logging.getLogger("chatsvc.engine")

__all__ = ["ProcessEngine"]

STOP_TIMEOUT_S = 30.0
MAX_DEATHS = 3  # this many child deaths within DEATH_WINDOW_S: stop restarting it
DEATH_WINDOW_S = 60.0


class ProcessEngine(CoreClient):
    """Starts the engine process and waits until its model is loaded; ``start()`` then begins serving.

    Construction blocks (model load, and the tokenizer loads here meanwhile) and raises the child's own
    error when the engine cannot be built, e.g. ValueError for a bad model path. Every method other than
    ``stats`` is meant to be called from the event loop ``start()`` ran in.
    """

    def __init__(self, config: EngineConfig, *, startup_timeout_s: float = 600.0, max_deaths: int = MAX_DEATHS,
                 death_window_s: float = DEATH_WINDOW_S, fault_request_prefix: str | None = None,
                 stream_limits: StreamLimits | None = None) -> None:
        # This process only tokenizes and serves; the cores belong to the engine process.
        torch.set_num_threads(1)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if config.engine_threads is None:
            config = dataclasses.replace(config, engine_threads=default_engine_threads())
        if config.adaptive_threads is None:
            config = dataclasses.replace(config, adaptive_threads=True)
        self.config = config
        self._fault_prefix = fault_request_prefix
        self._startup_timeout_s = startup_timeout_s
        self._max_deaths = max_deaths
        self._death_window_s = death_window_s
        loaded: list[Tokenizer] = []  # the tokenizer loads here while the child loads the model
        conn, proc, info = self._launch(meanwhile=lambda: loaded.append(load_tokenizer(config.model)[0]))
        tokenizer = loaded[0]
        tokenizer.eos_token_ids = info.eos_token_ids  # the engine's stop tokens are the ones that count
        super().__init__(tokenizer, info, stream_limits)
        self._deaths: list[float] = []  # when the child died, within the last death window
        self._reader: threading.Thread | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._conn, self._proc = conn, proc

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> ProcessEngine:
        """Keyword form: ``EngineConfig``'s fields, and this constructor's own keywords."""
        own = inspect.signature(cls).parameters
        config = EngineConfig(model=model, **{k: v for k, v in kwargs.items() if k not in own})
        return cls(config, **{k: v for k, v in kwargs.items() if k in own})

    @property
    def pid(self) -> int:
        return self.info.pid

    # -- the child --------------------------------------------------------------------------------
    def _launch(self, meanwhile: Callable[[], object] = lambda: None,
                ) -> tuple[Connection, BaseProcess, EngineInfo]:
        """A new child, ready (blocking: a restart runs it in a thread); ``meanwhile`` runs as it loads.
        Raises the child's own error when it cannot build its engine."""
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=child_main, name="chatsvc-engine", daemon=True,
                           args=(child_conn, self.config, self._fault_prefix, os.getpid()))
        with environ(child_environment(find_tcmalloc())):
            proc.start()
        child_conn.close()  # so that the child's exit reads as EOF here
        try:
            meanwhile()
            info = self._wait_ready(conn, proc, self._startup_timeout_s)
        except BaseException:
            self._reap(proc, 0.0)
            conn.close()
            raise
        log.info("engine process %d: %s; %s; %s, OpenMP waits: %s", info.pid, info.model_name,
                 info.runtime_summary, info.allocator, info.omp_wait_policy)
        return conn, proc, info

    @staticmethod
    def _wait_ready(conn: Connection, proc: BaseProcess, timeout_s: float) -> EngineInfo:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"engine process did not load the model within {timeout_s:.0f}s")
        try:
            msg = conn.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"engine process exited (code {proc.exitcode}) before it was ready") from None
        if isinstance(msg, Failed):
            msg.error.add_note(f"raised in the engine process:\n{msg.traceback}")
            raise msg.error
        if not isinstance(msg, Ready) or msg.info.protocol != PROTOCOL_VERSION:
            raise RuntimeError(f"engine process speaks another protocol (got {msg!r:.200})")
        return msg.info

    @staticmethod
    def _reap(proc: BaseProcess, timeout_s: float) -> None:
        """Wait for a child to exit, terminating (then killing) it if it does not; leaves no zombie."""
        proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "loaded":
            if self._state in ("stopped", "failed"):
                raise EngineDeadError("the engine process has exited")
            return
        if not self._proc.is_alive():
            self._state = "failed"
            raise EngineDeadError("the engine process has exited")
        self._loop = asyncio.get_running_loop()
        self._start_reader()
        self._state = "running"

    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, args=(self._conn, self._proc), name="engine-reader",
                                        daemon=True)
        self._reader.start()

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._state = "stopped"
        if self._restart_task is not None:
            # Not cancelled: a child being launched in a thread would be left behind. The task sees
            # _stopping once the launch ends and shuts that child down itself.
            await asyncio.gather(self._restart_task, return_exceptions=True)
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(Shutdown())
        reader = self._reader
        if reader is None:
            await asyncio.to_thread(self._reap, self._proc, STOP_TIMEOUT_S)
        else:
            # The reader reaps the child once the pipe closes; a child stuck in a step is terminated.
            await asyncio.to_thread(reader.join, STOP_TIMEOUT_S)
            if reader.is_alive():
                self._proc.terminate()
                await asyncio.to_thread(reader.join, STOP_TIMEOUT_S)
        self._conn.close()

    def _send(self, cmd: Command) -> None:
        try:
            self._conn.send(cmd)
        except (OSError, ValueError) as exc:  # broken pipe, or closed by stop()
            raise EngineDeadError("the engine process has exited") from exc

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self, conn: Connection, proc: BaseProcess) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._dispatch, conn, msg)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                break
        self._reap(proc, 10.0)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_exit, conn, proc)

    def _dispatch(self, conn: Connection, out: StepOutput) -> None:
        if conn is self._conn:  # else: a late message of a child already replaced
            self._on_output(out)

    def _on_exit(self, conn: Connection, proc: BaseProcess) -> None:
        if conn is not self._conn:
            return
        code = proc.exitcode
        if not self._stopping:
            log.error("engine process %d exited with code %s; failing %d open streams", proc.pid, code,
                      len(self._streams))
        self._fail_open(EngineDeadError(f"engine process exited (code {code})"))
        if self._stopping or self._state in ("failed", "stopped"):
            return
        self._state = "restarting"
        self._restart_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        """Launch children until one is ready, pins replayed, or the death bound is reached."""
        while not self._stopping:
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t <= self._death_window_s] + [now]
            if len(self._deaths) >= self._max_deaths:
                log.critical("engine process died %d times within %.0fs; not restarting it (state failed)",
                             len(self._deaths), self._death_window_s)
                self._state = "failed"
                return
            try:
                conn, proc, info = await asyncio.to_thread(self._launch)
            except Exception:  # noqa: BLE001 - counts as one more death
                log.exception("engine process could not be restarted")
                continue
            self._conn.close()
            self._conn, self._proc = conn, proc
            self._install(info)
            self._start_reader()
            if self._stopping:
                return  # stop() sends the new child its Shutdown
            self.restarts += 1
            for key, (ids, cache_salt) in list(self._pins.items()):
                try:
                    await self._pin(key, ids, cache_salt)
                except EngineDeadError:
                    return  # died again: its _on_exit has started the next restart
                except Exception:  # noqa: BLE001 - one prefix that cannot be pinned must not keep it down
                    log.exception("could not pin %r again in the new engine process", key)
            if conn is self._conn and not self._stopping:
                self._state = "running"
                log.info("engine process %d is serving again (%d pins restored)", info.pid, len(self._pins))
            return
