"""benchmarks/session_return.py --quick: the real model through every phase (recompute, tiers, warm,
restart), its record's last line, and the tiers actually serving the returning turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import machine  # noqa: E402


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)  # ~30 s on an idle 2-core machine (four engine starts); minutes when it is shared
def test_quick_run_writes_a_record_whose_returns_come_from_the_tiers(tmp_path: Path) -> None:
    record = tmp_path / "record.txt"
    proc = subprocess.run([sys.executable, "benchmarks/session_return.py", "--quick", "--output", str(record),
                           "--disk-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = record.read_text()
    assert "machine: " in text and "command: " in text and "uptime (1, 5, 15-min load) before" in text
    last = json.loads(text.strip().splitlines()[-1])
    # --dtype auto: bf16 where oneDNN runs it natively (AVX512-BF16, AMX), float32 elsewhere
    assert last["quick"] and last["cores"] >= 1 and last["dtype"] == machine.resolve_dtype("auto")
    run = last["lengths"]["64"]
    # The pool forgot the sessions: a return recomputed all but the system prompt's block they share, give or
    # take one block that outlived its turn in the eviction order (the pool evicts a cold block next to a
    # growing table before the least recently freed one: engine.block_pool).
    assert run["off_cached_tokens"]["p50"] <= 16 and run["off_cached_tokens"]["max"] <= 32
    assert run["tiers_cached_tokens"]["p50"] >= 48  # the history's full blocks came back from host or disk
    # Each session's three history blocks past the shared one, from host or disk (a block or two may still be
    # on the device, as above).
    assert run["tiers_hits"]["host_hit_blocks"] + run["tiers_hits"]["disk_hit_blocks"] >= 3 * 4 - 2
    assert run["warm_hits"]["warm_read_blocks"] + run["warm_hits"]["warm_loaded_blocks"] > 0
    assert run["restart_cached_tokens"]["p50"] >= 48
    assert set(last["ratios"]) >= {"recompute_over_tiers_p50", "recompute_over_warm_p50", "restart_over_tiers_p50"}
