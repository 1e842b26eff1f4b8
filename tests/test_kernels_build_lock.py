"""One build at a time per build directory, with real processes holding the locks: a lock left by a killed
build (torch's baton, or ours) costs nothing, a live builder is waited for only up to the bound and then
named, and a real load of the C++ kernels goes through a killed build's leftover at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_kernels
from kernels.build_lock import BATON_NAME, LOCK_NAME, BuildLockTimeout, baton_holders, build_lock

ROOT = Path(__file__).resolve().parent.parent

# torch's FileBaton: created with O_EXCL and kept open for the whole build.
HOLD_BATON = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)
print("held", flush=True)
time.sleep(120)
"""

HOLD_LOCK = """
import sys, time
from pathlib import Path
from kernels.build_lock import build_lock
with build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def _hold(code: str, path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_baton_no_process_holds_is_removed_at_once(tmp_path: Path) -> None:
    (tmp_path / BATON_NAME).touch()  # what a build killed midway leaves, however young
    assert baton_holders(tmp_path / BATON_NAME) == []
    started = time.monotonic()
    with build_lock(tmp_path, timeout_s=30):
        assert not (tmp_path / BATON_NAME).exists()
    assert time.monotonic() - started < 2


def test_a_baton_a_live_build_holds_is_waited_for_up_to_the_bound_then_cleared_once_it_dies(tmp_path: Path) -> None:
    holder = _hold(HOLD_BATON, tmp_path / BATON_NAME)
    try:
        assert baton_holders(tmp_path / BATON_NAME) == [holder.pid]
        started = time.monotonic()
        with pytest.raises(BuildLockTimeout, match=f"held by pid {holder.pid}"), build_lock(tmp_path, timeout_s=1):
            pytest.fail("entered while a live build held the baton")
        assert 1 <= time.monotonic() - started < 5
        assert (tmp_path / BATON_NAME).exists()  # a live build's baton is never taken from it
    finally:
        _kill(holder)
    with build_lock(tmp_path, timeout_s=5):
        assert not (tmp_path / BATON_NAME).exists()


def test_a_second_builder_waits_for_a_live_first_and_not_at_all_for_a_killed_one(tmp_path: Path) -> None:
    holder = _hold(HOLD_LOCK, tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(holder.pid)
        with pytest.raises(BuildLockTimeout, match=f"build of pid {holder.pid}"), build_lock(tmp_path, timeout_s=0.5):
            pytest.fail("entered while another build held the lock")
    finally:
        _kill(holder)  # no cleanup runs: the kernel drops its flock
    started = time.monotonic()
    with build_lock(tmp_path, timeout_s=30):
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    assert time.monotonic() - started < 2


@pytest.mark.timeout(120)
def test_loading_the_kernels_goes_through_a_killed_builds_leftover_lock(tmp_path: Path) -> None:
    """The cached build, copied under another TORCH_EXTENSIONS_DIR with a baton no process holds: a new
    process loads it at once (torch alone would wait for that baton forever)."""
    built = Path(cpu_kernels.load_extension().__file__ or "").parent  # built here if it was not yet
    copy = tmp_path / "extensions" / built.name
    shutil.copytree(built, copy)  # timestamps kept: nothing to rebuild
    for leftover in (BATON_NAME, LOCK_NAME):
        (copy / leftover).unlink(missing_ok=True)
    (copy / BATON_NAME).touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    code = "from kernels import cpu_kernels; print(cpu_kernels.load_extension().__file__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).parent == copy
    assert not (copy / BATON_NAME).exists()
