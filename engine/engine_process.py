"""``ProcessEngine``: the step loop in a child process, behind the ``EngineClient`` interface.

Layout. The gateway's process keeps the event loop, HTTP/SSE, Redis and tokenization; a child
process (multiprocessing "spawn", so it starts from a clean interpreter) builds ``LLMEngine`` and
owns the model, the KV cache and the scheduler. The two never contend for one GIL: the child's
torch ops get every core (``engine_threads``) while the parent's torch stays at one thread. If a
tcmalloc library is installed, the child is started with it in ``LD_PRELOAD``; its OpenMP workers
spin briefly, then sleep, between parallel regions (see ``child_environment``).

One duplex pipe joins them; every message is a pickled dataclass defined below.

* child -> parent, once: ``Ready(EngineInfo)`` (protocol version, model name, the limits requests
  are validated against, block size, first stats and snapshot), or ``Failed(error, traceback)``
  when the engine cannot be built; then, after every step and after every batch of commands that
  changed something, ONE ``StepOutput``: that step's deltas, per-request errors, replies to calls,
  how many ``Add`` commands it has taken in, the scheduler's stats, and a KV snapshot only while
  the parent has asked for one within the last ``SNAPSHOT_WINDOW_S`` seconds.
* parent -> child: ``Add`` (a request already validated by the parent), ``Abort``, ``Pin``,
  ``Unpin``, ``WantSnapshot``, ``Shutdown``. ``Abort`` and ``Pin`` carry a call id and get a reply in
  a ``StepOutput``. The child drains commands between steps without blocking, and blocks on the
  pipe only when it has nothing to run.

In the parent, a reader thread blocks on ``recv()`` (which releases the GIL) and hands each
``StepOutput`` to the event loop with one ``call_soon_threadsafe``; there the deltas go to the
per-request ``DeltaQueue``s (bounded: a slow reader's deltas are merged, and past a hard cap its request
is aborted; see ``engine.client.StreamLimits``). When the child exits for any reason the pipe reads EOF: every open
stream raises ``EngineDeadError`` and ``is_running`` turns False. The child in turn exits when the
parent's end of the pipe closes (the parent died) or it is told to shut down.

Supervision. A child that exits while the engine is serving (not through ``stop()``) is replaced:
its open streams and pending calls fail with ``EngineDeadError``, a new child is spawned with the
same arguments (``state`` is "restarting", ``is_running`` False, while it loads), the prefixes
pinned through ``pin_prefix`` (key -> token ids, remembered here) are pinned again in it, and only
then does ``is_running`` turn True. The restarts are bounded: when the child has died
``MAX_DEATHS`` times within ``DEATH_WINDOW_S`` seconds (a failed restart counts as a death), the
engine stays down in state "failed" and is never restarted here; the process stays up, not
ready (``/ready`` answers 503 with the reason) so that an outside supervisor watching readiness
restarts the whole service, with the logs of the last crash still at hand.

Heartbeat. Every ``StepOutput`` carries the child's clock at sending (one is sent after every
step), so ``stats()["last_step_age_s"]`` grows only while the child sends nothing: idle, or stuck
in a step. With requests running, an old heartbeat means a stuck engine (``/ready`` checks it).

A step that raises inside the model run fails only the requests that caused it: ``LLMEngine.step``
isolates them (see ``LLMEngine._isolate``) and the worker sends their errors with the step's output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes.util
import dataclasses
import glob
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

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
from engine.loader import load_tokenizer
from engine.request import RequestLimits, SamplingParams, SequenceGroup, make_request
from engine.scheduler import QueueFullError

log = logging.getLogger("chatsvc.engine")

__all__ = ["ProcessEngine", "EngineInfo", "ENGINE_SPINCOUNT", "PROTOCOL_VERSION", "child_environment",
           "default_engine_threads", "find_tcmalloc"]

PROTOCOL_VERSION = 1
IDLE_POLL_S = 0.5  # how often an idle child checks that its parent still exists
SNAPSHOT_WINDOW_S = 2.0  # a KV snapshot request keeps snapshots coming for this long
STOP_TIMEOUT_S = 30.0
MAX_DEATHS = 3  # this many child deaths within DEATH_WINDOW_S: stop restarting it
DEATH_WINDOW_S = 60.0
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")


# ---- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None
    arrival_time: float  # time.monotonic() is one system-wide clock, so it means the same in the child


@dataclass(frozen=True)
class Abort:
    request_id: str
    call_id: int | None = None


@dataclass(frozen=True)
class Pin:
    call_id: int
    key: str
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class Unpin:
    key: str


@dataclass(frozen=True)
class WantSnapshot:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Add | Abort | Pin | Unpin | WantSnapshot | Shutdown


@dataclass(frozen=True)
class EngineInfo:
    protocol: int
    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_waiting: int
    block_size: int
    eos_token_ids: frozenset[int]
    threads: int
    allocator: str
    omp_wait_policy: str
    stats: dict[str, Any]
    snapshot: dict[str, Any]


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    error: BaseException
    traceback: str


@dataclass
class StepOutput:
    deltas: list[RequestDelta] = field(default_factory=list)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)  # request id, what its stream raises
    replies: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)  # call id, result, error
    adds_seen: int = 0
    heartbeat: float = 0.0  # time.monotonic() of this output: the child's steps are at most this old
    stats: dict[str, Any] = field(default_factory=dict)
    snapshot: dict[str, Any] | None = None


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means it cannot cross the pipe as it is
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


# ---- the child -----------------------------------------------------------------------------------


def default_engine_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def find_tcmalloc(dirs: tuple[str, ...] = TCMALLOC_DIRS) -> str | None:
    """Path of an installed tcmalloc (the minimal build first) in ``dirs``, else a soname the dynamic
    linker knows; None if there is none. The library is used when present, never installed."""
    names = ("tcmalloc_minimal", "tcmalloc")
    for name in names:
        for d in dirs:
            found = sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
            if found:
                return found[0]
    for name in names:
        soname = ctypes.util.find_library(name)
        if soname:
            return soname
    return None


def _allocator() -> str:
    """Which malloc this process runs on, read from its own memory map."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "tcmalloc" in line:
                    return f"tcmalloc ({line.split()[-1]})"
    except OSError:
        return "unknown"
    return "glibc malloc"


ENGINE_SPINCOUNT = "10000"


def child_environment(tcmalloc: str | None) -> dict[str, str]:
    """What the engine process's environment adds to this one's.

    GOMP_SPINCOUNT=10000: an OpenMP worker spins briefly after a parallel region, then sleeps. A decode
    step runs a few hundred short regions back to back; waking a sleeping team costs ~20 us more per region
    on a VM (measured here), while spinning without bound (the default policy, or ACTIVE) burns whole time
    slices whenever the gateway has preempted one of the team. On workload 32 of
    benchmarks/serving_vs_vllm.py it served 1.04-1.19x the tokens/s of OMP_WAIT_POLICY=PASSIVE (three runs,
    --compare-env), and 1.2x those of a 100000 spin. An OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the
    operator wins.
    """
    env: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        env["GOMP_SPINCOUNT"] = ENGINE_SPINCOUNT
    if tcmalloc is not None:
        old = os.environ.get("LD_PRELOAD")
        env["LD_PRELOAD"] = tcmalloc if not old else f"{tcmalloc}:{old}"
    return env


def _omp_wait() -> str:
    """How this process's OpenMP workers wait between regions, as its environment sets it."""
    parts = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return " ".join(parts) or "default"


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """os.environ with ``updates`` applied; a spawned child takes the environment at its start."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_main(conn: Connection, config: EngineConfig, fault_request_prefix: str | None, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(config, fault_request_prefix=fault_request_prefix)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(Failed(_portable(exc), traceback.format_exc()))
        conn.close()
        return
    sched = engine.scheduler_config
    conn.send(Ready(EngineInfo(
        protocol=PROTOCOL_VERSION, pid=os.getpid(), model_name=engine.model_name,
        max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
        max_num_seqs=sched.max_num_seqs, max_waiting=sched.max_waiting,
        block_size=engine.block_size_tokens_min(), eos_token_ids=frozenset(engine.eos_token_ids),
        threads=torch.get_num_threads(), allocator=_allocator(),
        omp_wait_policy=_omp_wait(), stats=engine.stats(),
        snapshot=engine.kv_snapshot(),
    )))
    try:
        _Worker(engine, conn, parent_pid).run()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the parent is gone; nobody is left to serve
    finally:
        conn.close()


class _Worker:
    """The child's loop: drain commands, step, send one StepOutput."""

    def __init__(self, engine: LLMEngine, conn: Connection, parent_pid: int) -> None:
        self.engine = engine
        self.conn = conn
        self.parent_pid = parent_pid
        self.out = StepOutput()
        self.changed = False
        self.adds_seen = 0
        self.live: set[str] = set()
        self.snapshot_until = 0.0
        self.snapshot_now = False

    def run(self) -> None:
        while True:
            if not self.engine.has_unfinished() and not self.conn.poll(IDLE_POLL_S):
                if os.getppid() != self.parent_pid:
                    return  # re-parented: the gateway died without closing us down
                continue
            if not self._drain():
                break
            if self.engine.has_unfinished():
                self._step()
            self._flush()
        # Shutting down: end every open stream.
        for request_id in list(self.live):
            self._deliver(self.engine.abort_request(request_id))
        self._flush()

    def _drain(self) -> bool:
        """Apply every queued command; False on Shutdown or when the parent's end has closed."""
        while self.conn.poll():
            try:
                cmd = self.conn.recv()
            except EOFError:
                return False
            if isinstance(cmd, Shutdown):
                return False
            self._apply(cmd)
            self.changed = True
        return True

    def _apply(self, cmd: Command) -> None:
        engine = self.engine
        match cmd:
            case Add():
                self.adds_seen += 1
                try:
                    engine.add_group(SequenceGroup(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                                   arrival_time=cmd.arrival_time, prompt=cmd.prompt))
                    self.live.add(cmd.request_id)
                except Exception as exc:  # noqa: BLE001 - e.g. the queue filled up meanwhile
                    self.out.errors.append((cmd.request_id, _portable(exc)))
            case Abort():
                self._deliver(engine.abort_request(cmd.request_id))
                if cmd.call_id is not None:
                    self.out.replies.append((cmd.call_id, None, None))
            case Pin():
                try:
                    self.out.replies.append((cmd.call_id, engine.pin_prefix(cmd.key, cmd.prompt_token_ids), None))
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    self.out.replies.append((cmd.call_id, None, _portable(exc)))
            case Unpin():
                engine.unpin_prefix(cmd.key)
            case WantSnapshot():
                self.snapshot_until = time.monotonic() + SNAPSHOT_WINDOW_S
                self.snapshot_now = True

    def _step(self) -> None:
        self.changed = True  # the stats moved even when the step produced no delta (a prefill chunk)
        try:
            self._deliver(self.engine.step())
            for request_id, error in self.engine.take_failures():  # requests a step isolated and failed
                self.live.discard(request_id)
                self.out.errors.append((request_id, _portable(error)))
        except RankDiedError:
            raise  # the model lost a shard: this process exits and the parent starts a new engine
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the engine down
            log.exception("engine step failed outside the model run; failing the requests it held")
            for group in list(self.engine.scheduler.running):
                self.engine.abort_request(group.request_id)
                self.live.discard(group.request_id)
                self.out.errors.append((group.request_id, RuntimeError(f"engine error: {exc}")))

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        self.changed = True
        self.out.deltas.extend(deltas)
        for delta in deltas:
            if delta.request_finished:
                self.live.discard(delta.request_id)

    def _flush(self) -> None:
        if not self.changed:
            return
        out, self.out, self.changed = self.out, StepOutput(), False
        out.adds_seen = self.adds_seen
        out.heartbeat = time.monotonic()
        out.stats = self.engine.stats()
        if self.snapshot_now or time.monotonic() < self.snapshot_until:
            out.snapshot = self.engine.kv_snapshot()
            self.snapshot_now = False
        self.conn.send(out)


# ---- the parent ----------------------------------------------------------------------------------


class ProcessEngine(EngineClient):
    """Starts the engine process and waits until its model is loaded; ``start()`` then begins serving.

    Construction blocks (model load, and the tokenizer loads here meanwhile) and raises the child's
    own error when the engine cannot be built, e.g. ValueError for a bad model path. Every method
    other than ``stats`` is meant to be called from the event loop ``start()`` ran in.

    A child that exits while serving is replaced (see the module docstring); ``max_deaths`` deaths
    within ``death_window_s`` seconds leave the engine in the "failed" state instead.
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
        conn, proc = self._spawn()
        try:
            tokenizer, _ = load_tokenizer(config.model)
            info = self._wait_ready(conn, proc, startup_timeout_s)
        except BaseException:
            self._reap(proc, 0.0)
            conn.close()
            raise
        tokenizer.eos_token_ids = info.eos_token_ids  # the engine's stop tokens are the ones that count
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self._limits = RequestLimits(info.max_num_seqs, info.vocab_size, info.max_model_len)
        self.stream_limits = stream_limits or StreamLimits()
        self.stream_counters = StreamCounters()
        self._streams: dict[str, DeltaQueue] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._pin_ids = itertools.count()
        self._pins: dict[str, list[int]] = {}  # replayed into a replacement child
        self._deaths: collections.deque[float] = collections.deque()
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._state = "loaded"  # -> running <-> restarting, -> failed, -> stopped
        self._stopping = False
        self._install(conn, proc, info)

    @classmethod
    def from_args(cls, model: str | None = None, *, startup_timeout_s: float = 600.0, max_deaths: int = MAX_DEATHS,
                  death_window_s: float = DEATH_WINDOW_S, fault_request_prefix: str | None = None,
                  stream_limits: StreamLimits | None = None, **settings: Any) -> ProcessEngine:
        """Keyword form: the settings are ``EngineConfig``'s fields."""
        return cls(EngineConfig(model=model, **settings), startup_timeout_s=startup_timeout_s,
                   max_deaths=max_deaths, death_window_s=death_window_s, fault_request_prefix=fault_request_prefix,
                   stream_limits=stream_limits)

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def state(self) -> str:
        """loaded (not started yet), running, restarting, failed (gave up restarting) or stopped."""
        return self._state

    def _spawn(self) -> tuple[Connection, BaseProcess]:
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_child_main, name="chatsvc-engine", daemon=True,
                           args=(child_conn, self.config, self._fault_prefix, os.getpid()))
        with _environ(child_environment(find_tcmalloc())):
            proc.start()
        child_conn.close()  # so that the child's exit reads as EOF here
        return conn, proc

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

    def _launch(self) -> tuple[Connection, BaseProcess, EngineInfo]:
        """A new child, ready; blocking (run in a thread)."""
        conn, proc = self._spawn()
        try:
            return conn, proc, self._wait_ready(conn, proc, self._startup_timeout_s)
        except BaseException:
            self._reap(proc, 0.0)
            conn.close()
            raise

    def _install(self, conn: Connection, proc: BaseProcess, info: EngineInfo) -> None:
        self._conn, self._proc, self.info = conn, proc, info
        self._stats: dict[str, Any] = info.stats
        self._snapshot: dict[str, Any] = info.snapshot
        self._snapshot_asked = 0.0
        self._heartbeat = time.monotonic()
        self._adds_sent = 0
        self._adds_seen = 0
        log.info("engine process %d: %s, %d torch threads, %s, OpenMP waits: %s", info.pid, info.model_name,
                 info.threads, info.allocator, info.omp_wait_policy)

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

    @property
    def is_running(self) -> bool:
        return self._state == "running"

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
        if conn is not self._conn:
            return  # a late message of a child already replaced
        self._stats = out.stats
        self._heartbeat = out.heartbeat
        if out.snapshot is not None:
            self._snapshot = out.snapshot
        self._adds_seen = out.adds_seen
        for delta in out.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
        for request_id, exc in out.errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)
        for call_id, result, error in out.replies:
            fut = self._calls.pop(call_id, None)
            if fut is None or fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def _on_exit(self, conn: Connection, proc: BaseProcess) -> None:
        if conn is not self._conn:
            return
        code = proc.exitcode
        if not self._stopping:
            log.error("engine process %d exited with code %s; failing %d open streams", proc.pid, code,
                      len(self._streams))
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"engine process exited (code {code})"))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"engine process exited (code {code})"))
        self._calls.clear()
        if self._stopping or self._state in ("failed", "stopped"):
            return
        self._state = "restarting"
        self._restart_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        """Launch children until one is ready, pins replayed, or the death bound is reached."""
        while not self._stopping:
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > self._death_window_s:
                self._deaths.popleft()
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
            self._install(conn, proc, info)
            self._start_reader()
            if self._stopping:
                return  # stop() sends the new child its Shutdown
            self.restarts += 1
            for key, ids in list(self._pins.items()):
                try:
                    await self._pin(key, ids)
                except EngineDeadError:
                    return  # died again: its _on_exit has started the next restart
                except Exception:  # noqa: BLE001 - one prefix that cannot be pinned must not keep it down
                    log.exception("could not pin %r again in the new engine process", key)
            if conn is self._conn and not self._stopping:
                self._state = "running"
                log.info("engine process %d is serving again (%d pins restored)", info.pid, len(self._pins))
            return

    def _send(self, cmd: Command) -> None:
        try:
            self._conn.send(cmd)
        except (OSError, ValueError) as exc:  # broken pipe, or closed by stop()
            raise EngineDeadError("the engine process has exited") from exc

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
            raise EngineDeadError(f"engine is not running ({self._state})")
        return self._generate(request_id, sampling_params, prompt, prompt_token_ids)

    def _generate(self, request_id: str, sampling_params: SamplingParams, prompt: str | None,
                  prompt_token_ids: list[int] | None) -> AsyncGenerator[RequestDelta, None]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = make_request(self._limits, self.tokenizer.encode, request_id, sampling_params, prompt,
                             prompt_token_ids)
        # Adds the child has not answered yet are not in its stats' waiting count.
        waiting = self._stats.get("requests_waiting", 0) + self._adds_sent - self._adds_seen
        if waiting >= self.info.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.info.max_waiting} requests)")
        stream = DeltaQueue(self.stream_limits, self.stream_counters, lambda: self._abort_quietly(request_id))
        self._send(Add(request_id, sampling_params, group.prompt_token_ids, prompt, group.arrival_time))
        self._adds_sent += 1
        self._streams[request_id] = stream
        return self._stream(request_id, stream)

    def _stream(self, request_id: str, stream: DeltaQueue) -> AsyncGenerator[RequestDelta, None]:
        def on_exit(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

        return relay_deltas(stream, on_exit)

    def _abort_quietly(self, request_id: str) -> None:
        if self.is_running:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort(request_id))

    async def _call(self, make: Callable[[int], Command], internal: bool = False) -> Any:
        """Send a command and await its reply; ``internal`` calls also run while pins are replayed."""
        if self._loop is None or not (self.is_running or (internal and self._state == "restarting")):
            raise EngineDeadError(f"engine is not running ({self._state})")
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
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
    async def pin_prefix(self, key: str, prompt_token_ids: list[int]) -> int:
        if not self.is_running:
            raise EngineDeadError(f"engine is not running ({self._state})")
        ids = list(prompt_token_ids)
        pinned = await self._pin(key, ids)
        self._pins[key] = ids
        return pinned

    async def _pin(self, key: str, ids: list[int]) -> int:
        if len(ids) >= self.info.block_size:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            async for _ in self._generate(f"pin-{next(self._pin_ids)}-{key}", params, None, ids):
                pass
        pinned: int = await self._call(lambda call_id: Pin(call_id, key, ids), internal=True)
        return pinned

    def unpin_prefix(self, key: str) -> None:
        self._pins.pop(key, None)
        if self.is_running:
            with contextlib.suppress(EngineDeadError):  # a dead engine holds no pins
                self._send(Unpin(key))

    # -- numbers ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The child's latest counters, plus the engine's state, restarts and the age of the child's last
        step (its heartbeat: it only grows while the child is stuck, or dead)."""
        return {**self._stats, "engine_state": self._state, "engine_restarts": self.restarts,
                "last_step_age_s": time.monotonic() - self._heartbeat,
                "max_waiting": self.info.max_waiting,
                "stream_deltas_coalesced": self.stream_counters.coalesced,
                "streams_overflowed": self.stream_counters.overflowed}

    def kv_snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        if self.is_running and now - self._snapshot_asked > SNAPSHOT_WINDOW_S / 2:
            # Asking keeps the child attaching snapshots to its outputs for the next window.
            self._snapshot_asked = now
            with contextlib.suppress(EngineDeadError):  # the last snapshot is still the best answer
                self._send(WantSnapshot())
        return self._snapshot
