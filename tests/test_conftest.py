"""The suite's own rules (tests/conftest.py): tests marked long run only with --run-long."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for name in ("conftest.py", "timing.py", "background.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_marked.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.mark.long
        def test_long() -> None:
            pass

        def test_short() -> None:
            pass
        """))
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nmarkers =\n    long: long\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "no:asyncio", "-c", str(ini), "--rootdir", str(tmp_path), *args, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_long_tests_are_skipped_with_the_reason_by_default(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 passed, 1 skipped" in proc.stdout
    assert ".ci/run runs it; pytest --run-long here" in proc.stdout


def test_run_long_runs_them(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "--run-long")
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-2000:]
    selected = run_pytest(tmp_path, "--run-long", "-m", "long")  # what .ci/run does after the default run
    assert "1 passed, 1 deselected" in selected.stdout, selected.stdout[-2000:]


def test_httpx_clients_share_the_default_ssl_context_only() -> None:
    """Default clients share one SSL context (the CA bundle loaded once); a client with its own verification
    gets its own, as httpx builds it."""
    import ssl

    import httpx
    from conftest import share_default_ssl_context

    share_default_ssl_context("httpx")  # done at start-up already; a second call changes nothing
    contexts = []
    for kw in ({}, {}, {"verify": False}, {"verify": ssl.create_default_context()}):
        with httpx.Client(**kw) as client:  # type: ignore[arg-type]
            contexts.append(client._transport._pool._ssl_context)  # type: ignore[attr-defined]
    assert contexts[0] is contexts[1] and contexts[0].verify_mode == ssl.CERT_REQUIRED
    assert contexts[2] is not contexts[0] and contexts[2].verify_mode == ssl.CERT_NONE
    assert contexts[3] is not contexts[0]
