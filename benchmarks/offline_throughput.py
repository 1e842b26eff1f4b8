"""Offline throughput: this engine vs transformers static batching vs max-length KV reservation, and where
one decode step of this engine spends its time.

One run, one machine, one workload, three systems (the PagedAttention paper's offline comparison):

(a) this engine (``LLMEngine``, paged KV cache, continuous batching);
(b) transformers ``generate`` in static batches of ``--hf-batch`` (32) prompts, left-padded, greedy,
    ``min_new_tokens = max_new_tokens``; the GGUF is loaded with ``GgufConfig(dequantize=True)`` so
    both run plain dense matmuls in the same dtype (transformers 5 would otherwise keep the Q4 blocks
    packed when the ``kernels`` package is present). To keep the default run near 10 minutes on a 2-core
    machine, transformers runs only the first ``--hf-prompts`` (96 = three whole batches) of the prompts:
    static batching's throughput is a per-batch property, so three batches estimate it, and whole batches
    spare it the one small, inefficient tail batch 200 prompts used to end with (earlier records ran all 200);
(c) this engine with ``kv_reservation="max_len"`` (every sequence reserves ``max_model_len`` tokens
    of blocks at admission, the contiguous-reservation baseline) under the SAME KV budget and
    settings as (a).

dtype: ``--dtype auto`` (default) is bfloat16 where ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
(AVX512-BF16 / AMX), else float32 (emulated bf16 matmuls on an AVX2 core are several times slower). The
default run is sized for about 10 minutes on the project's 2-core AMX machine in bfloat16 (the bf16 phases
took 59 s engine, 133 s transformers on 200 prompts, 80 s max_len on a 2-core AVX2 EPYC; transformers now
runs 96 prompts, and the breakdown adds two prefills and 4 x 8 decode steps); a float32 run on an AVX2-only
machine takes much longer (the 200-prompt float32 run took ~26 minutes there). The last text line before
the JSON prints the seconds each phase took, to check this. On a busy machine every phase is many times
slower (torch's OpenMP threads wait for each other's time slices): measure on a quiet one.

``--rounds N`` runs (a) and (b) N times, taking turns (the order flips each round), and reports the median of
the rounds' ratios (every round's in ``speedup_vs_hf_rounds``): the phases run minutes apart, and a 2-core
VM's speed swings between minutes (transformers made 88.6 and 117.5 tok/s in two single runs there,
``benchmarks/results/offline_throughput/``), so one round's ratio says as much about the minutes as about
the code.

Workload: the first ``--num-prompts`` ShareGPT prompts (``../shared/data/sharegpt_prompts_1000.json``,
fallback ``chatsvc/data/``), each as one user turn in the default model's chat template, the user text
cut so the templated prompt is at most ``--max-prompt-tokens``; every request generates exactly
``--max-tokens`` tokens (greedy, ``ignore_eos``). All requests arrive at t=0. The same token ids go to
all three systems. Throughput = output tokens / wall time of the whole workload (prefill included).

KV utilization of (a): after every step, slots holding a token / slots allocated (``engine.stats()``),
averaged over steps; the sampling time is excluded from the throughput.

GEMM floor: both systems spend most of their time in the model's linear layers, and on a CPU
those are compute-bound at any batch size worth running. After the runs, the script times the
model's own linear modules (whatever implementation the engine's Linear uses: a packed weight is timed
as packed) and its LM head (``compute_logits``) at a grid of row counts (same dtype, same threads) and
adds up, step by step, what the linear layers alone cost each system: the engine for the rows it
actually ran (recorded per step), transformers for its padded batches. ``speedup_vs_hf_gemm_bound`` is
the speedup over transformers that an engine with free attention, sampling and scheduling would reach
on this machine with these GEMMs: the ceiling for ``speedup_vs_hf`` here. The same sum over the
max_len run's steps gives the ratio of the two engine runs' GEMM time alone
(``gemm_only_speedup_vs_max_len``): how much larger batches save in the linear layers on this machine.

Decode-step breakdown (``--breakdown-rows 32,96``): for each batch size, that many workload prompts are
prefilled, then ``--breakdown-steps`` pure decode steps are timed plain and as many again under
torch.profiler, with ``record_function`` regions added from here (forward hooks on the model's linear and
attention modules, wrappers around the LM head and the sampler; the engine itself is not edited). The hooks
need the layers run as modules: where the engine runs them as one C++ call (``fuse_layers``), the profiled
steps, and as many plain ones (``module_step_ms``), run the modules, while ``step_ms`` is the engine's own
step; the difference is the Python the C++ loop saves. Per step: linear (layers + LM head), attention,
glue (embedding, norms, rope, silu, residual adds), sampling, python/scheduling (the rest of
``engine.step``), the GEMM floor at that many rows, and the top aten ops.

Every record names the CPU model, its ISA flags (avx2, avx512f, avx512_bf16, avx512_vnni, amx_bf16,
amx_tile), cores, torch version, commit (``-dirty`` if tracked files differ) and the load averages before
and after (a loud warning when the 1-min load at the start is > 0.5: another process is using the cores).

Usage: python benchmarks/offline_throughput.py [--dtype auto|float32|bfloat16] [--num-prompts 200]
           [--max-tokens 128] [--hf-prompts 96] [--skip-hf] [--skip-max-len] [--breakdown-rows 32,96]
           [--quick] [--threads N] [--output FILE]
Last line: one JSON object {"dtype", "engine_tok_s", "hf_static_tok_s", "max_len_tok_s", "speedup_vs_hf",
"speedup_vs_max_len", "kv_utilization", "engine_gemm_share", "speedup_vs_hf_gemm_bound",
"gemm_only_speedup_vs_max_len", "breakdown": {"32": {...}, "96": {...}}, "cpu", "isa", "cores", "commit",
"torch", "threads", "load_before", "load_after", "seconds"}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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
from torch.profiler import record_function  # noqa: E402

from engine.engine import LLMEngine  # noqa: E402
from engine.model_files import default_model_path  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import machine  # noqa: E402

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
    engine = LLMEngine.from_args(
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
        running_sum += engine.stats().requests_running
        steps += 1
        sampling += time.perf_counter() - t
    seconds = time.perf_counter() - start - sampling
    stats = engine.stats()
    preemptions = stats.preemptions_swap + stats.preemptions_recompute
    util = util_sum / max(steps, 1)
    detail = (f"steps {steps}, mean running requests {running_sum / max(steps, 1):.1f}, "
              f"preemptions {preemptions}, KV utilization {util:.3f}")
    model = engine.runner.model
    del engine
    gc.collect()
    return RunResult(f"engine ({reservation})", output_tokens, seconds, detail, machine.load_avg()[0]), util, [r for r in rows if r[0]], model


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
                     f"attention {attn}, weights GgufConfig(dequantize=True), left padding", machine.load_avg()[0])


class GemmTimer:
    """Seconds the model's linear layers take for a forward pass of ``rows`` tokens, ``sampled`` of them
    through the LM head: timed at a grid of row counts, linearly interpolated between them.

    It calls the model's own linear modules (and its ``compute_logits`` for the head), not ``F.linear`` on
    their weights: whatever the engine's linears do (a packed oneDNN weight, a custom kernel) is what gets
    timed. Each timing runs every layer's modules in order, as a forward pass does, so the weights stream
    from memory as they do in the engine; timing one layer over and over would keep it in cache and make
    small batches look cheaper than they are.
    """

    GRID = (1, 8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096)

    def __init__(self, model: Any) -> None:
        self.dtype = next(model.parameters()).dtype
        self.layers: list[list[Any]] = [[module for _, module in layer_linears(layer)] for layer in model.model.layers]
        self.head = model.compute_logits
        self.hidden = model.config.hidden_size
        self.stack_s = [self._time_stack(m) for m in self.GRID]
        self.head_s = [self._time_head(m) for m in self.GRID]

    @staticmethod
    def _reps(m: int) -> int:
        return max(1, min(5, 1024 // m))

    def _time_stack(self, m: int) -> float:
        inputs = [torch.randn(m, in_features(mod), dtype=self.dtype) for mod in self.layers[0]]

        def forward() -> None:
            for modules in self.layers:
                for x, mod in zip(inputs, modules, strict=True):
                    mod(x)

        return _timed(forward, self._reps(m))

    def _time_head(self, m: int) -> float:
        x = torch.randn(m, self.hidden, dtype=self.dtype)
        return _timed(lambda: self.head(x), self._reps(m))

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


LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def layer_linears(layer: Any) -> list[tuple[str, Any]]:
    """A decoder layer's linear modules in forward order, found by name so a different Linear class (a packed
    weight) is still found."""
    found = []
    for name in LINEAR_NAMES:
        module = layer
        for part in name.split("."):
            module = getattr(module, part)
        found.append((name, module))
    return found


def in_features(module: Any) -> int:
    n = getattr(module, "in_features", None)
    return int(n) if n is not None else int(module.weight.shape[-1])


def _timed(fn: Any, reps: int) -> float:
    with torch.inference_mode():
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
    return (time.perf_counter() - start) / reps


class Regions:
    """``record_function`` regions around the parts of a step, added from outside the engine: forward hooks
    on the model, its linear modules and its attention modules, and wrappers around the LM head
    (``compute_logits``) and the sampler. A region is the wall time of its part on the calling thread."""

    def __init__(self, engine: LLMEngine) -> None:
        model: Any = engine.runner.model
        self._hook(model, "bench::forward")
        for layer in model.model.layers:
            for _, module in layer_linears(layer):
                self._hook(module, "bench::linear")
            self._hook(layer.self_attn.attn, "bench::attention")
        model.compute_logits = self._wrap(model.compute_logits, "bench::lm_head")
        engine.sampler = self._wrap(engine.sampler, "bench::sampling")  # type: ignore[assignment]

    @staticmethod
    def _hook(module: torch.nn.Module, name: str) -> None:
        open_regions: list[record_function] = []

        def enter(mod: Any, args: Any) -> None:
            region = record_function(name)
            region.__enter__()
            open_regions.append(region)

        def leave(mod: Any, args: Any, out: Any) -> None:
            open_regions.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    @staticmethod
    def _wrap(fn: Any, name: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapped


def speedup_bound(engine_res: RunResult, engine_floor: float, hf_res: RunResult) -> float:
    """Throughput of an engine that spent only its GEMM floor, over transformers' measured throughput."""
    return engine_res.output_tokens / engine_floor / hf_res.tok_s


def decode_breakdown(prompts: list[list[int]], args: argparse.Namespace, rows: int, steps: int,
                     gemm: GemmTimer) -> dict[str, Any]:
    """Where one decode step of ``rows`` sequences spends its time: ``rows`` workload prompts are prefilled,
    then ``steps`` pure decode steps are timed plain (``step_ms``) and ``steps`` more under torch.profiler
    with the ``Regions`` above. The regions are forward hooks on the layers' modules, which the C++ layer
    loop (``LlamaForCausalLM.fuse_layers``) does not call: where the engine runs it, the profiled steps run
    the modules instead (the same kernels, plus the Python between them), after ``steps`` plain steps of
    the modules too (``module_step_ms``; ``step_ms`` stays the engine's own step). Parts, in ms per step:
      linear    the decoder layers' linear modules plus the LM head (``lm_head_ms`` is the head alone)
      attention the PagedAttention modules (KV cache write + paged decode attention)
      glue      the rest of the forward pass: embedding, RMS norms, rope, silu * up, residual adds, views
      sampling  the sampler (logits -> tokens)
      python    the rest of ``engine.step``: scheduling, building the inputs, appending and detokenizing
    ``gemm_floor_ms`` is the same linear modules timed alone at ``rows`` rows (``GemmTimer``)."""
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    # The first sequences decode while the last ones prefill: no sequence may finish before the timed steps end.
    prefill_steps = -(-sum(len(p) for p in chosen) // args.max_num_batched_tokens) + 2
    max_tokens = prefill_steps + 3 * steps + 8
    blocks_per_seq = -(-(max(len(p) for p in chosen) + max_tokens) // 16) + 1
    engine = LLMEngine.from_args(
        dtype=args.dtype, num_kv_blocks=rows * blocks_per_seq + 16, max_num_seqs=rows,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, swap_space_mb=0,
        preemption_mode="recompute", max_waiting=rows,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(chosen):
        engine.add_request(f"b{i}", params, prompt_token_ids=ids)
    shape: dict[str, int] = {}
    execute = engine.runner.execute

    def recording_execute(out: Any) -> Any:
        shape["tokens"] = sum(s.num_new_tokens for s in out.scheduled)
        shape["decodes"] = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        return execute(out)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]

    def decode_step() -> None:
        engine.step()
        if shape != {"tokens": rows, "decodes": rows}:
            raise RuntimeError(f"expected a pure decode step of {rows} rows, got {shape}")

    for _ in range(prefill_steps + rows):  # prefill every prompt (chunked, with decodes) until only decodes remain
        engine.step()
        if shape == {"tokens": rows, "decodes": rows}:
            break
    else:
        raise RuntimeError(f"{rows} sequences never reached a pure decode step")
    def timed_ms() -> float:
        decode_step()  # warm-up: the first pure-decode shape may take first-call paths
        start = time.perf_counter()
        for _ in range(steps):
            decode_step()
        return (time.perf_counter() - start) / steps * 1e3

    model = engine.runner.model
    stack = model.stack
    step_ms = timed_ms()
    model.stack = None  # the profiled steps, and their plain twin, run the modules
    module_step_ms = timed_ms() if stack is not None else step_ms
    Regions(engine)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("bench::step"):
                decode_step()
    model.stack = stack
    averages = prof.key_averages()
    ms = {e.key.removeprefix("bench::"): e.cpu_time_total / 1e3 / steps for e in averages
          if e.key.startswith("bench::")}
    part = {k: ms.get(k, 0.0) for k in ("step", "forward", "linear", "lm_head", "attention", "sampling")}
    ops = sorted((e for e in averages if not e.key.startswith("bench::")), key=lambda e: e.self_cpu_time_total,
                 reverse=True)[:8]
    contexts = [len(p) for p in chosen]
    return {
        "rows": rows,
        "context_mean": round(sum(contexts) / rows + 2 * steps, 1),
        "step_ms": round(step_ms, 2),
        "module_step_ms": round(module_step_ms, 2),
        "profiled_step_ms": round(part["step"], 2),
        "linear_ms": round(part["linear"] + part["lm_head"], 2),
        "lm_head_ms": round(part["lm_head"], 2),
        "attention_ms": round(part["attention"], 2),
        "glue_ms": round(part["forward"] - part["linear"] - part["attention"], 2),
        "sampling_ms": round(part["sampling"], 2),
        "python_ms": round(part["step"] - part["forward"] - part["lm_head"] - part["sampling"], 2),
        "gemm_floor_ms": round(gemm.forward_s(rows, rows) * 1e3, 2),
        "top_ops_self_ms": {e.key: round(e.self_cpu_time_total / 1e3 / steps, 2) for e in ops},
    }


def breakdown_line(b: dict[str, Any]) -> str:
    total = b["profiled_step_ms"] or float("nan")
    parts = ", ".join(f"{name} {b[key]:.1f} ms ({b[key] / total:.0%})" for name, key in (
        ("linear", "linear_ms"), ("attention", "attention_ms"), ("glue", "glue_ms"), ("sampling", "sampling_ms"),
        ("python/scheduling", "python_ms")))
    ops = ", ".join(f"{k} {v:.1f}" for k, v in b["top_ops_self_ms"].items())
    modules = (f", {b['module_step_ms']:.1f} ms with the layers as modules" if b["module_step_ms"] != b["step_ms"]
               else "")
    return (f"decode step, {b['rows']} rows, contexts ~{b['context_mean']:.0f} tokens: {b['step_ms']:.1f} ms{modules} "
            f"({b['profiled_step_ms']:.1f} ms profiled, as modules): {parts}; LM head {b['lm_head_ms']:.1f} ms of linear; "
            f"GEMM floor (the same linear modules alone) {b['gemm_floor_ms']:.1f} ms\n"
            f"  top aten ops by self time, ms/step: {ops}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bfloat16 where oneDNN has native bf16 (AVX512-BF16/AMX), else float32")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="context limit of both engine runs; the max_len baseline reserves this much per sequence")
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV budget (blocks of 16) of both engine runs")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--hf-prompts", type=int, default=96,
                        help="transformers runs the first N prompts only (whole batches of --hf-batch): its "
                             "throughput is per batch, so fewer batches estimate it at a fraction of the time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="(a) and (b) this many times each, taking turns; the ratio is the median of the rounds'")
    parser.add_argument("--skip-max-len", action="store_true")
    parser.add_argument("--breakdown-rows", default="32,96",
                        help="decode batch sizes for the per-step breakdown (empty: none)")
    parser.add_argument("--breakdown-steps", type=int, default=8, help="decode steps timed per breakdown")
    parser.add_argument("--quick", action="store_true", help="32 prompts x 32 tokens, 3 breakdown steps, for iterating")
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.hf_prompts, args.breakdown_steps = 32, 32, 32, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    requested = args.dtype
    args.dtype = machine.resolve_dtype(args.dtype)
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("offline_throughput", load_before)
    t_begin = time.perf_counter()
    phases: dict[str, float] = {}

    header = [
        f"# {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}  commit {host.commit}  "
        f"command: python {' '.join(sys.argv)}",
        f"machine: {host.line()}; {torch.get_num_threads()} threads; load avg (1/5/15 min) at start "
        f"{' '.join(map(str, load_before))}" + (" BUSY: numbers not comparable" if load_before[0] > machine.BUSY_LOAD
                                                 else ""),
    ]
    tok = Tokenizer.from_gguf(default_model_path())
    prompts, truncated = build_prompts(tok, load_prompts(args.num_prompts), args.max_prompt_tokens)
    lens = [len(p) for p in prompts]
    hf_prompts = prompts[: max(args.hf_batch, args.hf_prompts // args.hf_batch * args.hf_batch)]
    header += [
        f"workload: {len(prompts)} ShareGPT prompts in the ChatML template (mean {sum(lens) / len(lens):.1f}, "
        f"max {max(lens)} tokens; {truncated} cut to <= {args.max_prompt_tokens}), {args.max_tokens} output "
        f"tokens each (greedy, ignore_eos), dtype {args.dtype} (requested {requested}), all at t=0; "
        f"transformers on the first {len(hf_prompts)}",
        f"engine settings: KV budget {args.num_kv_blocks} blocks x 16 tokens, max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        "preemption recompute, prefix caching on",
    ]
    for line in header:
        print(line, flush=True)

    def phase(name: str, since: float) -> None:
        phases[name] = round(time.perf_counter() - since, 1)

    results: list[RunResult] = []
    engine_runs: list[RunResult] = []
    hf_runs: list[RunResult] = []
    for r in range(max(1, args.rounds)):
        for side in ("engine", "transformers")[:: 1 if r % 2 == 0 else -1]:
            t = time.perf_counter()
            if side == "engine":
                run, util, engine_rows, model = run_engine(prompts, args, "paged")
                engine_runs.append(run)
            elif not args.skip_hf:
                run = run_hf(hf_prompts, args)
                hf_runs.append(run)
            else:
                continue
            phase(side if args.rounds <= 1 else f"{side}_{r + 1}", t)
            results.append(run)
            print(run.line(), flush=True)
    # The round whose ratio is the median stands for the run (its engine result feeds the GEMM floor's share).
    round_ratios = [e.tok_s / h.tok_s for e, h in zip(engine_runs, hf_runs, strict=True)] if hf_runs else []
    mid = sorted(range(len(round_ratios)), key=round_ratios.__getitem__)[len(round_ratios) // 2] if hf_runs else -1
    engine_res = engine_runs[mid]
    hf_res = hf_runs[mid] if hf_runs else None
    max_len_res = None
    max_len_rows: list[tuple[int, int]] = []
    if not args.skip_max_len:
        t = time.perf_counter()
        max_len_res, _, max_len_rows, _ = run_engine(prompts, args, "max_len")
        phase("max_len", t)
        results.append(max_len_res)
        print(max_len_res.line(), flush=True)

    t = time.perf_counter()
    gemm = GemmTimer(model)
    phase("gemm_grid", t)
    engine_floor = sum(gemm.forward_s(r, n) for r, n in engine_rows)
    hf_floor = sum(gemm.forward_s(r, n) for r, n in hf_rows(hf_prompts, args.hf_batch, args.max_tokens))
    floor_line = (f"GEMM floor (the model's linear modules alone, timed now on this machine): engine "
                  f"{engine_floor:.1f} s = {engine_floor / engine_res.seconds:.0%} of its run; transformers' padded "
                  f"batches {hf_floor:.1f} s"
                  + (f" = {hf_floor / hf_res.seconds:.0%} of its run; an engine of pure GEMMs would be "
                     f"{speedup_bound(engine_res, engine_floor, hf_res):.2f}x transformers" if hf_res else ""))
    max_len_floor = sum(gemm.forward_s(r, n) for r, n in max_len_rows)
    if max_len_res:
        floor_line += (f"; max_len {max_len_floor:.1f} s = {max_len_floor / max_len_res.seconds:.0%} of its run "
                       f"(GEMMs alone, paged would be {max_len_floor / engine_floor:.2f}x max_len)")
    results_lines = [floor_line]
    print(floor_line, flush=True)

    breakdowns: dict[str, dict[str, Any]] = {}
    for rows in (int(r) for r in args.breakdown_rows.split(",") if r.strip()):
        t = time.perf_counter()
        b = decode_breakdown(prompts, args, rows, args.breakdown_steps, gemm)
        gc.collect()
        phase(f"breakdown_{rows}", t)
        breakdowns[str(rows)] = b
        results_lines.append(breakdown_line(b))
        print(results_lines[-1], flush=True)

    load_after = machine.load_avg()
    phases["total"] = round(time.perf_counter() - t_begin, 1)
    results_lines.append(f"load avg (1/5/15 min) at end {' '.join(map(str, load_after))}; seconds per phase: "
                         + ", ".join(f"{k} {v}" for k, v in phases.items()))
    print(results_lines[-1], flush=True)

    def ratio(other: RunResult | None) -> float | None:
        return round(engine_res.tok_s / other.tok_s, 2) if other else None

    summary = {
        "dtype": args.dtype,
        "engine_tok_s": round(engine_res.tok_s, 1),
        "hf_static_tok_s": round(hf_res.tok_s, 1) if hf_res else None,
        "max_len_tok_s": round(max_len_res.tok_s, 1) if max_len_res else None,
        "speedup_vs_hf": ratio(hf_res),
        "speedup_vs_hf_rounds": [round(x, 3) for x in round_ratios],
        "speedup_vs_max_len": ratio(max_len_res),
        "kv_utilization": round(util, 4),
        "engine_gemm_share": round(engine_floor / engine_res.seconds, 3),
        "speedup_vs_hf_gemm_bound": round(speedup_bound(engine_res, engine_floor, hf_res), 2) if hf_res else None,
        "gemm_only_speedup_vs_max_len": round(max_len_floor / engine_floor, 2) if max_len_res else None,
        "breakdown": breakdowns,
        "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit, "torch": host.torch,
        "threads": torch.get_num_threads(), "load_before": list(load_before), "load_after": list(load_after),
        "seconds": phases,
    }
    lines = header + [r.line() for r in results] + results_lines + [json.dumps(summary)]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
