"""The engine process: builds ``LLMEngine`` and runs ``EngineCore`` over its end of the pipe.

Started by ``engine.engine_process.ProcessEngine`` with multiprocessing "spawn" (a clean interpreter). It
says ``Ready(EngineInfo)`` once, or ``Failed`` when the engine cannot be built; then the core's loop runs
with the pipe as its channel. An idle child blocks on the pipe, waking every ``IDLE_POLL_S`` to check that
its parent still exists; it exits when the parent's end closes, when told to shut down, or when the model
loses a shard (``RankDiedError`` propagates out of the core, which has failed its requests first; the parent
sees the pipe close and starts a new engine).
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine import LLMEngine
from engine.process_env import allocator, omp_wait_policy
from engine.protocol import Command, EngineInfo, StepOutput

__all__ = ["Failed", "Ready", "child_main"]

IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    error: BaseException
    traceback: str


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError that says what it was: the parent
    raises the engine's own error type (a bad model path is a ValueError) when it can."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means it cannot cross the pipe as it is
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _PipeChannel:
    def __init__(self, conn: Connection, parent_pid: int) -> None:
        self.conn = conn
        self.parent_pid = parent_pid

    def receive(self, wait: bool) -> list[Command] | None:
        if wait and not self.conn.poll(IDLE_POLL_S):
            # Re-parented: the gateway died without closing us down.
            return None if os.getppid() != self.parent_pid else []
        commands: list[Command] = []
        try:
            while self.conn.poll():
                commands.append(self.conn.recv())
        except EOFError:
            return None
        return commands

    def send(self, out: StepOutput) -> None:
        self.conn.send(out)


def child_main(conn: Connection, config: EngineConfig, fault_request_prefix: str | None, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(config, fault_request_prefix=fault_request_prefix)
        core = EngineCore(engine, allocator=allocator(), omp_wait_policy=omp_wait_policy())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(Failed(_portable(exc), traceback.format_exc()))
        conn.close()
        return
    conn.send(Ready(core.info()))
    try:
        core.run(_PipeChannel(conn, parent_pid))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the parent is gone; nobody is left to serve
    finally:
        conn.close()
