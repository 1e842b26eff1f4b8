"""Tensor parallelism: throughput of TP = 1 vs TP = N, and what the collectives cost per step and per token.

On one small CPU machine tensor parallelism is not faster (the ranks share the cores and memory bandwidth);
the figure worth recording is the communication share: the time rank 0 spends inside the model's
collectives (the all-reduce after every ``o_proj`` and ``down_proj``, the logits gather) over the wall time.
From it and the per-step all-reduce time, the multi-socket or multi-GPU case can be estimated (scale the
compute by the ranks, keep the communication).

Every rank runs ``--threads-per-rank`` torch threads (default 1: TP = 1 runs one thread, TP = 2 two ranks
of one thread each). Rank 0's time inside ``dist.all_reduce`` and the gather is measured by wrapping
``TensorParallel``'s two collectives in this process (the other ranks are spawned fresh and run them
unwrapped); it includes waiting for the slowest rank, which is part of what a collective costs a step.

Model: ``--model synthetic`` (default) is SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocab
49152) with 8 query / 4 KV heads of 72 dims, so that 2 and 4 ranks split it (SmolLM2's own 9 / 3 heads
take 1 or 3 only), random weights; ``--model default`` is the real SmolLM2-135M (use ``--sizes 1,3``).
Workload: ``--prompts`` prompts of ``--prompt-tokens`` random token ids, ``--max-tokens`` greedy tokens each
(``ignore_eos``), all arriving at once; throughput = output tokens / wall time, prefill included.

``--device cuda`` runs the same with NCCL (one GPU per rank).

Usage: python benchmarks/tensor_parallel.py [--sizes 1,2] [--model synthetic|default|PATH] [--prompts 16]
           [--prompt-tokens 64] [--max-tokens 32] [--threads-per-rank 1] [--dtype float32] [--device cpu]
           [--output FILE]
Last line: one JSON object {"runs": [{"tp", "tok_s", "seconds", "steps", "output_tokens", "allreduce_s",
"allreduce_calls", "gather_s", "comm_share", "allreduce_ms_per_step", "comm_ms_per_token"}, ...], machine fields}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch import Tensor  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.distributed import DriverRunner  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model.parallel import TensorParallel  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import machine  # noqa: E402
from tiny_model import make_tiny_model_dir  # noqa: E402  (a random model of the real one's shape)

SYNTHETIC: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=72, vocab_size=49152, max_position_embeddings=2048,
                 initializer_range=0.02)


class CommTimer:
    """Rank 0's seconds inside the model's collectives, by wrapping TensorParallel's methods in this process."""

    def __init__(self) -> None:
        self.allreduce_s = 0.0
        self.allreduce_calls = 0
        self.gather_s = 0.0
        self._originals = (TensorParallel.all_reduce, TensorParallel.gather_logits)

    def install(self) -> None:
        all_reduce, gather = self._originals
        timer = self

        def timed_all_reduce(tp: TensorParallel, x: Tensor) -> None:
            started = time.perf_counter()
            all_reduce(tp, x)
            timer.allreduce_s += time.perf_counter() - started
            timer.allreduce_calls += 1

        def timed_gather(tp: TensorParallel, local: Tensor, vocab_size: int) -> Tensor:
            started = time.perf_counter()
            out = gather(tp, local, vocab_size)
            timer.gather_s += time.perf_counter() - started
            return out

        TensorParallel.all_reduce = timed_all_reduce  # type: ignore[method-assign,assignment]
        TensorParallel.gather_logits = timed_gather  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        TensorParallel.all_reduce, TensorParallel.gather_logits = self._originals  # type: ignore[method-assign]


def run(model: str | None, tp: int, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
                          engine_threads=args.threads_per_rank * tp, num_kv_blocks=args.kv_blocks,
                          max_waiting=1 << 20)
    engine = LLMEngine(config)
    timer = CommTimer()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        warm = engine.add_request("warm", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                  prompt_token_ids=prompts[0])
        while engine.has_unfinished():
            engine.step()
        assert warm.is_finished
        timer.install()
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", params, prompt_token_ids=ids)
        steps = 0
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - started
    finally:
        timer.uninstall()
        if isinstance(engine.runner, DriverRunner):
            engine.runner.close()
    tokens = len(prompts) * args.max_tokens
    comm = timer.allreduce_s + timer.gather_s
    return {"tp": tp, "tok_s": tokens / seconds, "seconds": seconds, "steps": steps, "output_tokens": tokens,
            "allreduce_s": timer.allreduce_s, "allreduce_calls": timer.allreduce_calls, "gather_s": timer.gather_s,
            "comm_share": comm / seconds, "allreduce_ms_per_step": 1e3 * timer.allreduce_s / steps,
            "comm_ms_per_token": 1e3 * comm / tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--model", default="synthetic", help="synthetic, default (SmolLM2-135M) or a path")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model: str | None
        if args.model == "synthetic":
            model = str(make_tiny_model_dir(Path(tmp), "llama", **SYNTHETIC))
        else:
            model = None if args.model == "default" else args.model
        rng = random.Random(0)
        vocab = 320 if args.model == "synthetic" else 49152  # the synthetic model's tokenizer has 320 tokens
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        record: dict[str, Any] = {"runs": [], "load": {}, "model": args.model, "dtype": args.dtype,
                                  "device": args.device, "threads_per_rank": args.threads_per_rank,
                                  "workload": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                                               "max_tokens": args.max_tokens}}
        for size in (int(s) for s in args.sizes.split(",")):
            with machine.load_window(f"tp{size}", record["load"]):
                result = run(model, size, prompts, args)
            record["runs"].append(result)
            print(f"TP={size}: {result['tok_s']:.1f} tok/s over {result['steps']} steps; all-reduce "
                  f"{result['allreduce_ms_per_step']:.2f} ms/step ({result['allreduce_calls']} calls), gather "
                  f"{1e3 * result['gather_s']:.1f} ms in all; communication {100 * result['comm_share']:.1f}% of "
                  f"the time, {result['comm_ms_per_token']:.3f} ms per output token", flush=True)
    record.update(machine.describe().as_dict())
    line = json.dumps(record)
    if args.output is not None:
        args.output.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
