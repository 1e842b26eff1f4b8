"""Paged attention on the CPU: the C++ kernel (``kernels/cpu_kernels``) vs the torch reference, side by side.

Both run the same problems in the same process, one after the other, with the same thread count:
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 16 tokens), blocks
scattered at random over a pool (as after a while of serving).

- decode: a batch of sequences whose context lengths are drawn uniformly from [ctx/2, ctx];
- step: the same for each of 30 layers with a pool of its own, one call per layer, as a decode step of the
  model calls it (its 30 pools are far larger than the caches, unlike one decode problem's);
- prefill: a batch of chunks of ``new`` query tokens each, after ``prefix`` tokens already cached
  (prefix 0 = a whole prompt).

Each case is timed as the median of repeated calls, the sides taking turns call by call (this VM's speed
swings between minutes); the ratio is what to read, the milliseconds only say where on this machine it was.
The C++ build is the one ``CHATSVC_CPU_ISA`` / the CPU selects. ``--base REV`` also builds the kernels of
commit REV (the same ISA and flags, an extension of its own) and times them as a third side: the change's
own speedup is ``base_over_new``.

Usage: python benchmarks/cpu_attention.py [--dtype float32|bfloat16] [--threads N] [--base REV] [--output FILE]
Last line: one JSON object {"dtype", "isa", "cases": [{"kind", "batch", "ctx" | "new" + "prefix",
"reference_ms", "cpu_ms", "speedup"[, "base_ms", "base_over_new"]}], "speedup_geomean": {"decode", "step",
"prefill"}[, "base", "base_over_new_geomean": {...}], "cpu", "isa_flags", "cores", "commit", "torch", "threads",
"load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import cpu_kernels, reference  # noqa: E402
from kernels.testing import head_major  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import machine  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 3, 3, 64, 16
DECODE_CASES = [(16, 256), (64, 256), (128, 256), (64, 1024), (128, 512)]
STEP_CASES = [(32, 320), (64, 320)]  # (batch, ctx) of each layer of a 30-layer step
STEP_LAYERS = 30
# (batch, new tokens per sequence, cached prefix per sequence)
PREFILL_CASES = [(1, 512, 0), (4, 128, 0), (2, 256, 512), (8, 64, 256), (1, 32, 1024)]


def problem(batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen, dtype=torch.int32)
    return paged(lens, batch, dtype, gen)


def prefill_problem(batch: int, new: int, prefix: int, dtype: torch.dtype,
                    gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    lens = torch.full((batch,), prefix + new, dtype=torch.int32)
    _, k_cache, v_cache, tables, _ = paged(lens, batch, dtype, gen)
    query = torch.randn(batch * new, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
    return query, k_cache, v_cache, tables, starts, lens


def paged(lens: torch.Tensor, batch: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A shuffled pool holding ``lens`` tokens per sequence, stored head-major as the engine's pools are
    (``engine.runner.kv_pool``), and one query token per sequence."""
    blocks = [(int(n) + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    pool = sum(blocks) + 64
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used: used + n]
        used += n
    k_cache = head_major(torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
    v_cache = head_major(torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
    query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, lens


def turns_ms(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Median ms of each of ``fns``, called in turns (one call of each per round, after a warm-up call). A side
    called right after another finds that one's data in the caches (the decode pools here fit in L3), so the
    rounds go through every order of the sides: each side follows each other one equally often. (Rotating
    the first side alone kept the cycle, so with three sides the base build always ran right after the
    C++ kernel had loaded the pool and the reference never did.)"""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    orders = list(itertools.permutations(range(len(fns))))
    rounds = max(reps * len(fns), len(orders)) // len(orders) * len(orders)
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(ts) * 1e3 for ts in times]


def each_layer(fn: Callable[..., torch.Tensor], layers: list[tuple[object, ...]]) -> Callable[[], torch.Tensor]:
    """One call of ``fn`` per layer's inputs, as a decode step makes them; returns the last output."""
    def step() -> torch.Tensor:
        out = torch.empty(0)
        for inputs in layers:
            out = fn(*inputs)
        return out
    return step


def base_kernels(rev: str) -> cpu_kernels.CpuKernels:
    """The C++ kernels of commit ``rev``, built with this checkout's flags for the same ISA."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:kernels/csrc/cpu_kernels.cpp"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="cpu_attention_base_")) / "cpu_kernels.cpp"
    path.write_text(source)
    isa = cpu_kernels.selected_isa()
    return cpu_kernels.CpuKernels(ext=cpu_kernels.build_source(path, f"chatsvc_cpu_kernels_{isa}_base_{commit}", isa))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--base", default=None, help="also time the kernels of this commit")
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cpp = cpu_kernels.CpuKernels()
    base = base_kernels(args.base) if args.base else None
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("cpu_attention", load_before)
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; {torch.get_num_threads()} threads, dtype {args.dtype}, "
             f"C++ build {cpu_kernels.selected_isa()}; load avg (1/5/15 min) at start {' '.join(map(str, load_before))}"]
    cases: list[dict[str, object]] = []

    def run(kind: str, shape: dict[str, int], label: str, fns: list[Callable[[], torch.Tensor]]) -> tuple[float, float]:
        """fns: the reference, this checkout's kernel[, the base commit's]; (speedup, base over new)."""
        ref_ms, cpu_ms, *base_ms = turns_ms(list(fns), args.reps)
        out = fns[1]().float()
        err = (fns[0]().float() - out).abs().max().item()
        case: dict[str, object] = {"kind": kind, **shape, "reference_ms": round(ref_ms, 2),
                                   "cpu_ms": round(cpu_ms, 2), "speedup": round(ref_ms / cpu_ms, 2)}
        line = (f"{kind:7s} {label}: reference {ref_ms:7.2f} ms, C++ {cpu_ms:7.2f} ms, "
                f"{ref_ms / cpu_ms:5.2f}x (max abs difference {err:.1e})")
        if base_ms:
            case |= {"base_ms": round(base_ms[0], 2), "base_over_new": round(base_ms[0] / cpu_ms, 3)}
            line += (f"; base {base_ms[0]:7.2f} ms, base / new {base_ms[0] / cpu_ms:5.3f} "
                     f"(max abs difference {(fns[2]().float() - out).abs().max().item():.1e})")
        cases.append(case)
        lines.append(line)
        print(line, flush=True)
        return ref_ms / cpu_ms, (base_ms[0] / cpu_ms if base_ms else 1.0)

    decode_fns: list[Callable[..., torch.Tensor]] = [reference.paged_attention_decode, cpp.paged_attention_decode]
    prefill_fns: list[Callable[..., torch.Tensor]] = [reference.paged_attention_prefill, cpp.paged_attention_prefill]
    if base:
        decode_fns.append(base.paged_attention_decode)
        prefill_fns.append(base.paged_attention_prefill)

    def sides(fns: list[Callable[..., torch.Tensor]], inputs: tuple[object, ...]) -> list[Callable[[], torch.Tensor]]:
        return [functools.partial(fn, *inputs) for fn in fns]

    def step_sides(batch: int, ctx: int) -> list[Callable[[], torch.Tensor]]:
        layers = [(*problem(batch, ctx, dtype, gen), scale) for _ in range(STEP_LAYERS)]
        return [each_layer(fn, layers) for fn in decode_fns]

    results: dict[str, list[tuple[float, float]]] = {
        "decode": [run("decode", {"batch": b, "ctx": c}, f"batch {b:4d}, contexts {c // 2}-{c}",
                       sides(decode_fns, (*problem(b, c, dtype, gen), scale)))
                   for b, c in DECODE_CASES],
        "step": [run("step", {"batch": b, "ctx": c}, f"batch {b:4d}, contexts {c // 2}-{c}, {STEP_LAYERS} layers",
                     step_sides(b, c)) for b, c in STEP_CASES],
        "prefill": [run("prefill", {"batch": b, "new": n, "prefix": p}, f"batch {b:4d}, {n} new after {p} cached",
                        sides(prefill_fns, (*prefill_problem(b, n, p, dtype, gen), scale)))
                    for b, n, p in PREFILL_CASES],
    }

    def geomean(xs: list[float], digits: int = 2) -> float:
        return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), digits)

    summary: dict[str, object] = {
        "dtype": args.dtype, "isa": cpu_kernels.selected_isa(), "cases": cases,
        "speedup_geomean": {kind: geomean([r[0] for r in rs]) for kind, rs in results.items()}}
    if base:
        summary |= {"base": args.base,
                    "base_over_new_geomean": {kind: geomean([r[1] for r in rs], 3) for kind, rs in results.items()}}
    summary |= {"cpu": host.cpu,
                "isa_flags": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
                "threads": torch.get_num_threads(), "load_before": list(load_before),
                "load_after": list(machine.load_avg())}
    lines.append(json.dumps(summary))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
