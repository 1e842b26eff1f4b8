"""The engine's decode step with torch's large CPU allocations on 2 MiB pages and on 4 KiB pages, side by side.

Whether torch's transparent-huge-page allocator (``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB and more
2 MiB-aligned and advised ``MADV_HUGEPAGE``) would make the engine faster. A decode step streams every
weight (~270 MB in bf16) and reads KV blocks from all over the pool, tens of thousands of 4 KiB pages a
step, so TLB misses were a suspect. The engine process sets the variable (``engine.process_env``); the records
per machine class are in benchmarks/results/huge_pages/. torch reads the variable at its first allocation, so each
side is a process of its own (``THP_MEM_ALLOC_ENABLE=1`` vs ``=0``), both up together: each builds the engine (real
model, dtype ``auto``) and brings the same ``rows`` sequences of 128 random prompt tokens to pure decode,
then the two take turns one decode step at a time (``--steps`` each, the first of each pair alternating).
Taking turns step by step keeps the comparison inside the same seconds: this 2-core VM's speed swings
between minutes more than this comparison differs. The two sides are benchmarks/step_ab.py's, both on this
checkout.

Usage: python benchmarks/huge_pages.py [--rows 32,64] [--steps 200] [--output FILE]
Last line: one JSON object {"step_ms": {rows: {"huge": median, "small": median}}, "small_over_huge": {rows:
median over step pairs of small/huge}, "steps", "huge_bytes": {rows: AnonHugePages of the huge side's
process}, "cpu", "isa", "cores", "commit", "torch", "dtype", "thp", "load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]

import machine  # noqa: E402
from step_ab import Side, medians_and_ratio, take_turns  # noqa: E402

THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of each side, in pairs")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]

    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("huge_pages", load_before)
    dtype = machine.resolve_dtype(args.dtype)
    medians: dict[int, dict[str, float]] = {}
    ratios: dict[int, float] = {}
    huge_bytes: dict[int, int] = {}
    for n in rows:
        sides = {"huge": Side(ROOT, n, dtype, {"THP_MEM_ALLOC_ENABLE": "1"}),
                 "small": Side(ROOT, n, dtype, {"THP_MEM_ALLOC_ENABLE": "0"})}
        huge_bytes[n] = int(sides["huge"].ready["huge_bytes"])  # type: ignore[call-overload]
        medians[n], ratios[n] = medians_and_ratio(take_turns(sides, args.steps), "small", "huge")
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
    machine.report(lines, args.output)


if __name__ == "__main__":
    main()
