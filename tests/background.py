"""Long single-threaded jobs of the suite (a cold strict mypy run, a kernel build for another ISA), started as
subprocesses when collection ends so that they run while other tests wait on sockets, processes and
timers; the test that needs a job's result waits for it then. Run alone, a test starts its job itself.

The suite leaves about half of two cores idle on average, and these jobs take a minute or so each: started
in the test that needs them, they would add that minute to the wall time.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class _Job:
    argv: list[str]
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]


_jobs: dict[str, _Job] = {}


def start(name: str, argv: list[str]) -> None:
    """Start ``argv`` (run from the repository root) as the job ``name``, unless it is already running."""
    if name in _jobs:
        return
    # Files, not pipes: a job that writes more than a pipe holds would stop until its result is read.
    out = tempfile.TemporaryFile()  # noqa: SIM115 - open for the job's life, closed in result()/stop_all()
    err = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    _jobs[name] = _Job(argv, proc, out, err)


def result(name: str, argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """The finished job ``name`` (started now if nothing started it), its output as text."""
    start(name, argv)
    job = _jobs.pop(name)
    try:
        job.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        job.proc.kill()
        job.proc.wait()
        raise
    texts = []
    for f in (job.out, job.err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return subprocess.CompletedProcess(job.argv, job.proc.returncode, texts[0], texts[1])


def stop_all() -> None:
    """End the jobs no test collected their result of (a run stopped early, or deselected their tests)."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
        job.proc.wait()
        job.out.close()
        job.err.close()
    _jobs.clear()


PYTHON = sys.executable
STRICT_MYPY = [PYTHON, "-m", "mypy", "--strict", "engine", "kernels", "chatsvc"]


def kernel_build(isas: list[str]) -> list[str]:
    return [PYTHON, "-m", "kernels.cpu_kernels", *isas]
