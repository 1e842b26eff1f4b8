"""The Dockerfile's build steps, run here: each instruction is carried out in a scratch directory as the
image build would (ENV and ARG defaults set, COPY from this checkout honouring .dockerignore, RUN through
/bin/sh), with stubs for what needs root or the network (apt-get, useradd, pip) and for the kernel build
itself; then the checks of what the image holds. A real ``docker build`` runs too where a Docker engine
answers. scripts/build_kernels.sh, the kernel step, is tested on its own below."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions, continuation lines joined and comment lines (also those inside a continued
    instruction, which Docker drops) left out."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    return out


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore pattern leaves out ``path`` or a directory above it (no ``!`` exceptions)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, p) or (p.startswith("**/") and fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], p[3:]))
               for prefix in prefixes for p in patterns)


# Stubs: each logs "<name> <args>" to $STUB_LOG. python runs the real interpreter except for the kernel
# build, which fails with SIGILL's exit status for ISAs this "CPU" lacks, after leaving the library as torch
# would.
STUB = textwrap.dedent("""\
    #!/bin/bash
    echo "$(basename "$0") $*" >> "$STUB_LOG"
    """)
PYTHON_STUB = textwrap.dedent("""\
    #!/bin/bash
    if [ "$1 $2" = "-m kernels.cpu_kernels" ]; then
        echo "python $* user=$STUB_USER cwd=$PWD" >> "$STUB_LOG"
        name="chatsvc_cpu_kernels_$3"
        mkdir -p "$HOME/.cache/torch_extensions/py311_cpu/$name"
        touch "$HOME/.cache/torch_extensions/py311_cpu/$name/$name.so"
        case " $STUB_CPU_ISAS " in *" $3 "*) echo "built $name.so"; exit 0 ;; *) exit 132 ;; esac
    fi
    exec {real} "$@"
    """)


@dataclass
class Build:
    """What carrying out the Dockerfile left: the commands run (in order, with the user they ran as) and
    the image's filesystem under ``root``."""

    root: Path
    calls: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    user: str = "root"
    cmd: list[str] = field(default_factory=list)

    def called(self, prefix: str) -> list[str]:
        return [c for c in self.calls if c.startswith(prefix)]


def carry_out(dockerfile: Path, scratch: Path, build_args: dict[str, str] | None = None,
              cpu_isas: str = "avx2") -> Build:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().split() if not p.startswith("#")]
    root = scratch / "image"
    stubs = scratch / "stubs"
    stubs.mkdir(parents=True)
    for name in ("apt-get", "useradd", "pip"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    (stubs / "python").write_text(PYTHON_STUB.format(real=shlex.quote(sys.executable)))
    (stubs / "python").chmod(0o755)
    log = scratch / "calls.log"
    log.touch()
    build = Build(root=root)
    build.env = {"PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_CPU_ISAS": cpu_isas}
    workdir = root
    for ins in instructions(dockerfile.read_text()):
        if ins.keyword == "FROM":
            build.env["BASE_IMAGE"] = ins.args
        elif ins.keyword in ("ENV", "ARG"):
            for item in shlex.split(ins.args):
                name, _, value = item.partition("=")
                if ins.keyword == "ARG" and build_args and name in build_args:
                    value = build_args[name]
                build.env[name] = value
        elif ins.keyword == "WORKDIR":
            workdir = root / ins.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            *sources, dest = shlex.split(ins.args)
            target = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
            for src in sources:
                if src == ".":
                    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
                    for f in files:
                        if (ROOT / f).is_file() and not dockerignored(f, patterns):
                            (target / f).parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(ROOT / f, target / f)
                else:
                    assert (ROOT / src).is_file(), f"COPY {src}: no such file"
                    assert not dockerignored(src, patterns), f"COPY {src}: .dockerignore leaves it out"
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / src, target / src)
        elif ins.keyword == "USER":
            build.user = ins.args
        elif ins.keyword == "RUN":
            home = root / ("root" if build.user == "root" else f"home/{build.user}")
            home.mkdir(parents=True, exist_ok=True)
            env = {**build.env, "HOME": str(home), "STUB_USER": build.user}
            proc = subprocess.run(["/bin/sh", "-c", ins.args], cwd=workdir, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, f"RUN {ins.args}\n{proc.stdout}{proc.stderr}"
        elif ins.keyword == "CMD":
            build.cmd = json.loads(ins.args)
        else:
            assert ins.keyword in ("EXPOSE", "HEALTHCHECK", "LABEL"), f"not carried out here: {ins.keyword}"
    build.calls = log.read_text().splitlines()
    return build


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return carry_out(ROOT / "Dockerfile", tmp_path_factory.mktemp("docker"))


def test_the_base_is_debian_python_3_11(build: Build) -> None:
    assert build.env["BASE_IMAGE"].startswith("python:3.11-slim")


def test_the_compiler_is_installed_before_anything_is_built(build: Build) -> None:
    (install,) = [c for c in build.called("apt-get") if " install " in c]
    assert {"g++", "redis-server"} <= set(install.split())
    assert build.calls.index(install) < build.calls.index(build.called("python -m kernels.cpu_kernels")[0])


def test_dependencies_are_the_lock_and_the_cpu_torch_at_pyprojects_pin(build: Build) -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch"))
    (locked,) = [c for c in build.called("pip install") if "-r requirements.lock" in c]
    assert f"--extra-index-url {CPU_INDEX}" in locked
    assert locked.split()[-1] == torch_pin
    assert "pip install --no-deps -e ." in build.calls  # the project itself adds nothing unlocked


def test_the_kernels_are_built_at_build_time_for_each_isa_as_the_user_that_runs_them(build: Build) -> None:
    kernel_builds = build.called("python -m kernels.cpu_kernels")
    assert [c.split()[3] for c in kernel_builds] == ["avx2", "avx512", "avx512bf16"]
    assert all("user=chatsvc cwd=" in c and c.endswith("/app") for c in kernel_builds)
    ext = build.root / "home" / "chatsvc" / ".cache" / "torch_extensions" / "py311_cpu"
    for isa in ("avx2", "avx512", "avx512bf16"):
        assert (ext / f"chatsvc_cpu_kernels_{isa}" / f"chatsvc_cpu_kernels_{isa}.so").is_file()


def test_one_isa_build_by_build_arg(tmp_path: Path) -> None:
    build = carry_out(ROOT / "Dockerfile", tmp_path, build_args={"KERNEL_ISAS": "avx512bf16"},
                      cpu_isas="avx2 avx512 avx512bf16")
    assert [c.split()[3] for c in build.called("python -m kernels.cpu_kernels")] == ["avx512bf16"]


def test_the_image_runs_as_a_non_root_user(build: Build) -> None:
    assert build.user not in ("root", "0", "")
    assert build.called(f"useradd --create-home --uid 1000 {build.user}")


def test_the_image_serves_with_the_installed_project(build: Build) -> None:
    assert build.cmd[:2] == ["chatsvc", "serve"]
    app = build.root / "app"
    for path in ("requirements.lock", "scripts/build_kernels.sh", "kernels/csrc/cpu_kernels.cpp", "web"):
        assert (app / path).exists(), path
    assert not (app / ".venv").exists() and not (app / ".git").exists()


def test_dockerignored_follows_directories() -> None:
    patterns = [".venv", "**/__pycache__", "*.egg-info", "benchmarks/results"]
    assert dockerignored(".venv/bin/python", patterns)
    assert dockerignored("engine/__pycache__/core.cpython-311.pyc", patterns)
    assert dockerignored("chatsvc.egg-info/PKG-INFO", patterns)
    assert dockerignored("benchmarks/results/x.json", patterns)
    assert not dockerignored("benchmarks/machine.py", patterns)
    assert not dockerignored("requirements.lock", patterns)


def test_instructions_parse_continuations_and_comments() -> None:
    text = "FROM x\n# c\nRUN a \\\n # inside\n && b\nCMD [\"c\"]\n"
    assert instructions(text) == [Instruction("FROM", "x"), Instruction("RUN", "a  && b"),
                                  Instruction("CMD", '["c"]')]


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not _docker_engine(), reason="no Docker engine answers here")
def test_docker_build_builds_the_image() -> None:
    proc = subprocess.run(["docker", "build", "--build-arg", "KERNEL_ISAS=avx2", "-t", "chatsvc:test", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = subprocess.run(["docker", "run", "--rm", "chatsvc:test", "python", "-c",
                          "import kernels.cpu_kernels as k; print(k.load_extension('avx2').__name__)"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "chatsvc_cpu_kernels_avx2" in run.stdout, run.stderr[-4000:]


# scripts/build_kernels.sh with a stub python: "built" for the ISAs the stub's CPU runs, SIGILL for the rest.
def run_build_kernels(tmp_path: Path, *isas: str, cpu_isas: str = "avx2", leaves_library: bool = True,
                      fails: str = "") -> subprocess.CompletedProcess[str]:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "build_kernels.sh", project / "scripts")
    python = tmp_path / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        name="chatsvc_cpu_kernels_$3"
        case " {fails} " in *" $3 "*) echo "Error building extension '$name'" >&2; exit 1 ;; esac
        {"mkdir -p $TORCH_EXTENSIONS_DIR/$name && touch $TORCH_EXTENSIONS_DIR/$name/$name.so" if leaves_library else ":"}
        case " {cpu_isas} " in *" $3 "*) echo "built $name.so"; exit 0 ;; *) kill -ILL $$ ;; esac
        """))
    python.chmod(0o755)
    return subprocess.run(["bash", str(project / "scripts" / "build_kernels.sh"), *isas], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(python), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})


def test_build_kernels_counts_a_build_this_cpu_cannot_load(tmp_path: Path) -> None:
    proc = run_build_kernels(tmp_path, "avx2", "avx512")
    assert proc.returncode == 0, proc.stderr
    assert "built chatsvc_cpu_kernels_avx2.so" in proc.stdout
    assert "chatsvc_cpu_kernels_avx512.so (this CPU cannot run avx512" in proc.stderr


def test_build_kernels_fails_on_a_failed_build(tmp_path: Path) -> None:
    proc = run_build_kernels(tmp_path, "avx2", "avx512", fails="avx2")
    assert proc.returncode == 1
    assert "the avx2 build failed (exit 1)" in proc.stderr


def test_build_kernels_fails_on_a_crash_without_a_library(tmp_path: Path) -> None:
    proc = run_build_kernels(tmp_path, "avx512", leaves_library=False)
    assert proc.returncode == 1
    assert "the avx512 build failed (exit 132)" in proc.stderr


def test_build_kernels_needs_an_isa(tmp_path: Path) -> None:
    assert run_build_kernels(tmp_path).returncode == 2
