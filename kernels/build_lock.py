"""One C++ build at a time in a build directory: a bounded wait for a live builder, none for a dead one.

torch's ``cpp_extension.load`` guards its build directory with a baton file (``<dir>/lock``, created with
``O_EXCL`` and held open for the whole build, removed when the build ends) and waits for it to disappear
with no timeout. A build killed midway (a test timeout, Ctrl-C, the OOM killer) leaves the baton behind,
and every later load of that extension, cached build included, waits forever.

``build_lock`` runs a load under an ``flock`` on ``<dir>/chatsvc.lock``, which the kernel releases when its
holder dies, however it dies. So:

- a second builder waits for a live first one, up to ``timeout_s``, then fails naming it;
- under the lock, a baton that no process holds open is a dead build's leftover and is removed at once;
  one that another process holds open (a build that does not take this lock) is waited for, within the
  same bound. Where ``/proc`` cannot tell who holds it, no builder that takes this lock can, so it is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "chatsvc.lock"
BATON_NAME = "lock"  # torch.utils.cpp_extension's
# A build of the kernels takes about a minute on two cores; a wait ten times that long is not for a build.
BUILD_WAIT_S = 600.0
_POLL_S = 0.1
_BATON_POLL_S = 0.5  # each look walks /proc


class BuildLockTimeout(RuntimeError):
    """Another process kept a build directory locked for longer than the wait allows."""


def baton_holders(baton: Path) -> list[int] | None:
    """Pids of the processes that hold ``baton`` open (torch's builder keeps its descriptor open until the
    build ends), or None where ``/proc`` does not say. Processes of other users cannot be seen."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(baton)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
    return holders


def _owner(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return f"pid {int(os.pread(fd, 32, 0).decode().strip())}"
    return "another process"


def _acquire(fd: int, build_dir: Path, deadline: float, timeout_s: float) -> None:
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not waiting:
            waiting = True
            log.info("waiting for the build of %s in %s", _owner(fd), build_dir)
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(f"{build_dir} is still locked by the build of {_owner(fd)} after {timeout_s:.0f} s "
                                   f"({build_dir / LOCK_NAME}); stop that process or wait for it")
        time.sleep(_POLL_S)


def _clear_baton(baton: Path, deadline: float, timeout_s: float) -> None:
    while baton.exists():
        holders = baton_holders(baton)
        if not holders:
            log.warning("removing %s: the build that left it is gone", baton)
            with contextlib.suppress(FileNotFoundError):
                baton.unlink()
            return
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(f"{baton} is still held by pid {', '.join(map(str, holders))} after "
                                   f"{timeout_s:.0f} s (a build outside this lock); stop it or wait for it")
        time.sleep(_BATON_POLL_S)


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold ``build_dir``'s lock, with torch's baton there cleared, while the body builds or loads; raises
    ``BuildLockTimeout`` when a live process keeps either for ``timeout_s``."""
    build_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, build_dir, deadline, timeout_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # names the holder in a waiting process's message
        _clear_baton(build_dir / BATON_NAME, deadline, timeout_s)
        yield
    finally:
        os.close(fd)  # and with it the flock


__all__ = ["BATON_NAME", "BUILD_WAIT_S", "LOCK_NAME", "BuildLockTimeout", "baton_holders", "build_lock"]
