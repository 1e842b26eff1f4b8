"""The engine's decode step with torch's large CPU allocations on 2 MiB pages and on 4 KiB pages, side by side.

Whether torch's transparent-huge-page allocator (``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB and more
2 MiB-aligned and advised ``MADV_HUGEPAGE``) would make the engine faster. A decode step streams every
weight (~270 MB in bf16) and reads KV blocks from all over the pool, tens of thousands of 4 KiB pages a
step, so TLB misses were a suspect; the engine does not set the variable (this measured no gain on the
2-core EPYC VM: benchmarks/results/huge_pages.txt). torch reads the variable at its first allocation, so each side is a
process of its own (``THP_MEM_ALLOC_ENABLE=1`` vs ``=0``), both up together: each builds the engine (real
model, dtype ``auto``) and brings the same ``rows`` sequences of 128 random prompt tokens to pure decode,
then the two take turns one decode step at a time (``--steps`` each, the first of each pair alternating).
Taking turns step by step keeps the comparison inside the same seconds: this 2-core VM's speed swings
between minutes (separate runs a minute apart measured this same comparison at 1.07x and 0.97x).

Usage: python benchmarks/huge_pages.py [--rows 32,64] [--steps 200] [--output FILE]
Last line: one JSON object {"step_ms": {rows: {"huge": median, "small": median}}, "small_over_huge": {rows:
median over step pairs of small/huge}, "steps", "huge_bytes": {rows: AnonHugePages of the huge side's
process}, "cpu", "isa", "cores", "commit", "torch", "dtype", "thp", "load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import machine  # noqa: E402

THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(rows: int, dtype: str) -> None:
    """One side, in its own process: ``rows`` sequences brought to pure decode, then one decode step per
    ``step`` line on stdin, each answered with its wall time in ms (``quit`` ends it)."""
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    engine = LLMEngine.from_args(dtype=dtype, max_num_seqs=rows, max_model_len=2048, kv_cache_mb=2048)
    rng = random.Random(0)  # both sides: the same prompts, so the same contexts at every step
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"s{i}", params, prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(128)])
    for _ in range(-(-rows * 128 // 2048) + 8):  # the prefill steps, then a few decodes (first-call paths)
        engine.step()
    print(json.dumps({"ready": True, "huge_bytes": anon_huge_bytes()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        engine.step()
        print(f"{(time.perf_counter() - start) * 1e3:.3f}", flush=True)


class Side:
    """A worker process of one side, stepped on demand."""

    def __init__(self, huge: bool, rows: int, dtype: str) -> None:
        # A short OpenMP spin: the side that waits must not take the cores from the side that steps.
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1" if huge else "0", GOMP_SPINCOUNT="10000")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rows", str(rows), "--dtype", dtype]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.ready = dict(json.loads(self.proc.stdout.readline()))

    def step(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of each side, in pairs")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help="also append the report to this file")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        worker(rows[0], args.dtype)
        return

    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("huge_pages", load_before)
    dtype = machine.resolve_dtype(args.dtype)
    steps: dict[int, dict[str, list[float]]] = {}
    huge_bytes: dict[int, int] = {}
    for n in rows:
        sides = {"huge": Side(True, n, dtype), "small": Side(False, n, dtype)}
        huge_bytes[n] = int(sides["huge"].ready["huge_bytes"])
        times: dict[str, list[float]] = {"huge": [], "small": []}
        for i in range(args.steps):  # the sides take turns, step by step, the first of each pair alternating
            for name in ("huge", "small")[:: 1 if i % 2 == 0 else -1]:
                times[name].append(sides[name].step())
        for side in sides.values():
            side.close()
        steps[n] = times
    medians = {n: {k: round(statistics.median(v), 2) for k, v in t.items()} for n, t in steps.items()}
    ratios = {n: round(statistics.median(s / h for s, h in zip(t["small"], t["huge"], strict=True)), 3)
              for n, t in steps.items()}
    try:
        thp = THP_SYSFS.read_text().strip()
    except OSError:
        thp = "unknown"
    summary = {
        "step_ms": medians, "small_over_huge": ratios, "steps": args.steps, "huge_bytes": huge_bytes,
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
        "dtype": dtype, "thp": thp, "load_before": list(load_before), "load_after": list(machine.load_avg()),
    }
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; THP {thp}; load avg at start {' '.join(map(str, load_before))}",
             *(f"decode step of {n} sequences, median of {args.steps} ms: 2 MiB pages {m['huge']}, 4 KiB pages "
               f"{m['small']}; median of the step pairs' 4 KiB / 2 MiB: {ratios[n]}" for n, m in medians.items()),
             json.dumps(summary)]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
