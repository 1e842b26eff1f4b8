"""Structured outputs' cost when serving: every request under a JSON schema against none, on one server.

One ``chatsvc serve`` (as ``benchmarks/serving_vs_vllm.py`` starts it, prefix caching off so that both sides
prefill the same prompts in full) runs serving_vs_vllm.py's workload ``32`` (32 concurrent chats x 128 in /
128 out, ``ignore_eos``) with ``chatsvc bench``, in alternated rounds: side ``plain`` as it is, side
``schema`` with every request under ``SCHEMA`` (``--response-format``), the same prompts in a round, new
prompts each round. ``SCHEMA`` asks for a list of at least 30 structured items, longer than 128 tokens, so
both sides write 128 tokens a request and the batch stays at 32 rows throughout: the tok/s and TPOT differ by
the grammar's cost only. The record's ratio is the median of the rounds' schema / plain output tok/s; the
goal is <= 5% overhead at 32 rows.

Next to it, the mask time per step: the schema side's 32 replies replayed through ``engine.grammar_masks`` in
this process, as the engine's step runs it: the 32 rows' masks on the filler's thread (``MaskFiller.ceilings``,
which the engine overlaps with the forward; here alone, nothing to overlap with), then on the step's own path
``apply_ceilings`` on ``[32, vocab]`` float32 logits and each row's ``accept``; medians over steps.

Usage: python benchmarks/structured_output.py [--rounds 3] [--dtype auto] [--seed 0] [--quick] [--output FILE]
Last line: one JSON object {"plain_tok_s", "schema_tok_s", "schema_over_plain", "overhead_pct",
"ratio_rounds", "plain_tok_s_rounds", "schema_tok_s_rounds", "plain_tpot_p50", "schema_tpot_p50",
"plain_ttft_p50", "schema_ttft_p50", "schema_finish_ok", "mask": {"rows", "steps", "masks_ms", "apply_ms",
"accept_ms", "on_step_path_ms", "masks_share_of_plain_tpot", "on_step_path_share_of_plain_tpot", "compile_ms",
"tokens_refused"}, "rounds", "cpu", "isa",
"cores", "commit", "torch", "dtype", "load_before", "load_after"} (tok/s and latencies: medians over rounds,
latencies in ms).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import machine  # noqa: E402
import serving_ab  # noqa: E402
import serving_vs_vllm as sv  # noqa: E402

WORKLOAD = "32"
SIDES = ("plain", "schema")
# At least 30 items of three fields each: far past 128 tokens, so no reply ends before max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["steps"],
    "properties": {"steps": {"type": "array", "minItems": 30, "items": {
        "type": "object", "required": ["title", "minutes", "kind"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                       "kind": {"enum": ["prepare", "cook", "rest", "serve", "other"]}}}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "steps", "strict": True, "schema": SCHEMA}}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def med(values: list[float | None]) -> float | None:
    return serving_ab.med(values)


def sample_replies(url: str, prompts: int, max_tokens: int) -> list[str]:
    """``prompts`` replies under the schema (non-streamed, at once, so the server batches them)."""
    import httpx

    def one(i: int) -> str:
        body = {"messages": [{"role": "user", "content": f"List the steps of recipe number {i} as JSON."}],
                "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True,
                "response_format": RESPONSE_FORMAT}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])

    with concurrent.futures.ThreadPoolExecutor(prompts) as pool:
        return list(pool.map(one, range(prompts)))


def mask_replay(replies: list[str]) -> dict[str, Any]:
    """The engine's grammar work per step for ``len(replies)`` rows, each following its reply's tokens: the
    masks made on the filler's thread (``MaskFiller.ceilings``: llguidance's fill and the ceilings), which the
    engine overlaps with the forward, and then on the step's own path the sampler's ``apply_ceilings`` and
    each row's ``accept``."""
    import torch

    from engine.grammar import GrammarCompiler, GrammarSpec, GrammarState
    from engine.grammar_masks import MaskFiller, apply_ceilings
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(sv.HF_DIR)
    vocab = json.loads((sv.HF_DIR / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler.from_hf(tok.hf, vocab, tok.eos_token_ids)
    spec = GrammarSpec.json_schema(SCHEMA)
    started = time.perf_counter()
    compiled = compiler.compile(spec)
    compile_ms = (time.perf_counter() - started) * 1e3
    sequences = [tok.encode(text) for text in replies]
    states = [GrammarState(compiled) for _ in replies]
    rows = list(range(len(replies)))
    logits = torch.randn(len(replies), vocab)
    filler = MaskFiller(compiler.vocab_size)
    masks, apply, accept = [], [], []
    refused = 0
    try:
        for step in range(min(len(s) for s in sequences)):
            work = logits.clone()
            t0 = time.perf_counter()
            ceilings = filler.ceilings(states).result()
            t1 = time.perf_counter()
            with torch.inference_mode():
                apply_ceilings(work, ceilings, rows)
            t2 = time.perf_counter()
            for row, state in enumerate(states):
                refused += not state.accept(sequences[row][step])
            t3 = time.perf_counter()
            masks.append(t1 - t0)
            apply.append(t2 - t1)
            accept.append(t3 - t2)
    finally:
        filler.close()

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3) if values else 0.0

    return {"rows": len(replies), "steps": len(masks), "masks_ms": ms(masks), "apply_ms": ms(apply),
            "accept_ms": ms(accept), "on_step_path_ms": round(ms(apply) + ms(accept), 3),
            "compile_ms": round(compile_ms, 2), "tokens_refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 chats x 16 tokens, one round: the plumbing only")
    ap.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it "
                    "(a record: benchmarks/results/structured_output/$(python benchmarks/machine.py)/record.txt)")
    a = ap.parse_args()
    if not (sv.HF_DIR / "config.json").exists():
        ap.error(f"the model's HF directory {sv.HF_DIR} is missing: run benchmarks/serving_vs_vllm.py --prepare-only")
    rounds = 1 if a.quick else a.rounds
    args = sv.workload_args(WORKLOAD, a.quick)
    rows = 4 if a.quick else 32
    host = machine.describe()
    dtype, dtype_flags = sv.ours_dtype(a.dtype)
    kv_gib = sv.fitting_kv_gib(sv.kv_cache_gib(dtype), sv.mem_available_gib(), caches=1)
    uptime_before = uptime()
    load_before = machine.load_avg()
    machine.warn_if_busy("structured_output", load_before)
    runs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="structured-output-") as tmp, contextlib.ExitStack() as stack:
        port = sv.free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = sv.ours_command(port, dtype_flags, kv_gib, prefix_caching=False)
        stack.enter_context(sv.server(cmd, sv.project_env(), url + "/ready", Path(tmp) / "server.log", 600))
        sv.bench(url, "warmup", sv.WARMUP_ARGS, None, a.seed + 1000)
        sv.bench(url, "warmup", [*sv.WARMUP_ARGS, "--response-format", json.dumps(RESPONSE_FORMAT)], None,
                 a.seed + 1001)
        for i in range(rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            per: dict[str, dict[str, Any]] = {}
            for side in order:
                time.sleep(sv.PAUSE_S)
                extra = ["--response-format", json.dumps(RESPONSE_FORMAT)] if side == "schema" else []
                per[side] = sv.bench(url, side, [*args, *extra], Path(tmp) / f"{side}_r{i}.json",
                                     sv.round_seed(a.seed, WORKLOAD, i))
            runs.append(per)
        replies = sample_replies(url, rows, 16 if a.quick else 128)
    mask = mask_replay(replies)
    summary: dict[str, Any] = {}
    ratios = []
    for r in runs:
        plain, schema = serving_ab.field(r["plain"], "output_tok_s"), serving_ab.field(r["schema"], "output_tok_s")
        ratios.append(round(schema / plain, 3) if plain and schema else None)
    for side in SIDES:
        summary[f"{side}_tok_s"] = med([serving_ab.field(r[side], "output_tok_s") for r in runs])
    summary["schema_over_plain"] = med(ratios)
    ratio = summary["schema_over_plain"]
    summary["overhead_pct"] = None if ratio is None else round((1 - ratio) * 100, 1)
    summary["ratio_rounds"] = ratios
    for side in SIDES:
        summary[f"{side}_tok_s_rounds"] = [serving_ab.field(r[side], "output_tok_s") for r in runs]
        summary[f"{side}_tpot_p50"] = med([serving_ab.field(r[side], "tpot_ms") for r in runs])
        summary[f"{side}_ttft_p50"] = med([serving_ab.field(r[side], "ttft_ms") for r in runs])
    # Every schema request ran to max_tokens without an error (a refused or failed one would show here).
    summary["schema_finish_ok"] = all(not r["schema"].get("errors") for r in runs)
    tpot = summary["plain_tpot_p50"]
    for part in ("masks", "on_step_path"):
        mask[f"{part}_share_of_plain_tpot"] = round(mask[f"{part}_ms"] / tpot, 4) if tpot else None
    summary["mask"] = mask
    summary.update({"rounds": rounds, "cpu": host.cpu, "isa": host.isa, "cores": host.cores, "commit": host.commit,
                    "torch": host.torch, "dtype": dtype, "load_before": list(load_before),
                    "load_after": list(machine.load_avg())})
    lines = [f"# {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: python {' '.join(sys.argv)}",
             f"machine: {host.line()}; dtype {dtype}; load avg at start {' '.join(map(str, load_before))}",
             f"workload {WORKLOAD} ({sv.WORKLOADS[WORKLOAD]['title']}): output tok/s plain {summary['plain_tok_s']}, "
             f"every request under the schema {summary['schema_tok_s']} (medians; per round "
             f"{serving_ab.fmt(summary['plain_tok_s_rounds'])} and {serving_ab.fmt(summary['schema_tok_s_rounds'])}); "
             f"schema / plain per round {ratios}, median {ratio} (overhead {summary['overhead_pct']}%); TPOT p50 "
             f"plain {summary['plain_tpot_p50']} ms, schema {summary['schema_tpot_p50']} ms",
             f"mask time per step at {mask['rows']} rows (median of {mask['steps']} steps): the masks on the "
             f"filler's thread {mask['masks_ms']} ms ({mask['masks_share_of_plain_tpot']} of the plain TPOT, "
             f"overlapped with the forward); on the step's path apply {mask['apply_ms']} ms + accept "
             f"{mask['accept_ms']} ms = {mask['on_step_path_share_of_plain_tpot']} of the plain TPOT; the schema's "
             f"compile {mask['compile_ms']} ms",
             f"uptime before: {uptime_before}; after: {uptime()}",
             json.dumps(summary)]
    machine.report(lines, a.output)


if __name__ == "__main__":
    main()
