"""The codebase's own rules, checked like behaviour: ruff and mypy pass, and the import graph keeps its layers.

Layers (vLLM v1's): policy and accounting (scheduler, block manager, block pool, plan, config,
request) import no torch; mechanism (runner, model, kernels) never imports policy; the engine
package never imports the gateway; no module imports a transport of the gateway other than the
app that mounts it; and there are no import cycles.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "chatsvc")
STRICT_PACKAGES = ("engine", "kernels", "chatsvc")
TORCH_FREE = {"engine.block_pool", "engine.block_manager", "engine.scheduler", "engine.plan", "engine.config",
              "engine.kv_tiers", "engine.kv_disk",
              "engine.request", "engine.protocol", "engine.client", "engine.local_client", "engine.streams"}
MECHANISM = ("engine.runner", "engine.model", "kernels")
POLICY = {"engine.scheduler"}
TRANSPORTS = {"chatsvc.ws", "chatsvc.openai_routes", "chatsvc.sessions"}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules imported at module level or in functions (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return {m for m in out if m in known or m.split(".")[0] == "torch"}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, name, known) for name, path in mods.items()}


def test_policy_and_accounting_import_no_torch(graph: dict[str, set[str]]) -> None:
    for mod in TORCH_FREE:
        assert not {m for m in graph[mod] if m.split(".")[0] == "torch"}, f"{mod} imports torch"
        assert not graph[mod] & {m for m in graph if m.startswith(MECHANISM)}, f"{mod} imports mechanism"


def test_mechanism_does_not_import_policy(graph: dict[str, set[str]]) -> None:
    for mod, deps in graph.items():
        if mod.startswith(MECHANISM):
            assert not deps & POLICY, f"{mod} imports {deps & POLICY}"


def test_engine_does_not_import_the_gateway(graph: dict[str, set[str]]) -> None:
    for mod, deps in graph.items():
        if mod.startswith(("engine", "kernels")):
            assert not {d for d in deps if d.startswith("chatsvc")}, mod


def test_no_transport_imports_another(graph: dict[str, set[str]]) -> None:
    for mod in TRANSPORTS:
        assert not graph.get(mod, set()) & (TRANSPORTS - {mod}), f"{mod} imports {graph[mod] & TRANSPORTS}"


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    project = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    # A package's __init__ importing its own submodules is how packages re-export; not a cycle.
    edges = {m: {d for d in deps if not m or not d.startswith(m + ".")} for m, deps in project.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


@pytest.mark.slow
def test_ruff_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def strict_mypy() -> subprocess.CompletedProcess[str]:
    """Started when collection ended (tests/background.py): a cold run takes about a minute."""
    assert background.STRICT_MYPY[-len(STRICT_PACKAGES):] == list(STRICT_PACKAGES)
    return background.result("mypy-strict", background.STRICT_MYPY)


@pytest.mark.slow
def test_mypy_passes(strict_mypy: subprocess.CompletedProcess[str]) -> None:
    # --strict adds checks to the configuration's and the files are the same, so its pass is this one's;
    # only where it fails is the configuration's own run needed (a cold mypy run costs tens of seconds).
    if strict_mypy.returncode == 0 and set(STRICT_PACKAGES) == set(_mypy_files()):
        return
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _mypy_files() -> list[str]:
    import tomllib

    files: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    return files


@pytest.mark.slow
def test_mypy_is_strict_on_the_engine_kernels_and_gateway(strict_mypy: subprocess.CompletedProcess[str]) -> None:
    """The engine, kernels and gateway packages pass ``--strict``: no untyped defs, no Any leaking out of
    torch calls or parsed JSON."""
    assert strict_mypy.returncode == 0, strict_mypy.stdout[-4000:] + strict_mypy.stderr[-2000:]
