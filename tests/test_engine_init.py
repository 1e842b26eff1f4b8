"""The ``engine`` package turns on torch's huge-page allocator before torch allocates anything, unless the
operator chose: checked in fresh interpreters, since torch reads the setting once, at its first allocation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Imports the package, then writes a 64 MiB tensor; prints the variable and the process's AnonHugePages.
PROBE = """
import json, engine, torch
x = torch.empty(16 << 20)
x.fill_(1.0)
huge = next(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:"))
print(json.dumps({"env": __import__("os").environ.get("THP_MEM_ALLOC_ENABLE"), "huge": huge}))
"""


def thp_available() -> bool:
    try:
        return "[never]" not in THP.read_text() and Path("/proc/self/smaps_rollup").exists()
    except OSError:
        return False


def probe(env_value: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_importing_engine_puts_large_tensors_on_huge_pages() -> None:
    got = probe(None)
    assert got["env"] == "1"
    if not thp_available():
        pytest.skip("this kernel gives no transparent huge pages (THP 'never' or no /proc)")
    assert int(got["huge"]) >= 32 << 20  # type: ignore[call-overload]


def test_an_operators_setting_wins() -> None:
    got = probe("0")
    assert got == {"env": "0", "huge": 0}
