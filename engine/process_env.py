"""The engine process's environment: how many threads it runs, which allocator it preloads, how its OpenMP
workers wait between parallel regions. Read by the parent before it spawns the child, and by the child to
report what it runs with."""

from __future__ import annotations

import contextlib
import ctypes.util
import glob
import itertools
import os
from collections.abc import Iterator

__all__ = ["ENGINE_SPINCOUNT", "allocator", "child_environment", "default_engine_threads", "environ",
           "find_tcmalloc", "omp_wait_policy"]

TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")


def default_engine_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def find_tcmalloc(dirs: tuple[str, ...] = TCMALLOC_DIRS) -> str | None:
    """Path of an installed tcmalloc (the minimal build first) in ``dirs``, else a soname the dynamic
    linker knows; None if there is none. The library is used when present, never installed."""
    names = ("tcmalloc_minimal", "tcmalloc")
    for name, d in itertools.product(names, dirs):
        found = sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
        if found:
            return found[0]
    return next(filter(None, map(ctypes.util.find_library, names)), None)


def allocator() -> str:
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

    GOMP_SPINCOUNT: an OpenMP worker spins briefly after a parallel region, then sleeps. A decode step runs a
    few hundred short regions back to back, and waking a sleeping team costs tens of microseconds a region on
    a VM; spinning without bound (the default policy, or ACTIVE) burns whole time slices whenever the gateway
    has preempted one of the team; ``benchmarks/serving_vs_vllm.py --compare-env`` serves under each setting.
    An OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the operator wins. tcmalloc, when installed, keeps the per-step temporaries cheap.

    THP_MEM_ALLOC_ENABLE=1: torch puts its allocations of 2 MiB and more (the KV pool, the packed weights) on
    transparent huge pages where the kernel allows them (``madvise``). A decode step reads KV blocks from all
    over the pool, 2 KiB runs on thousands of pages, and fewer TLB misses make it faster where the CPU feels
    them (``benchmarks/huge_pages.py`` and ``serving_ab.py`` measure it). An operator's own setting wins.
    """
    env: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        env["GOMP_SPINCOUNT"] = ENGINE_SPINCOUNT
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if tcmalloc is not None:
        old = os.environ.get("LD_PRELOAD")
        env["LD_PRELOAD"] = tcmalloc if not old else f"{tcmalloc}:{old}"
    return env


def omp_wait_policy() -> str:
    """How this process's OpenMP workers wait between regions, as its environment sets it."""
    parts = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return " ".join(parts) or "default"


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
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
