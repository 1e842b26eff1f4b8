"""Tensor parallelism's processes and their group: starting ranks 1..N-1, the rendezvous, the process groups.

Every rank other than 0 runs ``python -m engine.tp_rank``, whether rank 0 started it (one machine) or
torchrun did (env:// rendezvous), so no rank needs the caller's ``__main__``: an engine built in a REPL, a
notebook or a script piped on stdin starts its ranks exactly as one built in a script file does.
(multiprocessing's spawn re-imports the parent's main module in each child, and ``<stdin>`` is no file.)

Rendezvous. A TCPStore: rank 0 hosts it when it starts the ranks itself (on a port the OS picks, passed to
them as MASTER_PORT with RANK and WORLD_SIZE, as torchrun passes its own), torchrun's env:// one otherwise.
Rank 0 publishes its device there (a worker's backend, gloo or NCCL, must be rank 0's) and each worker
counts itself in before it joins the process group. Rank 0 waits for that count while watching the
processes it started, so a rank that dies on the way (an import error, a bad environment) fails the start at
once with that rank's own stderr, instead of after the group's timeout.

Two process groups: the default one (gloo on CPU, NCCL on CUDA) carries the model's collectives with a
timeout of ``COLLECTIVE_TIMEOUT_S``, so a rank that hangs inside a step fails it instead of stalling the
engine; a gloo group carries the plans (Python objects), with a long timeout because a worker waits there
for as long as the engine idles.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.rendezvous import rendezvous

from engine.protocol import EngineDeadError

COLLECTIVE_TIMEOUT_S = 120.0
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
PLAN_TIMEOUT = datetime.timedelta(days=3650)
# Set for the ranks rank 0 starts itself (torchrun's are not): their rendezvous store is already up.
SPAWNED_ENV = "CHATSVC_TP_SPAWNED"
_DEVICE_KEY = "chatsvc/device"
_READY_KEY = "chatsvc/ready"
_TAIL_LINES = 20
_POLL_S = 0.02
_ROOT = Path(__file__).resolve().parent.parent  # holds the engine and kernels packages


class RankDiedError(EngineDeadError):
    """A tensor-parallel rank died or stopped answering: the engine cannot run without its shard."""


def launched_rank() -> int | None:
    """This process's rank when it was started as one (by torchrun, another env:// launcher, or rank 0),
    else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"])
    return None


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank`` for an engine on ``device``: on CUDA its local GPU, made current."""
    if device != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def init_groups(store: Store, rank: int, size: int, device: str) -> dist.ProcessGroup:
    """Join the default group (the model's collectives) and the plans' gloo group, which is returned."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=PrefixStore("default_pg", store), rank=rank, world_size=size,
                            timeout=_COLLECTIVE_TIMEOUT)
    group: dist.ProcessGroup | None = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    assert group is not None, "every rank is a member"
    return group


# ---- rank 0 --------------------------------------------------------------------------------------


def rank_command() -> list[str]:
    """How a rank's process starts: this interpreter running the rank entry module."""
    return [sys.executable, "-m", "engine.tp_rank"]


class RankProcess:
    """A rank that rank 0 started: its process, and the last lines of its stderr (passed on to rank 0's
    stderr as they come), which say why it died when it does."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        self.rank = rank
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               SPAWNED_ENV: "1", "PYTHONPATH": str(_ROOT) + (os.pathsep + path if path else "")}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # a store of our own, not a launcher's agent's
        self.proc = subprocess.Popen(rank_command(), env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._reader = threading.Thread(target=self._pump, name=f"tp-rank-{rank}-stderr", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.tail.append(line.decode(errors="replace").rstrip())
                with contextlib.suppress(OSError):
                    os.write(2, line)

    def exited(self) -> str | None:
        """Why this rank is gone (its exit status and its stderr's last lines), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        self._reader.join(1.0)  # the last lines, written before the exit
        tail = "\n".join(line for line in self.tail if line)
        return f"rank {self.rank} exited with code {code}" + (f":\n{tail}" if tail else "")

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to end; whether it has."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return self.proc.poll() is not None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def first_exited(procs: list[RankProcess]) -> str | None:
    """Why the first of ``procs`` that has exited is gone, else None."""
    return next((why for proc in procs if (why := proc.exited()) is not None), None)


def _wait_ready(store: Store, procs: list[RankProcess]) -> None:
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while (ready := store.add(_READY_KEY, 0)) < len(procs):
        if (why := first_exited(procs)) is not None:
            raise RankDiedError(f"tensor-parallel ranks did not start: {why}")
        if time.monotonic() > deadline:
            raise RankDiedError(f"tensor-parallel ranks did not start: {ready} of {len(procs)} ready after "
                                f"{COLLECTIVE_TIMEOUT_S:.0f} s")
        time.sleep(_POLL_S)


def start_group(size: int, device: str) -> tuple[dist.ProcessGroup, list[RankProcess]]:
    """As rank 0 of ``size`` ranks of an engine on ``device`` ("cpu", "cuda"): start ranks 1..size-1 (none
    when a launcher started them) and join the group with them. Returns the plans' group and the processes
    started."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process (one process group each)")
    if launched_rank() is not None:
        store, _, _ = next(rendezvous("env://", timeout=_COLLECTIVE_TIMEOUT))
        store.set(_DEVICE_KEY, device)
        return init_groups(store, 0, size, rank_device(device, 0)), []
    store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                     timeout=_COLLECTIVE_TIMEOUT)
    store.set(_DEVICE_KEY, device)
    procs: list[RankProcess] = []
    try:
        procs.extend(RankProcess(rank, size, store.port) for rank in range(1, size))
        _wait_ready(store, procs)
        try:
            group = init_groups(store, 0, size, rank_device(device, 0))
        except Exception as exc:
            raise RankDiedError(f"tensor-parallel ranks did not join: {first_exited(procs) or exc}") from exc
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return group, procs


# ---- ranks 1..N-1 --------------------------------------------------------------------------------


def join_group() -> tuple[int, int, dist.ProcessGroup]:
    """As a rank other than 0 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): join rank 0's group on its
    device. Returns (rank, size, the plans' group)."""
    # torchrun's workers may start long before rank 0 has loaded its model and published its device.
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    store, rank, size = next(rendezvous("env://", timeout=_COLLECTIVE_TIMEOUT if spawned else PLAN_TIMEOUT))
    store.add(_READY_KEY, 1)
    device = store.get(_DEVICE_KEY).decode()
    store.set_timeout(_COLLECTIVE_TIMEOUT)
    return rank, size, init_groups(store, rank, size, rank_device(device, rank))


__all__ = ["COLLECTIVE_TIMEOUT_S", "PLAN_TIMEOUT", "SPAWNED_ENV", "RankDiedError", "RankProcess", "first_exited",
           "init_groups", "join_group", "launched_rank", "rank_command", "rank_device", "start_group"]
