"""The engine's decode step at a base commit and in this checkout, side by side, step by step.

Each side is a process of its own running the engine from its own tree: the base commit checked out in a git
worktree (``--base``, default ``HEAD``), and this checkout as it is on disk (uncommitted changes included).
Both build the engine (real model, dtype ``auto``) and bring the same ``rows`` sequences of 128 random prompt
tokens to pure decode, then take turns one decode step at a time (``--steps`` each, the first of each pair
alternating). Taking turns keeps the comparison inside the same seconds: this 2-core VM's speed swings 2-3x
between minutes, so separate runs a minute apart measure the swing more than the change. Each side builds
the C++ kernels from its own tree into its own extension directory.

Usage: python benchmarks/step_ab.py [--base REV] [--rows 32,64] [--steps 200] [--output FILE]
Last line: one JSON object {"base": commit, "step_ms": {rows: {"base": median, "new": median}}, "base_over_new":
{rows: median over step pairs of base/new}, "steps", "cpu", "isa", "cores", "commit", "torch", "dtype",
"load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]

import machine  # noqa: E402


def anon_huge_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (``AnonHugePages``), 0 where unknown."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker(tree: Path, rows: int, dtype: str) -> None:
    """One side: ``rows`` sequences brought to pure decode, then one decode step per ``step`` line on stdin,
    each answered with its wall time in ms (``quit`` ends it)."""
    sys.path.insert(0, str(tree))
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
    """A worker process running the engine of ``tree`` with ``env`` added to this environment, stepped on
    demand; ``ready`` is what it reported once at pure decode."""

    def __init__(self, tree: Path, rows: int, dtype: str, env: dict[str, str]) -> None:
        # A short OpenMP spin: the side that waits must not take the cores from the side that steps.
        full_env = dict(os.environ, GOMP_SPINCOUNT="10000", PYTHONPATH=str(tree), **env)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--rows", str(rows),
               "--dtype", dtype]
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine of {tree} did not start (exit {self.proc.wait()})")
        self.ready: dict[str, object] = dict(json.loads(line))

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


def take_turns(sides: dict[str, Side], steps: int) -> dict[str, list[float]]:
    """``steps`` decode steps of each side, one side's step after the other's, the first of each pair
    alternating; the sides are closed after."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        for name in names[:: 1 if i % 2 == 0 else -1]:
            times[name].append(sides[name].step())
    for side in sides.values():
        side.close()
    return times


def medians_and_ratio(times: dict[str, list[float]], num: str, den: str) -> tuple[dict[str, float], float]:
    """Each side's median step (ms) and the median over step pairs of ``num``'s step over ``den``'s."""
    medians = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return medians, round(statistics.median(a / b for a, b in zip(times[num], times[den], strict=True)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of each side, in pairs")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker is not None:
        worker(args.worker, rows[0], args.dtype)
        return

    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("step_ab", load_before)
    dtype = machine.resolve_dtype(args.dtype)
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    medians: dict[int, dict[str, float]] = {}
    ratios: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="step-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for n in rows:
                # Each side builds the C++ kernels of its own tree into its own extension directory.
                sides = {"base": Side(base_tree, n, dtype, {"TORCH_EXTENSIONS_DIR": str(Path(tmp) / "ext-base")}),
                         "new": Side(ROOT, n, dtype, {"TORCH_EXTENSIONS_DIR": str(Path(tmp) / "ext-new")})}
                medians[n], ratios[n] = medians_and_ratio(take_turns(sides, args.steps), "base", "new")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    summary = {
        "base": base, "step_ms": medians, "base_over_new": ratios, "steps": args.steps,
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
        "dtype": dtype, "load_before": list(load_before), "load_after": list(machine.load_avg()),
    }
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; load avg at start {' '.join(map(str, load_before))}",
             *(f"decode step of {n} sequences, median of {args.steps} ms: base {base} {m['base']}, this checkout "
               f"{m['new']}; median of the step pairs' base / new: {ratios[n]}" for n, m in medians.items()),
             json.dumps(summary)]
    machine.report(lines, args.output)


if __name__ == "__main__":
    main()
