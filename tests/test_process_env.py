"""engine/process_env.py: the engine process's allocator and OpenMP settings, applied only around its start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.process_env import ENGINE_SPINCOUNT, child_environment, environ, find_tcmalloc, omp_wait_policy


def test_tcmalloc_is_found_and_the_child_environment_is_set_only_around_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libtcmalloc.so.4").touch()
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").touch()
    assert find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/y/libother.so")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = child_environment("/x/libtcmalloc.so")
    assert env == {"LD_PRELOAD": "/x/libtcmalloc.so:/y/libother.so", "GOMP_SPINCOUNT": ENGINE_SPINCOUNT,
                   "THP_MEM_ALLOC_ENABLE": "1"}
    with environ(env):
        assert os.environ["LD_PRELOAD"].split(":")[0] == "/x/libtcmalloc.so"
        assert os.environ["GOMP_SPINCOUNT"] == ENGINE_SPINCOUNT
    assert os.environ["LD_PRELOAD"] == "/y/libother.so" and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's choice is kept
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert child_environment(None) == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")  # so is a bounded spin
    assert child_environment(None) == {}


def test_the_omp_wait_policy_reads_what_the_environment_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert omp_wait_policy() == "default"
    monkeypatch.setenv("GOMP_SPINCOUNT", ENGINE_SPINCOUNT)
    assert omp_wait_policy() == f"GOMP_SPINCOUNT={ENGINE_SPINCOUNT}"
