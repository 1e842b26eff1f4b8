"""The engine's decode step with torch's large CPU allocations on 2 MiB pages and on 4 KiB pages, side by side.

``engine`` turns on torch's transparent-huge-page allocator (``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MiB
and more are 2 MiB-aligned and advised ``MADV_HUGEPAGE``) unless the variable is already set. A decode step
streams every weight (~270 MB in bf16) and reads KV blocks from all over the pool; on 4 KiB pages that is
tens of thousands of TLB misses a step. The variable is read by torch at its first allocation, so each side
runs in its own process: ``THP_MEM_ALLOC_ENABLE=1`` vs ``=0``, the sides alternated over ``--rounds``.

Each process builds the engine (real model, dtype ``auto``), then for each row count of ``--rows`` runs that
many sequences of 128 random prompt tokens x ``--tokens`` greedy tokens and takes the median step time once
every prompt is in (pure decode steps). Ratios are what to read: this 2-core VM's speed swings between
minutes, hence the alternation.

Usage: python benchmarks/huge_pages.py [--rows 32,64] [--tokens 64] [--rounds 3] [--output FILE]
Last line: one JSON object {"step_ms": {rows: {"huge": [...], "small": [...]}}, "small_over_huge": {rows:
median over rounds of small/huge}, "huge_bytes": AnonHugePages of the huge side's process, "cpu", "isa",
"cores", "commit", "torch", "dtype", "thp", "load_before", "load_after"}.
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


def worker(rows: list[int], tokens: int, dtype: str) -> dict[str, object]:
    """One side, in its own process: the median pure-decode step at each row count."""
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    engine = LLMEngine.from_args(dtype=dtype, max_num_seqs=max(rows), max_model_len=2048, kv_cache_mb=2048)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    step_ms: dict[int, float] = {}
    for n in [rows[0], *rows]:  # the first pass warms up (oneDNN primitives, first-call paths)
        for i in range(n):
            engine.add_request(f"{n}-{i}-{rng.random()}", params,
                               prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(128)])
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        prefill_steps = -(-n * 128 // 2048) + 1
        step_ms[n] = round(statistics.median(times[prefill_steps:]) * 1e3, 2)
    return {"step_ms": step_ms, "huge_bytes": anon_huge_bytes(),
            "thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE")}


def run_side(huge: bool, args: argparse.Namespace, dtype: str) -> dict[str, object]:
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1" if huge else "0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rows", args.rows,
           "--tokens", str(args.tokens), "--dtype", dtype]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help="also append the report to this file")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print(json.dumps(worker(rows, args.tokens, args.dtype)))
        return

    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("huge_pages", load_before)
    dtype = machine.resolve_dtype(args.dtype)
    steps: dict[int, dict[str, list[float]]] = {n: {"huge": [], "small": []} for n in rows}
    huge_bytes = []
    for i in range(args.rounds):
        for huge in (True, False)[:: 1 if i % 2 == 0 else -1]:
            side = run_side(huge, args, dtype)
            for n, ms in dict(side["step_ms"]).items():  # type: ignore[call-overload]
                steps[int(n)]["huge" if huge else "small"].append(ms)
            if huge:
                huge_bytes.append(int(side["huge_bytes"]))  # type: ignore[call-overload]
    ratios = {n: round(statistics.median(s / h for s, h in zip(v["small"], v["huge"], strict=True)), 3)
              for n, v in steps.items()}
    try:
        thp = THP_SYSFS.read_text().strip()
    except OSError:
        thp = "unknown"
    summary = {
        "step_ms": steps, "small_over_huge": ratios, "huge_bytes": huge_bytes,
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
        "dtype": dtype, "thp": thp, "load_before": list(load_before), "load_after": list(machine.load_avg()),
    }
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; THP {thp}; load avg at start {' '.join(map(str, load_before))}",
             *(f"decode step of {n} sequences, ms (rounds): 2 MiB pages {v['huge']}, 4 KiB pages {v['small']}; "
               f"4 KiB / 2 MiB {ratios[n]}" for n, v in steps.items()),
             json.dumps(summary)]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
