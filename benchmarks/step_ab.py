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
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        engine.step()
        print(f"{(time.perf_counter() - start) * 1e3:.3f}", flush=True)


class Side:
    """A worker process running the engine of one tree, stepped on demand."""

    def __init__(self, tree: Path, rows: int, dtype: str, extensions: Path) -> None:
        # A short OpenMP spin: the side that waits must not take the cores from the side that steps.
        env = dict(os.environ, GOMP_SPINCOUNT="10000", TORCH_EXTENSIONS_DIR=str(extensions),
                   PYTHONPATH=str(tree))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--rows", str(rows),
               "--dtype", dtype]
        self.proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine of {tree} did not start (exit {self.proc.wait()})")

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
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of each side, in pairs")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help="also append the report to this file")
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
    steps: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="step-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for n in rows:
                sides = {"base": Side(base_tree, n, dtype, Path(tmp) / "ext-base"),
                         "new": Side(ROOT, n, dtype, Path(tmp) / "ext-new")}
                times: dict[str, list[float]] = {"base": [], "new": []}
                for i in range(args.steps):
                    for name in ("base", "new")[:: 1 if i % 2 == 0 else -1]:
                        times[name].append(sides[name].step())
                for side in sides.values():
                    side.close()
                steps[n] = times
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    medians = {n: {k: round(statistics.median(v), 2) for k, v in t.items()} for n, t in steps.items()}
    ratios = {n: round(statistics.median(b / w for b, w in zip(t["base"], t["new"], strict=True)), 3)
              for n, t in steps.items()}
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
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
