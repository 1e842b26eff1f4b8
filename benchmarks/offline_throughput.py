"""Offline throughput: this engine vs transformers static batching vs max-length KV reservation.

One run, one machine, one workload, three systems (the PagedAttention paper's offline comparison):

(a) this engine (``LLMEngine``, paged KV cache, continuous batching);
(b) transformers ``generate`` in static batches of ``--hf-batch`` (32) prompts, left-padded, greedy,
    ``min_new_tokens = max_new_tokens``; the GGUF is loaded with ``GgufConfig(dequantize=True)`` so
    both run plain dense matmuls in the same dtype (transformers 5 would otherwise keep the Q4 blocks
    packed when the ``kernels`` package is present);
(c) this engine with ``kv_reservation="max_len"`` (every sequence reserves ``max_model_len`` tokens
    of blocks at admission, the contiguous-reservation baseline) under the SAME KV budget and
    settings as (a).

Workload: the first ``--num-prompts`` ShareGPT prompts (``../shared/data/sharegpt_prompts_1000.json``,
fallback ``chatsvc/data/``), each as one user turn in the default model's chat template, the user text
cut so the templated prompt is at most ``--max-prompt-tokens``; every request generates exactly
``--max-tokens`` tokens (greedy, ``ignore_eos``). All requests arrive at t=0. The same token ids go to
all three systems. Throughput = output tokens / wall time of the whole workload (prefill included).

KV utilization of (a): after every step, slots holding a token / slots allocated (``engine.stats()``),
averaged over steps; the sampling time is excluded from the throughput.

GEMM floor: both systems spend most of their time in the model's linear layers, and on a CPU
those are compute-bound at any batch size worth running. After the runs, the script times the
model's own weight matrices at a grid of row counts (same dtype, same threads) and adds up, step
by step, what the linear layers alone cost each system: the engine for the rows it actually ran
(recorded per step), transformers for its padded batches. ``hf_time / engine_gemm_floor`` is the
speedup over transformers that an engine with free attention, sampling and scheduling would reach
on this machine with these GEMMs: the ceiling for ``speedup_vs_hf`` here. The same sum over the
max_len run's steps gives the ratio of the two engine runs' GEMM time alone
(``gemm_only_speedup_vs_max_len``): how much larger batches save in the linear layers on this machine.

Usage: python benchmarks/offline_throughput.py [--dtype float32|bfloat16] [--num-prompts 200]
           [--max-tokens 128] [--skip-hf] [--quick] [--threads N] [--output FILE]
Last line: one JSON object {"dtype", "engine_tok_s", "hf_static_tok_s", "max_len_tok_s", "speedup_vs_hf",
"speedup_vs_max_len", "kv_utilization", "engine_gemm_share", "speedup_vs_hf_gemm_bound",
"gemm_only_speedup_vs_max_len"}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.engine import LLMEngine  # noqa: E402
from engine.loader import default_model_path  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

DATA_CANDIDATES = (
    ROOT / ".." / "shared" / "data" / "sharegpt_prompts_1000.json",
    ROOT / "chatsvc" / "data" / "sharegpt_prompts_1000.json",
)


@dataclass
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    detail: str = ""

    load_after: float = float("nan")  # 1-min load average when the run ended: other work on the machine

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def line(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return (f"{self.name}: {self.tok_s:.1f} output tok/s, {self.output_tokens} tokens in {self.seconds:.1f} s, "
                f"load avg after {self.load_after:.2f}{extra}")


def load_prompts(n: int) -> list[str]:
    for path in DATA_CANDIDATES:
        if path.exists():
            rows = json.loads(path.read_text())
            return [row["conversations"][0]["value"] for row in rows[:n]]
    raise FileNotFoundError(f"no ShareGPT prompts at any of {[str(p) for p in DATA_CANDIDATES]}")


def build_prompts(tok: Tokenizer, texts: list[str], max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Chat-templated token ids, the user text cut (at a token boundary) to fit; returns (ids, #truncated)."""
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}]))
    result, truncated = [], 0
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        budget = max_prompt_tokens - overhead
        while len(ids) > max_prompt_tokens:
            # Decoding and re-encoding can merge tokens differently: shrink until it fits.
            text = tok.decode(tok.encode(text)[:budget])
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            budget -= 4
        truncated += budget != max_prompt_tokens - overhead
        result.append(ids)
    return result, truncated


def run_engine(prompts: list[list[int]], args: argparse.Namespace,
               reservation: str) -> tuple[RunResult, float, list[tuple[int, int]], Any]:
    engine = LLMEngine(
        dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        swap_space_mb=0, preemption_mode="recompute", kv_reservation=reservation,
        max_waiting=len(prompts),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up (first-call allocations, lazy inits) outside the timed region.
    engine.add_request("warmup", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=prompts[0])
    while engine.has_unfinished():
        engine.step()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", params, prompt_token_ids=ids)
    # Rows of every forward pass (tokens, sampled rows), for the GEMM floor; a list append per step.
    rows: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording_execute(out: Any) -> Any:
        rows.append((sum(s.num_new_tokens for s in out.scheduled), sum(1 for s in out.scheduled if s.samples)))
        return execute(out)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    output_tokens = steps = 0
    util_sum = running_sum = 0.0
    sampling = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        output_tokens += sum(len(d.token_ids) for d in engine.step())
        t = time.perf_counter()
        filled, allocated = engine.kv_slot_usage()
        if allocated:
            util_sum += filled / allocated
        running_sum += engine.stats()["requests_running"]
        steps += 1
        sampling += time.perf_counter() - t
    seconds = time.perf_counter() - start - sampling
    stats = engine.stats()
    preemptions = stats["preemptions_swap"] + stats["preemptions_recompute"]
    util = util_sum / max(steps, 1)
    detail = (f"steps {steps}, mean running requests {running_sum / max(steps, 1):.1f}, "
              f"preemptions {preemptions}, KV utilization {util:.3f}")
    model = engine.runner.model
    del engine
    gc.collect()
    return RunResult(f"engine ({reservation})", output_tokens, seconds, detail, _load()), util, [r for r in rows if r[0]], model


def run_hf(prompts: list[list[int]], args: argparse.Namespace) -> RunResult:
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    dtype = getattr(torch, args.dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), dtype=dtype)
    model.eval()
    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def batch_inputs(batch: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: every row's last prompt token is aligned
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        return {"input_ids": ids, "attention_mask": mask}

    gen_kwargs = dict(do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                      pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        model.generate(**batch_inputs(prompts[:2]), **dict(gen_kwargs, max_new_tokens=2, min_new_tokens=2))
        output_tokens = 0
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i: i + args.hf_batch]
            inputs = batch_inputs(batch)
            out = model.generate(**inputs, **gen_kwargs)
            output_tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)
        seconds = time.perf_counter() - start
    attn = model.config._attn_implementation
    del model
    gc.collect()
    return RunResult(f"transformers static batch {args.hf_batch}", output_tokens, seconds,
                     f"attention {attn}, weights GgufConfig(dequantize=True), left padding", _load())


class GemmTimer:
    """Seconds the model's linear layers take for a forward pass of ``rows`` tokens, ``sampled`` of them
    through the LM head: timed at a grid of row counts, linearly interpolated between them.

    Each timing runs every layer's own weight matrices in order, as a forward pass does, so the weights
    stream from memory as they do in the engine; timing one layer's matrices over and over would keep
    them in cache and make small batches look cheaper than they are.
    """

    GRID = (1, 8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096)

    def __init__(self, model: Any) -> None:
        self.layers = [
            [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
             layer.mlp.down_proj.weight]
            for layer in model.model.layers
        ]
        self.head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.stack_s = [self._time(self.layers, m) for m in self.GRID]
        self.head_s = [self._time([[self.head]], m) for m in self.GRID]

    @staticmethod
    def _time(layers: list[list[torch.Tensor]], m: int) -> float:
        inputs = [torch.randn(m, w.shape[1], dtype=w.dtype) for w in layers[0]]

        def forward() -> None:
            for weights in layers:
                for x, w in zip(inputs, weights, strict=True):
                    torch.nn.functional.linear(x, w)

        reps = max(1, min(5, 1024 // m))
        with torch.inference_mode():
            forward()
            start = time.perf_counter()
            for _ in range(reps):
                forward()
        return (time.perf_counter() - start) / reps

    def _interp(self, table: list[float], m: int) -> float:
        grid = self.GRID
        if m <= grid[0]:
            return table[0]
        if m >= grid[-1]:  # beyond the grid: proportional to rows (compute-bound there)
            return table[-1] * m / grid[-1]
        hi = next(i for i, g in enumerate(grid) if g >= m)
        lo = hi - 1
        frac = (m - grid[lo]) / (grid[hi] - grid[lo])
        return table[lo] + frac * (table[hi] - table[lo])

    def forward_s(self, rows: int, sampled: int) -> float:
        head = self._interp(self.head_s, sampled) if sampled else 0.0
        return self._interp(self.stack_s, rows) + head


def hf_rows(prompts: list[list[int]], batch_size: int, max_tokens: int) -> list[tuple[int, int]]:
    """transformers' forward passes: a padded prefill per batch (logits of the last position only),
    then one decode pass per further token, every row of the batch each time."""
    passes = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i: i + batch_size]
        width = max(len(p) for p in batch)
        passes.append((len(batch) * width, len(batch)))
        passes.extend([(len(batch), len(batch))] * (max_tokens - 1))
    return passes


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = _load()
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"load avg at start {load:.2f}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="context limit of both engine runs; the max_len baseline reserves this much per sequence")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV budget (blocks of 16) of both engine runs")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-max-len", action="store_true")
    parser.add_argument("--quick", action="store_true", help="32 prompts x 32 tokens, for iterating")
    parser.add_argument("--output", type=Path, default=None, help="also append the report to this file")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens = 32, 32
    if args.threads:
        torch.set_num_threads(args.threads)

    header = [
        f"# {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}  commit {commit()}  "
        f"command: python {' '.join(sys.argv)}",
        f"machine: {machine()}",
    ]
    tok = Tokenizer.from_gguf(default_model_path())
    prompts, truncated = build_prompts(tok, load_prompts(args.num_prompts), args.max_prompt_tokens)
    lens = [len(p) for p in prompts]
    header += [
        f"workload: {len(prompts)} ShareGPT prompts in the ChatML template (mean {sum(lens) / len(lens):.1f}, "
        f"max {max(lens)} tokens; {truncated} cut to <= {args.max_prompt_tokens}), {args.max_tokens} output "
        f"tokens each (greedy, ignore_eos), dtype {args.dtype}, all at t=0",
        f"engine settings: KV budget {args.num_kv_blocks} blocks x 16 tokens, max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        "preemption recompute, prefix caching on",
    ]
    for line in header:
        print(line, flush=True)

    results: list[RunResult] = []
    engine_res, util, engine_rows, model = run_engine(prompts, args, "paged")
    results.append(engine_res)
    print(engine_res.line(), flush=True)
    hf_res = max_len_res = None
    max_len_rows: list[tuple[int, int]] = []
    if not args.skip_hf:
        hf_res = run_hf(prompts, args)
        results.append(hf_res)
        print(hf_res.line(), flush=True)
    if not args.skip_max_len:
        max_len_res, _, max_len_rows, _ = run_engine(prompts, args, "max_len")
        results.append(max_len_res)
        print(max_len_res.line(), flush=True)

    gemm = GemmTimer(model)
    engine_floor = sum(gemm.forward_s(r, n) for r, n in engine_rows)
    hf_floor = sum(gemm.forward_s(r, n) for r, n in hf_rows(prompts, args.hf_batch, args.max_tokens))
    floor_line = (f"GEMM floor (the linear layers alone, timed now on this machine): engine {engine_floor:.1f} s = "
                  f"{engine_floor / engine_res.seconds:.0%} of its run; transformers' padded batches {hf_floor:.1f} s"
                  + (f" = {hf_floor / hf_res.seconds:.0%} of its run; an engine of pure GEMMs would be "
                     f"{hf_res.seconds / engine_floor:.2f}x transformers" if hf_res else ""))
    max_len_floor = sum(gemm.forward_s(r, n) for r, n in max_len_rows)
    if max_len_res:
        floor_line += (f"; max_len {max_len_floor:.1f} s = {max_len_floor / max_len_res.seconds:.0%} of its run "
                       f"(GEMMs alone, paged would be {max_len_floor / engine_floor:.2f}x max_len)")
    results_lines = [floor_line]
    print(floor_line, flush=True)

    def ratio(other: RunResult | None) -> float | None:
        return round(engine_res.tok_s / other.tok_s, 2) if other else None

    summary = {
        "dtype": args.dtype,
        "engine_tok_s": round(engine_res.tok_s, 1),
        "hf_static_tok_s": round(hf_res.tok_s, 1) if hf_res else None,
        "max_len_tok_s": round(max_len_res.tok_s, 1) if max_len_res else None,
        "speedup_vs_hf": ratio(hf_res),
        "speedup_vs_max_len": ratio(max_len_res),
        "kv_utilization": round(util, 4),
        "engine_gemm_share": round(engine_floor / engine_res.seconds, 3),
        "speedup_vs_hf_gemm_bound": round(hf_res.seconds / engine_floor, 2) if hf_res else None,
        "gemm_only_speedup_vs_max_len": round(max_len_floor / engine_floor, 2) if max_len_res else None,
    }
    lines = header + [r.line() for r in results] + results_lines + [json.dumps(summary)]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
