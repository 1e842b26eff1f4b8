"""Paged attention on the CPU: the C++ kernel (``kernels/cpu_kernels``) vs the torch reference, side by side.

Both run the same problems in the same process, one after the other, with the same thread count:
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 16 tokens), blocks
scattered at random over a pool (as after a while of serving).

- decode: a batch of sequences whose context lengths are drawn uniformly from [ctx/2, ctx];
- prefill: a batch of chunks of ``new`` query tokens each, after ``prefix`` tokens already cached
  (prefix 0 = a whole prompt).

Each case is timed as the median of repeated calls; the ratio is what to read, the milliseconds only say
where on this machine it was. The C++ build is the one ``CHATSVC_CPU_ISA`` / the CPU selects.

Usage: python benchmarks/cpu_attention.py [--dtype float32|bfloat16] [--threads N] [--output FILE]
Last line: one JSON object {"dtype", "isa", "cases": [{"kind", "batch", "ctx" | "new" + "prefix",
"reference_ms", "cpu_ms", "speedup"}], "speedup_geomean": {"decode", "prefill"}, "cpu", "isa_flags", "cores",
"commit", "torch", "threads", "load_before", "load_after"}.
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
DECODE_CASES = [(16, 256), (64, 256), (128, 256), (64, 1024), (128, 512)]
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
    """A shuffled pool holding ``lens`` tokens per sequence, and one query token per sequence."""
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
    cpp = cpu_kernels.CpuKernels()
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("cpu_attention", load_before)
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; {torch.get_num_threads()} threads, dtype {args.dtype}, "
             f"C++ build {cpu_kernels.selected_isa()}; load avg (1/5/15 min) at start {' '.join(map(str, load_before))}"]
    cases: list[dict[str, object]] = []

    def run(kind: str, shape: dict[str, int], label: str, ref: Callable[..., torch.Tensor],
            cpu: Callable[..., torch.Tensor], inputs: tuple[object, ...]) -> float:
        ref_ms = median_ms(functools.partial(ref, *inputs), args.reps)
        cpu_ms = median_ms(functools.partial(cpu, *inputs), args.reps)
        err = (ref(*inputs).float() - cpu(*inputs).float()).abs().max().item()
        cases.append({"kind": kind, **shape, "reference_ms": round(ref_ms, 2), "cpu_ms": round(cpu_ms, 2),
                      "speedup": round(ref_ms / cpu_ms, 2)})
        lines.append(f"{kind:7s} {label}: reference {ref_ms:7.2f} ms, C++ {cpu_ms:7.2f} ms, "
                     f"{ref_ms / cpu_ms:5.2f}x (max abs difference {err:.1e})")
        print(lines[-1], flush=True)
        return ref_ms / cpu_ms

    decode = [run("decode", {"batch": b, "ctx": c}, f"batch {b:4d}, contexts {c // 2}-{c}",
                  reference.paged_attention_decode, cpp.paged_attention_decode,
                  (*problem(b, c, dtype, gen), scale)) for b, c in DECODE_CASES]
    prefill = [run("prefill", {"batch": b, "new": n, "prefix": p}, f"batch {b:4d}, {n} new after {p} cached",
                   reference.paged_attention_prefill, cpp.paged_attention_prefill,
                   (*prefill_problem(b, n, p, dtype, gen), scale)) for b, n, p in PREFILL_CASES]

    def geomean(xs: list[float]) -> float:
        return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 2)

    summary = {"dtype": args.dtype, "isa": cpu_kernels.selected_isa(), "cases": cases,
               "speedup_geomean": {"decode": geomean(decode), "prefill": geomean(prefill)}, "cpu": host.cpu,
               "isa_flags": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
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
