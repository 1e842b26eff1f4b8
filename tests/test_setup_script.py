"""scripts/setup.sh on machines it cannot see from here: each case runs the real script in a copy of the
project whose commands (apt-get, the system python3, the venv's python and pip, the compiler) are stubs that
record their calls, on a PATH that holds nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("bash", "basename", "dirname", "id", "mktemp", "rm", "tail", "touch", "mkdir", "cp")
BUILD_PACKAGES = ("python3-venv", "g++", "python3-dev")

# One stub for every command: it logs its name and arguments, and acts as the case's STUB_* variables say.
STUB = textwrap.dedent("""\
    #!/bin/bash
    name=$(basename "$0")
    [ "$name" = python ] && [ "$(basename "$(dirname "$(dirname "$0")")")" = .venv ] && name=venv-python
    [ "$name" = pip ] && name=venv-pip
    echo "$name $*" >> "$STUB_LOG"
    case "$name $*" in
      "sudo "*) exec "$@" ;;
      "python3 -m venv "*) mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; cp "$0" "$3/bin/pip"; exit 0 ;;
      *"import ensurepip"*) exit "${STUB_NO_ENSUREPIP:-0}" ;;
      *Python.h*) exit "${STUB_NO_HEADERS:-0}" ;;
      *tomllib*) echo "torch==2.13.0" ;;
      "venv-python -m kernels.cpu_kernels --testable")
        if [ -n "${STUB_BUILD_FAILS:-}" ]; then echo "c++: fatal error: Python.h: No such file" >&2; exit 1; fi
        echo "built /cache/chatsvc_cpu_kernels_avx2/chatsvc_cpu_kernels_avx2.so"
        echo "built /cache/chatsvc_cpu_kernels_generic/chatsvc_cpu_kernels_generic.so" ;;
    esac
    exit 0
    """)


@dataclass
class Run:
    rc: int
    stderr: str
    calls: list[str]

    def called(self, prefix: str) -> list[str]:
        return [c for c in self.calls if c.startswith(prefix)]


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """A copy of the project's files setup.sh reads, an installed .venv of stubs, and a bin dir."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    for name in ("pyproject.toml", "requirements-dev.lock"):
        shutil.copy(ROOT / name, project / name)
    stub = tmp_path / "stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    for cmd in ("python3", "apt-get", "sudo", "g++", "redis-server", "docker-compose"):
        shutil.copy(stub, bin_dir / cmd)
    venv_bin = project / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    shutil.copy(stub, venv_bin / "python")
    shutil.copy(stub, venv_bin / "pip")
    stamp = project / ".venv" / ".chatsvc-installed"
    stamp.touch()
    later = time.time() + 60  # installed after the lock and pyproject.toml were last written
    os.utime(stamp, (later, later))
    return tmp_path


def run_setup(sandbox: Path, **env: str) -> Run:
    log = sandbox / "calls.log"
    log.write_text("")
    proc = subprocess.run(
        [str(sandbox / "bin" / "bash"), str(sandbox / "project" / "scripts" / "setup.sh")],
        env={"PATH": str(sandbox / "bin"), "HOME": str(sandbox), "STUB_LOG": str(log), **env},
        capture_output=True, text=True, timeout=60)
    return Run(proc.returncode, proc.stderr, log.read_text().splitlines())


def test_an_installed_machine_builds_nothing_and_names_the_kernels(sandbox: Path) -> None:
    run = run_setup(sandbox)
    assert run.rc == 0, run.stderr
    # chromium and tcmalloc are looked for at fixed paths, so this machine decides whether apt-get runs.
    assert not [c for c in run.called("apt-get") for p in BUILD_PACKAGES if f" {p}" in c]
    assert not run.called("venv-pip")
    assert ("C++ CPU kernels ready: /cache/chatsvc_cpu_kernels_avx2/chatsvc_cpu_kernels_avx2.so"
            " /cache/chatsvc_cpu_kernels_generic/chatsvc_cpu_kernels_generic.so\n") in run.stderr


def test_a_stock_debian_gets_the_compiler_headers_and_venv(sandbox: Path) -> None:
    (sandbox / "bin" / "g++").unlink()
    shutil.rmtree(sandbox / "project" / ".venv")
    run = run_setup(sandbox, STUB_NO_ENSUREPIP="1", STUB_NO_HEADERS="1")
    assert run.rc == 0, run.stderr
    (install,) = [c for c in run.called("apt-get") if " install " in c]
    for package in BUILD_PACKAGES:
        assert f" {package}" in install, install
    assert "python3 -m venv .venv" in run.calls
    assert run.calls.index("python3 -m venv .venv") > run.calls.index(install)


def test_a_changed_lock_reinstalls_from_it_with_the_cpu_torch(sandbox: Path) -> None:
    (sandbox / "project" / "requirements-dev.lock").touch()
    os.utime(sandbox / "project" / ".venv" / ".chatsvc-installed", (0, 0))
    run = run_setup(sandbox)
    assert run.rc == 0, run.stderr
    (locked,) = [c for c in run.called("venv-pip install") if "-r requirements-dev.lock" in c]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in locked and locked.endswith(" torch==2.13.0")
    assert "venv-pip install -q --no-deps -e ." in run.calls
    assert (sandbox / "project" / ".venv" / ".chatsvc-installed").stat().st_mtime > 0

    os.utime(sandbox / "project" / ".venv" / ".chatsvc-installed", (0, 0))
    run = run_setup(sandbox, TORCH_INDEX="")
    (locked,) = [c for c in run.called("venv-pip install") if "-r requirements-dev.lock" in c]
    assert "--extra-index-url" not in locked


def test_kernels_that_do_not_build_stop_the_set_up_loudly(sandbox: Path) -> None:
    run = run_setup(sandbox, STUB_BUILD_FAILS="1")
    assert run.rc == 1
    assert "Python.h: No such file" in run.stderr  # the compiler's own words
    assert "the C++ CPU kernels did not build" in run.stderr
    assert "CHATSVC_ALLOW_TORCH_KERNELS=1" in run.stderr


def test_the_torch_kernels_only_when_asked_for(sandbox: Path) -> None:
    run = run_setup(sandbox, STUB_BUILD_FAILS="1", CHATSVC_ALLOW_TORCH_KERNELS="1")
    assert run.rc == 0, run.stderr
    assert "WARNING: the C++ CPU kernels did not build" in run.stderr
    assert "torch reference kernels" in run.stderr


def test_without_apt_the_missing_packages_are_named(sandbox: Path) -> None:
    (sandbox / "bin" / "apt-get").unlink()
    (sandbox / "bin" / "g++").unlink()
    run = run_setup(sandbox)
    assert run.rc == 1
    assert "install g++" in run.stderr
    assert not run.called("venv-python -m kernels")
