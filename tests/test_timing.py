from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timing

HERE = Path(__file__).resolve().parent


def test_a_forced_scale_is_used_and_never_shortens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timing.SCALE_ENV, "2.5")
    assert timing.slowdown() == 2.5 and timing.scaled(10) == 25
    monkeypatch.setenv(timing.SCALE_ENV, "0.5")
    assert timing.slowdown() == 1.0


def test_the_measured_slowdown_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timing.SCALE_ENV, raising=False)
    assert 1.0 <= timing.slowdown() <= timing.MAX_SLOWDOWN
    monkeypatch.setattr(timing, "calibrated_slowdown", lambda: 50.0)
    assert timing.slowdown() == timing.MAX_SLOWDOWN


def test_load_beyond_the_cores_slows_in_proportion(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    assert timing.load_slowdown() == pytest.approx(3.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert timing.load_slowdown() == 1.0


def test_timeout_markers_are_scaled_when_a_test_starts(tmp_path: Path) -> None:
    """With the project's conftest, a 0.1 s marker on a 0.3 s test passes at a scale of 10, fails at 1."""
    for name in ("conftest.py", "timing.py", "background.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_sleep.py").write_text(textwrap.dedent("""\
        import time
        import pytest

        @pytest.mark.timeout(0.1)
        def test_sleeps() -> None:
            time.sleep(0.3)
        """))

    def run(scale: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:asyncio",
                               "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, timing.SCALE_ENV: scale})

    slow = run("10")
    assert slow.returncode == 0, slow.stdout[-2000:]
    assert "time limits x10.00" in slow.stdout
    strict = run("1")
    assert strict.returncode == 1 and "Timeout" in strict.stdout, strict.stdout[-2000:]
