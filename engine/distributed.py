"""Tensor parallelism: the step plan rank 0 sends the other ranks each step, rank 0's runner, their loop.

Layout. Rank 0 is the engine: ``LLMEngine`` with its scheduler, block manager and sampler, and its own shard
of the model (see ``engine.model.parallel``) run by ``DriverRunner``. Ranks 1..N-1 hold only a shard and a
KV cache of their own KV heads with the same number of blocks, addressed by the same block ids; they run
``_serve`` and never see a request. Each step rank 0 sends one ``StepPlan`` (the sequences' new tokens,
positions and block-table changes, the swap and copy lists, the sequences forgotten since the last step) with
``broadcast_object_list``; every rank then executes the block moves on its own cache and runs the same forward
pass, whose all-reduces (after ``o_proj`` and ``down_proj``) and logits gather (to rank 0) meet in lockstep.
Preemption is therefore all-or-nothing across ranks: it is a decision of rank 0's scheduler, and the plan
carries its block moves to every rank.

Launch (``engine.tp_group``, ``engine.tp_rank``). ``LLMEngine(tensor_parallel_size=N)`` starts ranks 1..N-1
itself, or, under ``torchrun``, joins the ranks torchrun started, which run ``serve_launched_rank`` (as
``chatsvc serve`` does first on such a rank). ``LLMEngine`` itself only ever becomes rank 0: built on another
launched rank, it refuses at once.

Failure. A rank that dies makes rank 0 raise ``RankDiedError`` (an ``EngineDeadError``): spawned ranks are
checked before every step, and a collective with a dead peer fails at once (its socket closes), one with a
hung peer after the timeout. The engine cannot go on without a shard, so ``LLMEngine.step`` lets the error
through instead of isolating requests, and the engine process exits (its supervisor starts a new one). A
worker whose rank 0 is gone sees its plan broadcast fail and exits. An error inside the forward pass that
every rank raises alike (a bad input) keeps the ranks in step: the workers skip the step as rank 0 does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import CacheConfig, EngineConfig
from engine.loader import load_model
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel import CollectiveError, TensorParallel
from engine.plan import PlannedSeq, ScheduledSeq, SchedulerOutput, StepSeq
from engine.runner import ModelRunner
from engine.tp_group import (
    COLLECTIVE_TIMEOUT_S,
    RankDiedError,
    RankProcess,
    first_exited,
    join_group,
    launched_rank,
    rank_device,
    start_group,
)
from kernels import AttentionBackend, get_backend

log = logging.getLogger("chatsvc.engine")

_JOIN_TIMEOUT_S = 10.0
_EXIT_WAIT_S = 0.5


# ---- messages (rank 0 -> workers) ----------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    config: EngineConfig
    dtype: torch.dtype
    cache: CacheConfig


@dataclass(frozen=True)
class StepPlan:
    """One step's work for a worker, in the order rank 0 did it: forget, move blocks, run the forward pass."""

    seqs: tuple[PlannedSeq, ...] = ()
    freed: tuple[int, ...] = ()
    moves: SchedulerOutput = SchedulerOutput()  # its block moves only: no requests travel


@dataclass(frozen=True)
class GatherTables:
    """Every rank answers with its ``RankTables`` (tests and diagnostics)."""


@dataclass(frozen=True)
class Stop:
    pass


Message = Setup | StepPlan | GatherTables | Stop


@dataclass
class RankTables:
    """What one rank's runner knows of the block tables: the blocks of every sequence it has not been told
    to forget, and its cache's shape."""

    rank: int
    tables: dict[int, list[int]] = field(default_factory=dict)
    kv_cache_shape: tuple[int, ...] = ()
    cpu_cache_shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, rank: int, runner: ModelRunner) -> RankTables:
        return cls(rank, kv_cache_shape=tuple(runner.kv_cache.shape),
                   cpu_cache_shape=tuple(runner.cpu_cache.shape))

    def update(self, items: Sequence[StepSeq]) -> None:
        for item in items:
            blocks = self.tables.setdefault(item.seq_id, [])
            del blocks[item.table_start :]
            blocks.extend(item.new_blocks)

    def free(self, seq_ids: tuple[int, ...] | list[int]) -> None:
        for seq_id in seq_ids:
            self.tables.pop(seq_id, None)


# ---- threads ------------------------------------------------------------------------------------


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_rank(config: EngineConfig) -> int:
    """Torch threads of each rank on this machine: the engine's threads (default: every core) split among the
    machine's ranks, so they do not oversubscribe the cores."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if launched_rank() is not None else 0
    local_ranks = local_ranks or config.tensor_parallel_size
    return max(1, (config.engine_threads or _cores()) // local_ranks)


# ---- rank 0 --------------------------------------------------------------------------------------


def rank_zero(config: EngineConfig) -> TensorParallel:
    """Rank 0's share of a tensor-parallel engine, checked before anything loads: this process must not be
    a launched rank other than 0 (those serve a shard: ``python -m engine.tp_rank``, ``chatsvc serve``),
    and a launcher's group must have the engine's size."""
    size, rank = config.tensor_parallel_size, launched_rank()
    if rank is not None and rank != 0:
        raise RuntimeError(
            f"this process is rank {rank} of {os.environ['WORLD_SIZE']} started by a launcher (RANK is set): an "
            "engine runs on rank 0 only, the other ranks serve its steps. Run the script through the rank entry "
            "module (torchrun ... -m engine.tp_rank script.py), or run chatsvc serve on every rank")
    if rank == 0:
        _check_launcher_size(size)
    return TensorParallel(0, size)


def _check_launcher_size(size: int) -> None:
    if int(os.environ["WORLD_SIZE"]) != size:
        raise ValueError(f"tensor_parallel_size {size} differs from the launcher's WORLD_SIZE "
                         f"{os.environ['WORLD_SIZE']}")


@dataclass
class _Ranks:
    """Rank 0's hold on the group: the rank processes it started (none under torchrun) and the plan group."""

    size: int
    plan_group: dist.ProcessGroup
    procs: list[RankProcess]
    failed: str | None = None
    closed: bool = False

    def dead_rank(self) -> str | None:
        """Why the first started rank that has exited is gone, else None."""
        return first_exited(self.procs)

    def check(self) -> None:
        self.failed = self.failed or self.dead_rank()
        if self.failed is not None:
            raise RankDiedError(f"tensor-parallel engine is down: {self.failed}")

    def fail(self, exc: BaseException) -> RankDiedError:
        for proc in self.procs:
            proc.join(_EXIT_WAIT_S)  # a killed peer's socket closes before its exit status is there to read
        self.failed = self.dead_rank() or f"{type(exc).__name__}: {exc}"
        return RankDiedError(f"tensor-parallel engine is down: {self.failed}")

    def send(self, message: Message) -> None:
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.plan_group)
        except Exception as exc:
            raise self.fail(exc) from exc

    def gather(self) -> list[Any]:
        """Every worker's answer (rank 0's own is None)."""
        answers: list[Any] = [None] * self.size
        try:
            dist.gather_object(None, answers, dst=0, group=self.plan_group)
        except Exception as exc:
            raise self.fail(exc) from exc
        return answers

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failed is None and self.dead_rank() is None:
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([Stop()], src=0, group=self.plan_group)
        for proc in self.procs:
            if not proc.join(_JOIN_TIMEOUT_S if self.failed is None else 0):  # a failed group sent no Stop
                proc.kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class DriverRunner(ModelRunner):
    """Rank 0's runner: runs its own shard as ``ModelRunner`` does, and before each forward pass sends the
    other ranks the step's plan (the block moves executed since the last one included)."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, cache: CacheConfig,
                 dtype: torch.dtype, device: torch.device, ranks: _Ranks) -> None:
        super().__init__(model, backend, cache, dtype, device)
        self.ranks = ranks
        self.mirror = RankTables.of(0, self)
        self._moves: list[SchedulerOutput] = []
        self._freed: list[int] = []
        self._finalizer = weakref.finalize(self, ranks.close)

    @classmethod
    def start(cls, model: LlamaForCausalLM, backend: AttentionBackend, cache: CacheConfig, dtype: torch.dtype,
              config: EngineConfig) -> DriverRunner:
        """Start (or join) the other ranks, have them load their shards and allocate their caches."""
        ranks = _Ranks(config.tensor_parallel_size, *start_group(config.tensor_parallel_size, config.device))
        try:
            ranks.send(Setup(config, dtype, cache))
            errors = [e for e in ranks.gather()[1:] if e is not None]
            if errors:
                raise RankDiedError(f"a tensor-parallel rank could not start: {errors[0]}")
            return cls(model, backend, cache, dtype, torch.device(config.device), ranks)
        except BaseException:
            ranks.close()
            raise

    def close(self) -> None:
        """Stop the other ranks and leave the process group (also done when the runner is collected)."""
        self._finalizer()

    def execute_block_plans(self, out: SchedulerOutput) -> None:
        super().execute_block_plans(out)
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
            self._moves.append(dataclasses.replace(out, scheduled=(), preempted=(), ignored=()))

    def free_seq(self, seq_id: int) -> None:
        super().free_seq(seq_id)
        self._freed.append(seq_id)

    def _send_plan(self, seqs: tuple[PlannedSeq, ...]) -> None:
        """What rank 0 did since the last plan, then ``seqs``' forward pass: one message per step (more only
        when an earlier step's moves never reached a forward pass)."""
        moves = self._moves or [SchedulerOutput()]
        for i, m in enumerate(moves):
            last, first = i == len(moves) - 1, i == 0
            self.ranks.send(StepPlan(seqs if last else (), tuple(self._freed) if first else (), m))
        self.mirror.free(self._freed)
        self._moves, self._freed = [], []

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[Tensor | None, tuple[ScheduledSeq, ...]]:
        self.execute_block_plans(out)
        self._send_plan(tuple(s.planned() for s in out.scheduled))
        if not out.scheduled:
            return None, ()
        self.mirror.update(out.scheduled)
        try:
            return self.run(out.scheduled)
        except Exception as exc:
            if isinstance(exc, CollectiveError) or self.ranks.dead_rank() is not None:
                raise self.ranks.fail(exc) from exc
            raise  # the workers raised it too (see the module docstring)

    def rank_tables(self) -> list[RankTables]:
        """Every rank's view of the block tables, rank 0's first."""
        if self._moves or self._freed:
            self._send_plan(())
        self.ranks.send(GatherTables())
        answers: list[RankTables] = self.ranks.gather()
        return [self.mirror, *answers[1:]]


def make_runner(model: LlamaForCausalLM, backend: AttentionBackend, cache: CacheConfig, dtype: torch.dtype,
                config: EngineConfig) -> ModelRunner:
    """The engine's runner: ``ModelRunner`` alone, or rank 0's ``DriverRunner`` under tensor parallelism."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(model, backend, cache, dtype, torch.device(config.device))
    return DriverRunner.start(model, backend, cache, dtype, config)


# ---- ranks 1..N-1 --------------------------------------------------------------------------------


def serve_launched_rank(config: EngineConfig | None = None) -> None:
    """Serve rank 0's steps as the rank (not 0) this process was started as, by rank 0 or a launcher;
    returns when rank 0 stops. ``config``, where the caller has one, is checked against the launcher's size;
    the engine's own comes from rank 0."""
    rank = launched_rank()
    if rank is None or rank == 0:
        raise ValueError("serve_launched_rank runs on a launched rank other than 0")
    if config is not None:
        _check_launcher_size(config.tensor_parallel_size)
    _serve(*join_group())


def _receive(group: dist.ProcessGroup) -> Message:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    message: Message = box[0]
    return message


def _serve(rank: int, size: int, group: dist.ProcessGroup) -> None:
    """A worker's life: load its shard as Setup says, then run plans until Stop or until rank 0 is gone."""
    try:
        setup = _receive(group)
        assert isinstance(setup, Setup), setup
        torch.set_num_threads(threads_per_rank(setup.config))
        try:
            runner = _load_rank(rank, size, setup)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
            runner, error = None, f"rank {rank}: {type(exc).__name__}: {exc}"
        dist.gather_object(error, None, dst=0, group=group)
        if runner is None:
            return
        with torch.inference_mode():
            _loop(runner, rank, group)
    except Exception:  # noqa: BLE001 - rank 0 is gone or broke the group: nothing left to serve
        log.debug("tensor-parallel rank %d stops: %s", rank, traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _load_rank(rank: int, size: int, setup: Setup) -> ModelRunner:
    config = setup.config
    device = rank_device(config.device, rank)
    backend = get_backend(config.attention_backend, device)
    loaded = load_model(config.model, setup.dtype, device, backend, config.linear_backend,
                        tp=TensorParallel(rank, size), quantization=config.quantization)
    return ModelRunner(loaded.model, backend, setup.cache, setup.dtype, torch.device(device))


def _loop(runner: ModelRunner, rank: int, group: dist.ProcessGroup) -> None:
    mirror = RankTables.of(rank, runner)
    while True:
        message = _receive(group)
        match message:
            case StepPlan():
                for seq_id in message.freed:
                    runner.free_seq(seq_id)
                mirror.free(message.freed)
                runner.execute_block_plans(message.moves)
                if message.seqs:
                    mirror.update(message.seqs)
                    try:
                        runner.run(message.seqs)
                    except CollectiveError:
                        raise  # a peer is gone: so is the engine
                    except Exception as exc:  # noqa: BLE001 - rank 0 raised it too and goes on
                        log.warning("tensor-parallel rank %d: step failed (%s)", rank, exc)
            case GatherTables():
                dist.gather_object(mirror, None, dst=0, group=group)
            case Stop():
                return
            case _:
                raise RuntimeError(f"unexpected message {message!r}")


__all__ = ["COLLECTIVE_TIMEOUT_S", "DriverRunner", "RankDiedError", "RankTables", "StepPlan", "launched_rank",
           "make_runner", "rank_zero", "serve_launched_rank", "threads_per_rank"]
