"""``EngineCore``: the one engine loop, whatever carries its messages.

drain the inbox -> step -> collect deltas and failures -> publish one ``StepOutput`` -> again; on shutdown,
abort every open request and publish their last deltas. A transport gives the core a ``CoreChannel`` (a queue
to a thread, a pipe to a child process) and adds only what is its own: where the loop runs, and what
happens when it ends. Commands and outputs are the messages of ``engine.protocol``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import torch

from engine.distributed import RankDiedError
from engine.engine import LLMEngine
from engine.protocol import (
    PROTOCOL_VERSION,
    SNAPSHOT_WINDOW_S,
    Abort,
    AddRequest,
    CallReply,
    Command,
    EngineDeadError,
    EngineInfo,
    Pin,
    RequestDelta,
    RequestError,
    Shutdown,
    StepOutput,
    Unpin,
    WantSnapshot,
    Warm,
)
from engine.request import SequenceGroup
from kernels.runtime import describe_runtime

log = logging.getLogger("chatsvc.engine")

__all__ = ["CoreChannel", "EngineCore"]


class CoreChannel(Protocol):
    def receive(self, wait: bool) -> list[Command] | None:
        """The commands queued for the core; with ``wait`` (the core has nothing to run) block until one
        arrives or an idle tick passes. None when the client is gone and the core should stop."""
        ...

    def send(self, out: StepOutput) -> None: ...


class EngineCore:
    def __init__(self, engine: LLMEngine, *, allocator: str = "", omp_wait_policy: str = "") -> None:
        self.engine = engine
        self.allocator = allocator
        self.omp_wait_policy = omp_wait_policy
        self.out = StepOutput()
        self.changed = False
        self.adds_seen = 0
        self.live: set[str] = set()  # requests taken in and not yet finished
        self.snapshot_until = 0.0
        self.snapshot_now = False

    def info(self) -> EngineInfo:
        engine, sched = self.engine, self.engine.scheduler_config
        runtime = describe_runtime(engine.runner.backend, engine.dtype, engine.config.device)
        return EngineInfo(
            protocol=PROTOCOL_VERSION, pid=os.getpid(), model_name=engine.model_name,
            max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
            max_num_seqs=sched.max_num_seqs, max_waiting=sched.max_waiting,
            block_size=engine.block_size_tokens_min(), eos_token_ids=frozenset(engine.eos_token_ids),
            threads=torch.get_num_threads(), allocator=self.allocator, omp_wait_policy=self.omp_wait_policy,
            runtime=runtime.as_dict(), runtime_summary=runtime.describe(), stats=engine.stats(),
            snapshot=engine.kv_snapshot())

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, channel: CoreChannel) -> None:
        """Serve until the channel closes or says Shutdown. A ``RankDiedError`` (the model lost a shard)
        fails every open request, publishes that, and propagates: the engine is down, not one batch."""
        try:
            while True:
                busy = self.engine.has_unfinished() or self.engine.has_background_work()
                commands = channel.receive(wait=not busy)
                if commands is None or not self.apply_all(commands):
                    break
                if self.engine.has_unfinished():
                    self.step()
                elif busy:
                    self.background_step()
                self.publish(channel)
        except RankDiedError as exc:
            log.error("engine stopped: %s", exc)
            self.fail_live(EngineDeadError(f"engine stopped: {exc}"))
            self.publish(channel)
            raise
        self.shutdown()
        self.publish(channel)

    def apply_all(self, commands: list[Command]) -> bool:
        """Apply commands in order; False at a Shutdown (the ones after it are dropped)."""
        for cmd in commands:
            if isinstance(cmd, Shutdown):
                return False
            self.apply(cmd)
        return True

    def apply(self, cmd: Command) -> None:
        engine = self.engine
        self.changed = True
        match cmd:
            case AddRequest():
                self.adds_seen += 1
                try:
                    engine.add_group(SequenceGroup(cmd.request_id, list(cmd.prompt_token_ids), cmd.params,
                                                   arrival_time=cmd.arrival_time or None, prompt=cmd.prompt))
                    self.live.add(cmd.request_id)
                except Exception as exc:  # noqa: BLE001 - e.g. the queue filled up meanwhile
                    self.out.errors.append(RequestError.of(cmd.request_id, exc))
            case Abort():
                self.deliver(engine.abort_request(cmd.request_id))
                if cmd.call_id is not None:
                    self.out.replies.append(CallReply(cmd.call_id))
            case Pin():
                try:
                    pinned = engine.pin_prefix(cmd.key, list(cmd.prompt_token_ids), cmd.cache_salt)
                    reply = CallReply(cmd.call_id or "", result=pinned)
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    log.warning("could not pin %s: %r", cmd.key, exc)
                    reply = CallReply(cmd.call_id or "", error=RequestError.of("", exc))
                if cmd.call_id is not None:
                    self.out.replies.append(reply)
            case Unpin():
                engine.unpin_prefix(cmd.key)
            case Warm():
                try:
                    engine.warm_prefix(cmd.key, list(cmd.prompt_token_ids), cmd.cache_salt, cmd.shared_prefix_tokens)
                except Exception as exc:  # noqa: BLE001 - a warm is a hint: its failure costs a recompute only
                    log.warning("could not warm %s: %r", cmd.key, exc)
            case WantSnapshot():
                self.snapshot_until = time.monotonic() + SNAPSHOT_WINDOW_S
                self.snapshot_now = True

    def background_step(self) -> None:
        """A step for background work only (the host tier's preload): nothing to publish but its end, so
        an idle engine does not send its counters a thousand times a second while it preloads."""
        try:
            self.engine.step()
        except Exception:  # noqa: BLE001 - background work must not take the engine down
            log.exception("engine background step failed")
        if not self.engine.has_background_work():
            self.changed = True

    def step(self) -> None:
        self.changed = True  # the stats moved even when the step produced no delta (a prefill chunk)
        try:
            self.deliver(self.engine.step())
            for request_id, error in self.engine.take_failures():  # requests a step isolated and failed
                self.live.discard(request_id)
                self.out.errors.append(RequestError.of(request_id, error))
        except RankDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the engine down
            log.exception("engine step failed outside the model run; failing the requests it held")
            for group in list(self.engine.scheduler.running):
                self.engine.abort_request(group.request_id)
                self.live.discard(group.request_id)
                self.out.errors.append(RequestError(group.request_id, "RuntimeError", f"engine error: {exc}"))

    def deliver(self, deltas: list[RequestDelta]) -> None:
        self.changed = True
        self.out.deltas.extend(deltas)
        for delta in deltas:
            if delta.request_finished:
                self.live.discard(delta.request_id)

    def fail_live(self, exc: Exception) -> None:
        for request_id in sorted(self.live):
            self.out.errors.append(RequestError.of(request_id, exc))
        self.live.clear()
        self.changed = True

    def shutdown(self) -> None:
        for request_id in list(self.live):
            self.deliver(self.engine.abort_request(request_id))
        self.engine.close()

    def publish(self, channel: CoreChannel) -> None:
        """Send what changed since the last output, with the counters and (while wanted) a KV picture."""
        if not self.changed:
            return
        out, self.out, self.changed = self.out, StepOutput(), False
        out.adds_seen = self.adds_seen
        out.heartbeat = time.monotonic()
        out.stats = self.engine.stats()
        if self.snapshot_now or out.heartbeat < self.snapshot_until:
            out.snapshot = self.engine.kv_snapshot()
            self.snapshot_now = False
        channel.send(out)
