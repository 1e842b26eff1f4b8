"""The lock files (scripts/lock.sh writes them with uv) agree with pyproject.toml: every declared requirement
is pinned at a version it allows, nothing is pinned for a requirement pyproject.toml no longer has, and the
runtime lock is the development lock's runtime part at the same versions."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "chatsvc"
# What scripts/lock.sh resolves for; a marker is judged as uv judged it there.
LOCK_ENV = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "os_name": "posix"}
# Left out of the locks on purpose (scripts/lock.sh): the index a machine installs from picks torch's build.
UNLOCKED = {"torch"}


@dataclass(frozen=True)
class Pin:
    version: Version
    via: frozenset[str]  # canonical names of the packages that need it; "chatsvc" for pyproject.toml


def parse_lock(path: Path) -> dict[str, Pin]:
    """``name==version`` lines with uv's ``# via`` annotations under them."""
    pins: dict[str, tuple[Version, set[str]]] = {}
    current: str | None = None
    for line in path.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line.strip())
            assert m, f"{path.name}: not an exact pin: {line!r}"
            current = canonicalize_name(m.group(1))
            assert current not in pins, f"{path.name}: {current} pinned twice"
            pins[current] = (Version(m.group(2)), set())
            continue
        via = re.fullmatch(r"\s+#\s+(?:via\s+)?(?:#\s+)?(.+?)\s*", line)
        if current is None or via is None or via.group(1) in ("via",):
            continue
        text = via.group(1)
        if text.startswith("-c "):
            continue  # the constraint file the dev lock is resolved within, not a reason to install
        pins[current][1].add(PROJECT if text.startswith(f"{PROJECT} (") else canonicalize_name(text))
    return {name: Pin(version, frozenset(via)) for name, (version, via) in pins.items()}


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """pyproject.toml's requirements that apply on the locked platform, the extras' included (a
    ``chatsvc[...]`` self-reference is expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in project["optional-dependencies"][extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                reqs.append(req)
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LOCK_ENV)]


LOCKS = {"requirements.lock": (), "requirements-dev.lock": ("dev", "bench")}


@pytest.mark.parametrize("lock_name", sorted(LOCKS))
def test_every_requirement_is_pinned_at_a_version_it_allows(lock_name: str) -> None:
    pins = parse_lock(ROOT / lock_name)
    for req in requirements(LOCKS[lock_name]):
        name = canonicalize_name(req.name)
        if name in UNLOCKED:
            continue
        assert name in pins, f"{lock_name} lacks {req}: run scripts/lock.sh"
        assert req.specifier.contains(pins[name].version, prereleases=True), (
            f"{lock_name} pins {name}=={pins[name].version}, outside {req}: run scripts/lock.sh")


@pytest.mark.parametrize("lock_name", sorted(LOCKS))
def test_nothing_is_pinned_that_no_requirement_needs(lock_name: str) -> None:
    """A pin whose only reason is pyproject.toml must name a requirement it still has, and every other pin
    must be needed by a locked package (or by torch, whose dependencies are locked without it)."""
    pins = parse_lock(ROOT / lock_name)
    direct = {canonicalize_name(r.name) for r in requirements(LOCKS[lock_name])}
    for name, pin in pins.items():
        assert pin.via, f"{lock_name}: no reason given for {name}"
        if PROJECT in pin.via:
            assert name in direct, f"{lock_name} pins {name} for pyproject.toml, which no longer asks for it"
        others = pin.via - {PROJECT}
        assert not others or others & (pins.keys() | UNLOCKED), (
            f"{lock_name}: {name} is pinned for {sorted(others)}, none of them locked")


def test_the_runtime_lock_is_the_dev_locks_runtime_part() -> None:
    runtime = parse_lock(ROOT / "requirements.lock")
    dev = parse_lock(ROOT / "requirements-dev.lock")
    for name, pin in runtime.items():
        assert name in dev, f"requirements-dev.lock lacks {name}"
        assert dev[name].version == pin.version, f"{name}: {pin.version} at runtime, {dev[name].version} in dev"


def test_torch_is_pinned_exactly_and_left_to_the_install_index() -> None:
    """torch's CPU and CUDA builds differ in name (+cpu) and dependencies (CUDA libraries), so the locks
    leave it out; pyproject.toml pins its version exactly, which both builds satisfy."""
    (torch,) = [r for r in requirements(()) if canonicalize_name(r.name) == "torch"]
    assert [s.operator for s in torch.specifier] == ["=="]
    for lock_name in LOCKS:
        pins = parse_lock(ROOT / lock_name)
        assert "torch" not in pins
        assert not [n for n in pins if n.startswith("nvidia-")], f"{lock_name} holds CUDA libraries"
        assert "filelock" in pins and "sympy" in pins, f"{lock_name} lacks torch's own dependencies"


def test_the_locks_name_the_command_that_writes_them() -> None:
    for lock_name in LOCKS:
        head = (ROOT / lock_name).read_text().splitlines()[:3]
        assert "#    scripts/lock.sh" in head, f"{lock_name} was not written by scripts/lock.sh"


def test_parse_lock_reads_uv_annotations(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text("# header\nanyio==4.1.0\n    # via\n    #   -c requirements.lock\n    #   starlette\n"
                    "    #   chatsvc (pyproject.toml)\nstarlette==0.40.0\n    # via chatsvc (pyproject.toml)\n")
    assert parse_lock(lock) == {"anyio": Pin(Version("4.1.0"), frozenset({"starlette", PROJECT})),
                                "starlette": Pin(Version("0.40.0"), frozenset({PROJECT}))}
    lock.write_text("anyio>=4\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        parse_lock(lock)
