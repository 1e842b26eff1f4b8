"""What ``--quantization int8`` costs in accuracy and buys in linear speed, measured in one run.

Accuracy: for the parity prompts (tests/test_llm.py) and the first ``--sharegpt`` ShareGPT prompts, the
float32 model generates up to 32 greedy tokens; each model variant then reads prompt + that continuation
in one teacher-forced pass, and at every continuation position its next-token distribution is compared
with float32's: mean KL(fp32 || variant) in nats, the fraction of positions whose argmax matches, and the
fraction of prompts whose every greedy token matches (then the variant, run greedily, writes exactly the
float32 reply). Variants: bf16 (no int8; the dtype ``auto`` picks here), and int8 with each kernel this CPU
runs, with float32 and bf16 activations, plus int8 with the LM head quantized too.

Speed: every projection of the loaded model (30 layers x qkv, o, gate_up, down) called once on M random
rows, min of ``--repeats``, at M = 1, 32, 96 and each ``--threads``; the LM head timed apart. Ratios are
to packed bf16 (where oneDNN runs it natively) and packed float32.

    python -m benchmarks.quantization_accuracy [--sharegpt 50] [--threads 1,2]

writes its record, ``benchmarks/results/quantization_accuracy/<machine class>/record.txt`` unless ``--out``
says otherwise (machine, ISA, cores, commit; one line per figure; the last line a JSON summary).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.machine import ROOT, describe, load_avg, record_path, warn_if_busy
from chatsvc.bench.dataset import load_prompts
from engine.llm import LLM
from engine.loader import LoadedModel, load_model
from engine.model.attention import prefill_metadata
from engine.model.linear import Linear, onednn_supports
from engine.model.quant import INT8_KERNELS, int8_kernel
from engine.request import SamplingParams
from tests.test_llm import _conversations as parity_conversations

GEN_TOKENS = 32
BLOCK = 16
SHAREGPT = ROOT / ".." / "shared" / "data" / "sharegpt_prompts_1000.json"
ROWS = (1, 32, 96)


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype
    kernel: str | None  # None: no int8
    head: bool = False  # the LM head in int8 too


@dataclass
class Paths:
    """Prompt token ids and the float32 greedy continuation of each, and float32's log-probabilities along it."""
    prompts: list[list[int]]
    replies: list[list[int]]
    ref_logprobs: list[Tensor]


def variants(kernels: list[str], bf16: bool) -> list[Variant]:
    dtypes = [torch.float32, torch.bfloat16] if bf16 else [torch.float32]
    out = [Variant("bf16", torch.bfloat16, None)] if bf16 else []
    for dtype in dtypes:
        short = "bf16" if dtype == torch.bfloat16 else "fp32"
        out += [Variant(f"int8-{k} {short}", dtype, k) for k in kernels]
        out.append(Variant(f"int8-{kernels[0]}+head {short}", dtype, kernels[0], head=True))
    return out


def load(variant: Variant) -> LoadedModel:
    lm = load_model(None, variant.dtype)
    if variant.kernel is not None:
        lm.model.quantize_linears(variant.kernel, head=variant.head)
    return lm


def continuation_logprobs(lm: LoadedModel, prompt: list[int], reply: list[int]) -> Tensor:
    """float32 log-probabilities [len(reply), vocab] of the tokens at the reply's positions, teacher-forced."""
    ids = prompt + reply
    c = lm.config
    meta, positions = prefill_metadata([len(ids)], BLOCK)
    kv = torch.zeros(c.num_layers, 2, -(-len(ids) // BLOCK), BLOCK, c.num_kv_heads, c.head_dim,
                     dtype=lm.model.dtype)
    with torch.inference_mode():
        hidden = lm.model(torch.tensor(ids), positions, kv, meta)[len(prompt) - 1 : len(ids) - 1]
        return lm.model.compute_logits(hidden).log_softmax(-1)


def greedy_paths(convs: list[list[dict[str, str]]]) -> Paths:
    llm = LLM(dtype="float32", num_kv_blocks=1024)
    prompts = [llm.tokenizer.apply_chat_template(c) for c in convs]
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    replies = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    ref = load(Variant("fp32", torch.float32, None))
    logprobs = [continuation_logprobs(ref, p, r) for p, r in zip(prompts, replies, strict=True)]
    return Paths(prompts, replies, logprobs)


def accuracy(lm: LoadedModel, paths: Paths, indices: range) -> dict[str, float]:
    kls: list[Tensor] = []
    agree: list[Tensor] = []
    full = 0
    for i in indices:
        ref = paths.ref_logprobs[i]
        got = continuation_logprobs(lm, paths.prompts[i], paths.replies[i])
        kls.append((ref.exp() * (ref - got)).sum(-1))
        match = ref.argmax(-1) == got.argmax(-1)
        agree.append(match)
        full += bool(match.all())
    kl, same = torch.cat(kls), torch.cat(agree)
    return {"kl": round(kl.mean().item(), 5), "kl_p99": round(kl.quantile(0.99).item(), 4),
            "argmax_agreement": round(same.float().mean().item(), 4),
            "prompts_fully_matching": round(full / len(indices), 4),
            "positions": int(same.numel())}


def linears_time(lm: LoadedModel, rows: int, repeats: int) -> tuple[float, float]:
    """ms for every projection once on ``rows`` random rows, and for the LM head (min of ``repeats``)."""
    layers = [m for m in lm.model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(rows, m.weight.shape[1], dtype=lm.model.dtype) for m in layers]
    hidden = torch.randn(rows, lm.config.hidden_size, dtype=lm.model.dtype)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    with torch.inference_mode():
        stack = best(lambda: [m(x) for m, x in zip(layers, inputs, strict=True)])
        head = best(lambda: lm.model.compute_logits(hidden))
    return stack, head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharegpt", type=int, default=50, help="ShareGPT prompts besides the parity ones")
    ap.add_argument("--max-chars", type=int, default=2000, help="longest ShareGPT prompt taken, in characters")
    ap.add_argument("--threads", default="1,2", help="torch thread counts for the speed part")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/quantization_accuracy/<machine class>/record.txt")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = record_path("quantization_accuracy") / "record.txt"

    load_before = load_avg()
    warn_if_busy("quantization_accuracy", load_before)
    kernels = []
    for k in INT8_KERNELS:
        try:
            kernels.append(int8_kernel("cpu", k))
        except ValueError as exc:
            print(f"int8 kernel {k} skipped: {exc}", flush=True)
    if not kernels:
        raise SystemExit("no int8 kernel runs on this machine")
    try:
        auto: str | None = int8_kernel("cpu")
    except ValueError as exc:  # no VNNI: --quantization int8 is refused here, fbgemm still measured
        print(f"--quantization int8 refused here: {exc}", flush=True)
        auto = None
    kernels.sort(key=lambda k: k != auto)  # the one --quantization int8 picks first
    bf16 = onednn_supports(torch.bfloat16, "cpu")

    parity = parity_conversations()
    sharegpt = [[{"role": "user", "content": p}] for p in load_prompts(SHAREGPT, args.max_chars)[: args.sharegpt]]
    t0 = time.perf_counter()
    paths = greedy_paths(parity + sharegpt)
    sets = {"parity": range(len(parity)), "sharegpt": range(len(parity), len(parity) + len(sharegpt))}
    print(f"fp32 greedy paths of {len(parity)} + {len(sharegpt)} prompts in {time.perf_counter() - t0:.0f} s",
          flush=True)

    threads = [int(t) for t in args.threads.split(",")]
    baseline_speed: dict[str, dict[int, dict[int, tuple[float, float]]]] = {}
    lines: list[str] = []
    summary: dict[str, Any] = {"auto_kernel": auto, "accuracy": {}, "speed_ms": {}}

    def speed(name: str, lm: LoadedModel) -> dict[int, dict[int, tuple[float, float]]]:
        got: dict[int, dict[int, tuple[float, float]]] = {}
        default_threads = torch.get_num_threads()
        for t in threads:
            torch.set_num_threads(t)
            got[t] = {m: linears_time(lm, m, args.repeats) for m in ROWS}
        torch.set_num_threads(default_threads)
        summary["speed_ms"][name] = {str(t): {str(m): [round(s, 3), round(h, 3)] for m, (s, h) in by_m.items()}
                                     for t, by_m in got.items()}
        return got

    fp32 = load(Variant("fp32", torch.float32, None))
    baseline_speed["fp32"] = speed("fp32 packed", fp32)
    del fp32
    for v in variants(kernels, bf16):
        lm = load(v)
        acc = {name: accuracy(lm, paths, idx) for name, idx in sets.items() if len(idx)}
        summary["accuracy"][v.name] = acc
        for name, a in acc.items():
            lines.append(f"accuracy {v.name:24s} {name:8s} KL {a['kl']:.5f} nats (p99 {a['kl_p99']:.4f}), argmax "
                         f"agreement {a['argmax_agreement']:.4f} of {a['positions']} positions, prompts fully "
                         f"matching {a['prompts_fully_matching']:.3f}")
            print(lines[-1], flush=True)
        if not v.head:
            got = speed(v.name, lm)
            if v.kernel is None:
                baseline_speed["bf16"] = got
            for t, by_m in got.items():
                for m, (stack, head) in by_m.items():
                    vs = "  ".join(f"/{b} {stack / baseline_speed[b][t][m][0]:.2f}x" for b in baseline_speed)
                    lines.append(f"speed {v.name:24s} {t} thr M={m:3d}: projections {stack:7.3f} ms ({vs}), "
                                 f"LM head {head:6.3f} ms")
                    print(lines[-1], flush=True)
        del lm
        gc.collect()
    ratios: dict[str, dict[str, float]] = {}
    for v in variants(kernels, bf16):
        if v.kernel is None or v.head:
            continue
        for b, base in baseline_speed.items():
            for t in threads:
                for m in ROWS:
                    stack = summary["speed_ms"][v.name][str(t)][str(m)][0]
                    ratios.setdefault(f"{v.name} / {b}", {})[f"{t}thr M={m}"] = round(stack / base[t][m][0], 3)
    summary["projection_time_ratio"] = ratios

    load_after = load_avg()
    machine = describe(sharegpt_prompts=len(sharegpt), parity_prompts=len(parity), gen_tokens=GEN_TOKENS)
    summary["machine"] = machine.as_dict()
    summary["load_avg"] = {"before": load_before, "after": load_after}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = [f"# int8 quantization: accuracy against float32 and projection speed ({when})",
              f"machine: {machine.line()}",
              f"int8 kernels run here: {', '.join(kernels)} (--quantization int8 picks {auto or 'none: refused'})",
              f"load avg (1/5/15 min) before {' '.join(map(str, load_before))}, after {' '.join(map(str, load_after))}"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join([*header, *lines, json.dumps(summary)]) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0 if all(math.isfinite(a["kl"]) for acc in summary["accuracy"].values() for a in acc.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
