"""Two configurations of ``chatsvc serve`` side by side on the same load, in alternated rounds.

For serving-level settings that the engine's own step cannot show: OpenMP thread placement, the gateway's
scheduling, server flags. Side ``base`` is ``chatsvc serve`` as ``benchmarks/serving_vs_vllm.py`` starts it (its
defaults, the limits shared with vLLM); side ``variant`` is the same command with ``--env`` added to its
environment (it reaches the engine process too) and ``--flags`` added to its command line. Both servers stay
up together (an idle one waits on its socket) and every workload runs on each in turn, ``--rounds`` times,
the first side alternating; each round's prompts are new. A shared 2-vCPU VM swings 2-3x between minutes,
so each ratio is taken between runs a minute apart, and the record's ratio is the median over rounds (every
round kept). The workloads are serving_vs_vllm.py's (``32``: 32 concurrent chats x 128 in / 128 out, ``64``,
``b``, ``c``).

Both sides load the HF directory serving_vs_vllm.py converts (``--prepare-only`` makes it).

Usage: python benchmarks/serving_ab.py [--env VAR=VALUE[,...]] [--flags='--FLAG ...'] [--workloads 32,64]
           [--rounds 3] [--dtype auto] [--output FILE]
Last line: one JSON object {"env": {...}, "flags": [...], "workload_<k>": {"base_tok_s", "variant_tok_s",
"variant_over_base", "ratio_rounds", "base_tok_s_rounds", "variant_tok_s_rounds", "base_tpot_p50",
"variant_tpot_p50", "base_ttft_p50", "variant_ttft_p50"}, "rounds", "cpu", "isa", "cores", "commit", "torch", "dtype", "load_before",
"load_after"} (tok/s and latencies: medians over rounds, latencies in ms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]

import machine  # noqa: E402
import serving_vs_vllm as sv  # noqa: E402

SIDES = ("base", "variant")


def parse_env(spec: str) -> dict[str, str]:
    """``VAR=VALUE,VAR=VALUE`` -> a dict (empty spec: none)."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"--env takes VAR=VALUE[,VAR=VALUE...], got {spec!r}")
    return dict(pairs)


def field(result: dict[str, Any], name: str) -> float | None:
    """tok/s, or the p50 of a latency (``ttft_ms``, ``tpot_ms``) of one bench run."""
    value = result.get(name)
    if isinstance(value, dict):
        value = value.get("p50")
    return None if value is None else float(value)


def fmt(values: list[float | None]) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.1f}" for v in values) + "]"


def med(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def summarize(runs: list[dict[str, dict[str, Any]]], key: str) -> dict[str, Any]:
    """One workload over the rounds: each side's medians, and the median of the rounds' variant/base."""
    per_round = []
    for r in runs:
        base, variant = field(r["base"], "output_tok_s"), field(r["variant"], "output_tok_s")
        per_round.append(round(variant / base, 3) if base and variant else None)
    out: dict[str, Any] = {}
    for side in SIDES:
        out[f"{side}_tok_s"] = med([field(r[side], "output_tok_s") for r in runs])
        out[f"{side}_tpot_p50"] = med([field(r[side], "tpot_ms") for r in runs])
        out[f"{side}_ttft_p50"] = med([field(r[side], "ttft_ms") for r in runs])
    out["variant_over_base"] = med(per_round)
    out["ratio_rounds"] = per_round
    for side in SIDES:
        out[f"{side}_tok_s_rounds"] = [field(r[side], "output_tok_s") for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", type=parse_env, default={}, help="the variant's extra environment")
    ap.add_argument("--flags", default="", help="the variant's extra `chatsvc serve` flags, given with =")
    ap.add_argument("--label", default="", help="what the variant is, for the results table (default: its env "
                    "and flags)")
    ap.add_argument("--workloads", default="32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it (a record: "
                        "benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt)")
    a = ap.parse_args()
    keys = [k for k in a.workloads.split(",") if k]
    unknown = [k for k in keys if k not in sv.WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; known: {sorted(sv.WORKLOADS)}")
    if not a.env and not a.flags:
        ap.error("give the variant an --env or --flags: otherwise both sides are the same")

    if not (sv.HF_DIR / "config.json").exists():
        ap.error(f"the model's HF directory {sv.HF_DIR} is missing: run benchmarks/serving_vs_vllm.py --prepare-only")
    host = machine.describe()
    dtype, dtype_flags = sv.ours_dtype(a.dtype)
    kv_gib = sv.fitting_kv_gib(sv.kv_cache_gib(dtype), sv.mem_available_gib(), caches=2)
    extra = tuple(a.flags.split())
    load_before = machine.load_avg()
    machine.warn_if_busy("serving_ab", load_before)
    runs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="serving-ab-") as tmp, contextlib.ExitStack() as stack:
        urls = {}
        for side in SIDES:
            port = sv.free_port()
            cmd = sv.ours_command(port, dtype_flags, kv_gib, extra=extra if side == "variant" else ())
            env = sv.project_env(**(a.env if side == "variant" else {}))
            stack.enter_context(sv.server(cmd, env, f"http://127.0.0.1:{port}/ready", Path(tmp) / f"{side}.log", 600))
            urls[side] = f"http://127.0.0.1:{port}"
            sv.bench(urls[side], side, sv.WARMUP_ARGS, None, a.seed + 1000)
        for i in range(a.rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            per: dict[str, dict[str, dict[str, Any]]] = {key: {} for key in keys}
            for key in keys:
                for side in order:
                    time.sleep(sv.PAUSE_S)
                    per[key][side] = sv.bench(urls[side], side, sv.workload_args(key, False),
                                              Path(tmp) / f"{side}_{key}_r{i}.json", sv.round_seed(a.seed, key, i))
            runs.append({key: per[key] for key in keys})
    summary: dict[str, Any] = {"env": a.env, "flags": list(extra), "label": a.label}
    for key in keys:
        summary[f"workload_{key}"] = summarize([r[key] for r in runs], key)
    summary.update({"rounds": a.rounds, "cpu": host.cpu, "isa": host.isa, "cores": host.cores,
                    "commit": host.commit, "torch": host.torch, "dtype": dtype, "load_before": list(load_before),
                    "load_after": list(machine.load_avg())})
    variant = " ".join([*(f"{k}={v}" for k, v in a.env.items()), *extra])
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; load avg at start {' '.join(map(str, load_before))}",
             *(f"workload {key} ({sv.WORKLOADS[key]['title']}): tok/s base {s['base_tok_s']}, variant ({variant}) "
               f"{s['variant_tok_s']} (medians; per round {fmt(s['base_tok_s_rounds'])} and "
               f"{fmt(s['variant_tok_s_rounds'])}); variant / base per round {s['ratio_rounds']}, median "
               f"{s['variant_over_base']}"
               for key in keys if (s := summary[f"workload_{key}"])),
             json.dumps(summary)]
    machine.report(lines, a.output)


if __name__ == "__main__":
    main()
