"""Decode attention over the same sequences with their KV blocks laid out three ways in the pool, side by side.

Paging lets a sequence's blocks lie anywhere, but where they lie still sets how fast a decode step reads
them: a block of one layer is a few KiB (SmolLM2 in bf16: 6 KiB of K, as much of V), and the hardware
prefetchers and DRAM pages reward reads that land next to the last ones. Left to the order of its free
lists, the block pool would give a server's sequences a layout that depends on its history (so
``engine.block_pool`` places a sequence's next block next to its last where it can):

- ``lockstep``: what a fresh pool gives sequences that grow together (block j of every sequence, then
  block j + 1: each block's neighbours are the other sequences' blocks of the same index);
- ``contiguous``: each sequence's blocks one after another (a prompt's blocks, allocated in one step);
- ``random``: blocks drawn at random from the pool (what eviction from the prefix cache's LRU list tends
  to, once a long-running server has freed and reused its blocks in many orders).

The shape is the default model's (layers, KV heads, head size, GQA group), blocks of 16 tokens, the C++
kernels of this checkout through ``kernels.cpu_kernels``, the pool through ``engine.runner.kv_pool`` on 2 MiB
pages as the engine process allocates it (``engine.process_env``). A step is one decode attention call per
layer for ``--rows`` sequences of ``--ctx`` tokens each; the layouts take turns step by step (this 2-core
VM's speed swings between minutes more than the layouts differ), ``--steps`` each.

Usage: python benchmarks/kv_layout.py [--rows 64] [--ctx 200,700] [--steps 15] [--output FILE]
Last line: one JSON object {"step_ms": {ctx: {layout: median ms}}, "over_lockstep": {ctx: {layout: median
ms / lockstep's}}, "gb_s": {ctx: {layout: KV bytes read per second}}, "rows", "steps", "dtype", "cpu", "isa",
"cores", "commit", "torch", "load_before", "load_after"}.
"""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch reads it at its first allocation: before torch

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import machine  # noqa: E402

from engine.model_files import load_tokenizer  # noqa: E402
from engine.runner import kv_pool  # noqa: E402
from kernels import cpu_kernels  # noqa: E402

BLOCK_SIZE = 16
LAYOUTS = ("lockstep", "contiguous", "random")


def block_tables(layout: str, rows: int, blocks_each: int, pool_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, blocks_each]`` block ids of ``layout`` in a pool of ``pool_blocks``."""
    if layout == "lockstep":
        return torch.arange(rows * blocks_each, dtype=torch.int32).view(blocks_each, rows).t().contiguous()
    if layout == "contiguous":
        return torch.arange(rows * blocks_each, dtype=torch.int32).view(rows, blocks_each).contiguous()
    if layout == "random":
        return torch.randperm(pool_blocks, generator=gen)[: rows * blocks_each].to(torch.int32).view(rows, blocks_each)
    raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="sequences decoding together")
    parser.add_argument("--ctx", default="200,700", help="tokens of context per sequence, one case each")
    parser.add_argument("--steps", type=int, default=15, help="decode steps of each layout, taking turns")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.ctx.split(",")]

    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("kv_layout", load_before)
    dtype_name = machine.resolve_dtype(args.dtype)
    dtype = getattr(torch, dtype_name)
    _, cfg = load_tokenizer()
    ext = cpu_kernels.CpuKernels()
    gen = torch.Generator().manual_seed(0)
    # Twice the blocks the longest case uses, and at least a few GiB: random draws spread over a pool of a
    # serving size, not over one that fits the caches.
    blocks_each_max = -(-max(contexts) // BLOCK_SIZE)
    block_bytes = cfg.num_layers * 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    pool_blocks = max(2 * args.rows * blocks_each_max, (4 << 30) // block_bytes)
    cache = kv_pool((cfg.num_layers, 2, pool_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim), dtype, "cpu")
    cache.normal_(generator=gen)
    scale = cfg.head_dim ** -0.5

    step_ms: dict[int, dict[str, float]] = {}
    over: dict[int, dict[str, float]] = {}
    gb_s: dict[int, dict[str, float]] = {}
    for ctx in contexts:
        blocks_each = -(-ctx // BLOCK_SIZE)
        tables = {name: block_tables(name, args.rows, blocks_each, pool_blocks, gen) for name in LAYOUTS}
        query = torch.randn(args.rows, cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
        lens = torch.full((args.rows,), ctx, dtype=torch.int32)

        def step(table: torch.Tensor, query: torch.Tensor, lens: torch.Tensor) -> float:
            start = time.perf_counter()
            for layer in range(cfg.num_layers):
                ext.paged_attention_decode(query, cache[layer, 0], cache[layer, 1], table, lens, scale)
            return (time.perf_counter() - start) * 1e3

        for table in tables.values():
            step(table, query, lens)  # warm: thread pool, scratch buffers
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for i in range(args.steps):
            order = LAYOUTS[i % len(LAYOUTS):] + LAYOUTS[: i % len(LAYOUTS)]
            for name in order:
                times[name].append(step(tables[name], query, lens))
        step_ms[ctx] = {name: round(statistics.median(t), 2) for name, t in times.items()}
        over[ctx] = {name: round(step_ms[ctx][name] / step_ms[ctx]["lockstep"], 3) for name in LAYOUTS}
        kv_bytes = args.rows * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        gb_s[ctx] = {name: round(kv_bytes / ms / 1e6, 1) for name, ms in step_ms[ctx].items()}

    summary = {
        "step_ms": step_ms, "over_lockstep": over, "gb_s": gb_s, "rows": args.rows, "steps": args.steps,
        "dtype": dtype_name, "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit,
        "torch": host.torch, "load_before": list(load_before), "load_after": list(machine.load_avg()),
    }
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype_name}; load avg at start {' '.join(map(str, load_before))}",
             *(f"{args.rows} sequences x {ctx} tokens, decode attention of {cfg.num_layers} layers, median of "
               f"{args.steps} steps (ms): " + ", ".join(f"{n} {step_ms[ctx][n]} ({gb_s[ctx][n]} GB/s, "
                                                        f"{over[ctx][n]}x lockstep)" for n in LAYOUTS)
               for ctx in contexts),
             json.dumps(summary)]
    machine.report(lines, args.output)


if __name__ == "__main__":
    main()
