"""benchmarks/soak_split.py, compressed: two gateways and two workers on a Redis master, replica and Sentinel,
through every fault of the schedule (rolling SIGTERM restarts, kill -9s, a Sentinel failover, a hostile burst)
in a few minutes; its report's checks all pass. benchmarks/soak.py's client code, which it shares, judges the
turns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import outcome  # noqa: E402

CHECKS = {"no_turn_lost", "no_reply_cut_by_rolling_restarts", "every_fault_ran", "hostile_refused",
          "no_5xx_outside_faults", "redis_keys_bounded", "redis_memory_bounded", "kv_free_at_idle"}


def test_a_reply_is_whole_only_when_it_ended_as_its_client_asked() -> None:
    assert outcome({"type": "done", "finish_reason": "stop"}, False) == "whole"
    assert outcome({"type": "done", "finish_reason": "length"}, False) == "whole"
    assert outcome({"type": "done", "finish_reason": "abort"}, True) == "whole"  # the client's own cancel
    assert outcome({"type": "done", "finish_reason": "abort"}, False) == "finish_abort"
    assert outcome({"type": "done", "finish_reason": "interrupted"}, False) == "finish_interrupted"
    assert outcome({"type": "error", "code": "draining"}, False) == "error_draining"


@pytest.mark.long  # 4 chatsvc processes and 3 redis-servers restarted through ten faults: minutes
@pytest.mark.integration
@pytest.mark.timeout(1500)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_compressed_split_soak_passes_every_check() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/soak_split.py", "--duration-s", "150", "--clients", "4", "--max-tokens", "32",
         "--burst-s", "15", "--settle-s", "3", "--drain-timeout-s", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=1450)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["checks"]) == CHECKS
    assert report["ok"] and proc.returncode == 0, (report["checks"], proc.stderr[-3000:])
    assert report["turns_accepted"] > 0 and report["turns_checked"] == report["turns_accepted"]
    assert report["lost"] == report["duplicated"] == report["replies_cut_by_rolling_restarts"] == 0
    kinds = [w[0] for w in report["windows"]]
    assert kinds.count("sigterm") == 4 and kinds.count("kill9") == 4 and kinds.count("failover") == 1
    assert report["ttft_p99_before_burst_s"] is not None and report["ttft_p99_during_burst_s"] is not None
    assert report["machine"]["cores"] >= 1
