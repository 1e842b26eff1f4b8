"""Decode attention on the CPU: the C++ kernel (``kernels/cpu_kernels``) vs the torch reference, side by side.

Both run the same problems in the same process, one after the other, with the same thread count:
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 16 tokens), a batch of
sequences whose context lengths are drawn uniformly from [ctx/2, ctx], their blocks scattered at random
over a pool (as after a while of serving). Each case is timed as the median of repeated calls; the ratio
is what to read, the milliseconds only say where on this machine it was.

Usage: python benchmarks/cpu_attention.py [--dtype float32|bfloat16] [--threads N] [--output FILE]
Last line: one JSON object {"dtype", "cases": [{"batch", "ctx", "reference_ms", "cpu_ms", "speedup"}],
"speedup_geomean", "cpu", "isa", "cores", "commit", "torch", "threads", "load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import cpu_kernels, reference  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import machine  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 3, 3, 64, 16
CASES = [(16, 256), (64, 256), (128, 256), (64, 1024), (128, 512)]


def problem(batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen, dtype=torch.int32)
    blocks = [(int(n) + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    pool = sum(blocks) + 64
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used: used + n]
        used += n
    k_cache = torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, lens


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--output", type=Path, default=None, help="also append the report to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cpu_kernels.load_extension()
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("cpu_attention", load_before)
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; {torch.get_num_threads()} threads, dtype {args.dtype}; load avg (1/5/15 min) "
             f"at start {' '.join(map(str, load_before))}"]
    cases = []
    for batch, ctx in CASES:
        inputs = (*problem(batch, ctx, dtype, gen), scale)
        ref_ms = median_ms(functools.partial(reference.paged_attention_decode, *inputs), args.reps)
        cpu_ms = median_ms(functools.partial(cpu_kernels.paged_attention_decode, *inputs), args.reps)
        err = (reference.paged_attention_decode(*inputs).float()
               - cpu_kernels.paged_attention_decode(*inputs).float()).abs().max().item()
        cases.append({"batch": batch, "ctx": ctx, "reference_ms": round(ref_ms, 2), "cpu_ms": round(cpu_ms, 2),
                      "speedup": round(ref_ms / cpu_ms, 2)})
        lines.append(f"batch {batch:4d}, contexts {ctx // 2}-{ctx}: reference {ref_ms:7.2f} ms, C++ {cpu_ms:7.2f} ms, "
                     f"{ref_ms / cpu_ms:5.2f}x (max abs difference {err:.1e})")
        print(lines[-1], flush=True)
    geomean = math.exp(sum(math.log(c["speedup"]) for c in cases) / len(cases))
    summary = {"dtype": args.dtype, "cases": cases, "speedup_geomean": round(geomean, 2), "cpu": host.cpu,
               "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
               "threads": torch.get_num_threads(), "load_before": list(load_before),
               "load_after": list(machine.load_avg())}
    lines.append(json.dumps(summary))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
