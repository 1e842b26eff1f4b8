"""Regenerates every page that shows benchmark results from the records in ``benchmarks/results/``:

- ``benchmarks/results/index.json`` and ``benchmarks/results/README.md``: the records kept (the newest of
  each benchmark per machine class) and the superseded ones, each with the commit that still holds it;
- ``docs/performance.md``: every kept record's figures, by benchmark and machine class;
- the performance table in ``README.md`` (between the two marker comments): one figure per benchmark and
  class, each linking its record, then one row per figure of the paper's end-to-end experiments, whose
  records live in ``docs/paper/`` (``PAPER_RECORDS``), our ratio next to the paper's.

Usage: python benchmarks/results_index.py [--check]

A record is ``benchmarks/results/<benchmark>/<class>/`` holding ``record.json`` (a JSON record) or
``record.txt`` (a report as ``machine.report`` writes it: a ``# <date> commit <sha> command: ...`` line, a
``machine:`` line, the report, and a last line with the run's JSON). ``<class>`` is ``machine.machine_class``
of the run (``avx2-fp32``, ``avx512-bf16``, ``amx-bf16``...) or ``any`` where the figures do not depend on the
machine. A benchmark run writes its record there, replacing the previous one; running this script then
moves the previous one to the index's superseded list, with the commit that holds it. ``--check`` writes
nothing and exits 1 when a page differs from what the records give (``tests/test_results_index.py`` does
the same).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks/ is a folder, not an installed package

from benchmarks.machine import machine_class  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAPER = ROOT / "docs" / "paper"
INDEX_JSON = RESULTS / "index.json"
INDEX_MD = RESULTS / "README.md"
PERFORMANCE_MD = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
COMMAND = "python benchmarks/results_index.py"
BEGIN = f"<!-- performance table: generated from benchmarks/results by `{COMMAND}`; do not edit -->"
END = "<!-- end of the generated performance table -->"
RECORD_FILES = ("record.json", "record.txt")
CLASS_NAME = re.compile(r"^(any|[a-z0-9]+-[a-z0-9]+)$")


@dataclass(frozen=True)
class Record:
    benchmark: str
    cls: str
    path: str  # the record's file, relative to the repository root
    date: str  # "YYYY-MM-DD HH:MM" UTC
    commit: str
    cpu: str
    command: str
    final: dict[str, Any]

    def index_entry(self) -> dict[str, str]:
        return {"benchmark": self.benchmark, "class": self.cls, "path": self.path, "date": self.date,
                "commit": self.commit, "cpu": self.cpu}


# ---------------------------------------------------------------------------------------------- reading

_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2})")
_STAMP = re.compile(r"^(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})")
_COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40}(?:-dirty)?)")
_CPU = re.compile(r"^#? ?(?:machine|CPU): ([^;,\n]+(?:\([^)]*\))?)", re.M)
_COMMAND = re.compile(r"command: (.+?)\s*$|`((?:\.venv/bin/)?python benchmarks/[^`]+)`", re.M)


def _date(text: str) -> str:
    m = _DATE.search(text) or None
    if m:
        return f"{m.group(1)} {m.group(2)}"
    s = _STAMP.match(text)
    return f"{s.group(1)}-{s.group(2)}-{s.group(3)} {s.group(4)}:{s.group(5)}" if s else "unknown"


def _last_json(text: str) -> dict[str, Any]:
    """The run's JSON: the last line holding a JSON object (``after: {...}`` included)."""
    for line in reversed(text.splitlines()):
        start = line.find("{")
        if start >= 0:
            try:
                value = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def parse(benchmark: str, cls: str, path: str, text: str) -> Record:
    """One record from its file's text (``path`` says which kind)."""
    if path.endswith(".json"):
        data = json.loads(text)
        host = data.get("machine") or {}
        final = data.get("final", data)
        date = _date(str(data.get("date") or (data.get("config") or {}).get("time") or ""))
        return Record(benchmark, cls, path, date, str(host.get("commit", "unknown")), str(host.get("cpu", "unknown")),
                      str(data.get("command") or ""), final)
    final = _last_json(text)
    first = text.splitlines()[0] if text else ""
    commit = final.get("commit") or (m.group(1) if (m := _COMMIT.search(text)) else "unknown")
    machine = final.get("machine")
    recorded_host: dict[str, Any] = machine if isinstance(machine, dict) else {}
    cpu = (final.get("cpu") or recorded_host.get("cpu")
           or (m.group(1).strip() if (m := _CPU.search(text)) else "unknown"))
    command = next((g for m in _COMMAND.finditer(text) for g in m.groups() if g), "")
    return Record(benchmark, cls, path, _date(first), str(commit), str(cpu), command, final)


def load(slot: Path) -> Record:
    """The record in ``benchmarks/results/<benchmark>/<class>/``."""
    for name in RECORD_FILES:
        file = slot / name
        if file.exists():
            if not CLASS_NAME.match(slot.name):
                raise ValueError(f"{slot}: {slot.name!r} is not a machine class (machine.machine_class) nor 'any'")
            # Named as in the repository, wherever ``slot`` lies (tests read records from a temporary folder).
            path = f"{RESULTS.relative_to(ROOT).as_posix()}/{slot.parent.name}/{slot.name}/{name}"
            return parse(slot.parent.name, slot.name, path, file.read_text())
    raise FileNotFoundError(f"{slot}: no {' or '.join(RECORD_FILES)}")


def records(results: Path = RESULTS) -> list[Record]:
    slots = sorted(p for p in results.glob("*/*") if p.is_dir() and not p.name.endswith("-quick"))
    return [load(s) for s in slots if any((s / n).exists() for n in RECORD_FILES)]


# ---------------------------------------------------------------------------------------------- figures


def _x(v: Any, digits: int = 2) -> str:
    return "n/a" if v is None else f"{float(v):.{digits}f}×"


def _n(v: Any, digits: int = 1) -> str:
    return "n/a" if v is None else f"{float(v):,.{digits}f}"


SERVING_WORKLOADS = (("32", "32 chats", "32"), ("64", "64 chats", "64"), ("b", "64 multi-turn sessions", "multi-turn"),
                     ("c", "64 sessions, shared persona", "persona"))


def _serving(f: dict[str, Any]) -> list[tuple[str, str]]:
    """The headline row names every workload the record ran (README's table shows it), then each one's figures."""
    loads = [(key, short) for key, _, short in SERVING_WORKLOADS if f.get(f"workload_{key}")]
    chats = " chats" if all(key.isdigit() for key, _ in loads) else ""
    ttft = [_ttft_ratio(f[f"workload_{key}"]) for key, _ in loads]
    names = f"{' / '.join(short for _, short in loads)}{chats}"
    if any(t is not None for t in ttft):  # records before TTFT was a headline figure have it per workload only
        rows = [(f"chatsvc / vLLM output tok/s; TTFT p50, {names}",
                 f"{' / '.join(_x(f[f'workload_{key}'].get('ratio')) for key, _ in loads)}; "
                 f"{' / '.join(_x(t) for t in ttft)}")]
    else:
        rows = [(f"chatsvc / vLLM output tok/s, {names}",
                 " / ".join(_x(f[f"workload_{key}"].get("ratio")) for key, _ in loads))] if loads else []
    for key, what, _ in SERVING_WORKLOADS:
        w = f.get(f"workload_{key}")
        if not w:
            continue
        rows.append((f"chatsvc / vLLM output tok/s, {what}",
                     f"{_x(w.get('ratio'))} ({_n(w.get('ours_tok_s'))} / {_n(w.get('vllm_tok_s'))} tok/s)"))
        if w.get("ours_goodput") is not None:  # records from before goodput was measured have none
            rows.append((f"goodput req/s (TTFT <= 2 s, TPOT <= 100 ms), {what}, chatsvc vs vLLM",
                         f"{_n(w.get('ours_goodput'), 3)} vs {_n(w.get('vllm_goodput'), 3)} "
                         f"({_x(w.get('goodput_ratio'))})"))
        if w.get("ours_ttft_p99") is not None:  # records from before it was summarized have p50 only
            rows.append((f"TTFT p50 / TTFT p99 / TPOT p50 ms, {what}, chatsvc vs vLLM",
                         f"{_n(w.get('ours_ttft_p50'), 0)} / {_n(w.get('ours_ttft_p99'), 0)} / "
                         f"{_n(w.get('ours_tpot_p50'))} vs {_n(w.get('vllm_ttft_p50'), 0)} / "
                         f"{_n(w.get('vllm_ttft_p99'), 0)} / {_n(w.get('vllm_tpot_p50'))}"))
            continue
        rows.append((f"TTFT p50 / TPOT p50 ms, {what}, chatsvc vs vLLM",
                     f"{_n(w.get('ours_ttft_p50'), 0)} / {_n(w.get('ours_tpot_p50'))} vs "
                     f"{_n(w.get('vllm_ttft_p50'), 0)} / {_n(w.get('vllm_tpot_p50'))}"))
    if f.get("served_over_offline") is not None:
        rows.append(("served / offline engine tok/s (32 chats)", f"{float(f['served_over_offline']):.3f}"))
    if f.get("persona_prefix_ratio") is not None:
        rows.append(("persona prefix caching on / off", _x(f["persona_prefix_ratio"])))
    rows.append(("rounds (ratios are medians over them)", str(f.get("rounds", "n/a"))))
    return rows


def _ttft_ratio(w: dict[str, Any]) -> float | None:
    ours, vllm = w.get("ours_ttft_p50"), w.get("vllm_ttft_p50")
    return round(ours / vllm, 2) if ours and vllm else None


def _offline(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [("engine / transformers static batching", f"{_x(f.get('speedup_vs_hf'))} "
             f"({_n(f.get('engine_tok_s'))} / {_n(f.get('hf_static_tok_s'))} tok/s)"),
            ("paged KV / max-length reservation", f"{_x(f.get('speedup_vs_max_len'))} "
             f"({_n(f.get('engine_tok_s'))} / {_n(f.get('max_len_tok_s'))} tok/s)"),
            ("KV utilization", _n(f.get("kv_utilization"), 3)), ("dtype", str(f.get("dtype", "n/a")))]


def _cpu_attention(f: dict[str, Any]) -> list[tuple[str, str]]:
    g = f.get("speedup_geomean", {})
    rows = [("C++ paged attention / torch reference, geomean: decode, prefill, step",
             f"{_x(g.get('decode'))}, {_x(g.get('prefill'))}, {_x(g.get('step'))}")]
    if f.get("base"):
        b = f.get("base_over_new_geomean", {})
        rows.append((f"time at base {f['base']} / this commit: decode, prefill, step",
                     f"{_x(b.get('decode'), 3)}, {_x(b.get('prefill'), 3)}, {_x(b.get('step'), 3)}"))
    return rows + [("dtype, C++ build", f"{f.get('dtype')}, {f.get('isa')}")]


def _step_ab(f: dict[str, Any]) -> list[tuple[str, str]]:
    r, ms = f.get("base_over_new", {}), f.get("step_ms", {})
    return [(f"decode step time at base {f.get('base')} / this commit, {rows} sequences",
             f"{_x(r.get(rows), 3)} ({ms.get(rows, {}).get('base')} / {ms.get(rows, {}).get('new')} ms)")
            for rows in sorted(r, key=int)]


def _serving_ab(f: dict[str, Any]) -> list[tuple[str, str]]:
    variant = (f.get("label") or f"`{' '.join(f.get('flags') or [])}`" if f.get("flags") or f.get("label")
               else f"`{' '.join(f'{k}={v}' for k, v in (f.get('env') or {}).items())}`")
    return [(f"{variant} / default output tok/s, workload {key}", _x(w.get("variant_over_base")))
            for key, w in ((k[len("workload_"):], v) for k, v in f.items() if k.startswith("workload_"))]


def _grammar_engines(f: dict[str, Any]) -> list[tuple[str, str]]:
    engines = f["engines"]
    names = sorted(engines)
    ms = ", ".join(f"{n} {_n(engines[n]['compile_to_first_mask_ms']['nested'])}" for n in names)
    fill = ", ".join(f"{n} {_n(engines[n]['fill_32_rows_ms'])}" for n in names)
    return [("nested JSON schema, compile to first mask (ms)", ms), ("token masks for 32 rows (ms)", fill)]


def _structured_output(f: dict[str, Any]) -> list[tuple[str, str]]:
    m = f.get("mask", {})
    return [("output tok/s, every request under a JSON schema / none, 32 chats",
             f"{_x(f.get('schema_over_plain'), 3)} ({_n(f.get('schema_tok_s'))} / {_n(f.get('plain_tok_s'))} tok/s)"),
            ("TPOT p50 under the schema / none (ms)", f"{_n(f.get('schema_tpot_p50'))} / {_n(f.get('plain_tpot_p50'))}"),
            *_mask_rows(m)]


def _mask_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    if "masks_ms" in m:  # the masks filled beside the forward; only the apply and accept on the step's path
        return [(f"mask time per step at {m.get('rows')} rows: masks beside the forward; apply, accept on the "
                 "step's path (ms)", f"{_n(m.get('masks_ms'))}; {_n(m.get('apply_ms'))}, {_n(m.get('accept_ms'))}")]
    return [(f"mask time per step at {m.get('rows')} rows: fill, apply, accept (ms)",
             f"{_n(m.get('fill_ms'))}, {_n(m.get('apply_ms'))}, {_n(m.get('accept_ms'))}")]


def _session_return(f: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for length, r in sorted(f.get("lengths", {}).items(), key=lambda kv: -int(kv[0])):  # the longest first
        rows.append((f"returning-turn TTFT p50 at {length} tokens of history: recompute / tiers / after a warm / "
                     "after a restart (s)",
                     f"{_n(r['off_return']['p50'], 2)} / {_n(r['tiers_return']['p50'], 2)} / "
                     f"{_n(r['warm_return']['p50'], 2)} / {_n(r['restart_return']['p50'], 2)}"))
    ratios = f.get("ratios", {})
    rows.append((f"recompute / tiers, recompute / warm at {ratios.get('at_length')} tokens",
                 f"{_x(ratios.get('recompute_over_tiers_p50'), 2)}, {_x(ratios.get('recompute_over_warm_p50'), 2)}"))
    return rows


def _session_return_vs_vllm(f: dict[str, Any]) -> list[tuple[str, str]]:
    def p50(side: Any, key: str = "return") -> Any:
        return ((side or {}).get(key) or {}).get("p50")

    rows = []
    for length, r in sorted(f.get("lengths", {}).items(), key=lambda kv: -int(kv[0])):  # the longest first
        ours, vllm, q = r.get("ours"), r.get("vllm"), r.get("ratios", {})
        rows.append((f"served returning-turn TTFT p50 at {length} tokens of history: vLLM / chatsvc, recompute / "
                     "chatsvc; after a restart, vLLM / chatsvc",
                     f"{_x(q.get('vllm_over_ours_p50'))}, {_x(q.get('recompute_over_ours_p50'))}; "
                     f"{_x(q.get('vllm_restart_over_ours_restart_p50'))}"))
        rows.append((f"TTFT p50 at {length} tokens (s): chatsvc tiers / tiers off / vLLM; after a restart chatsvc / "
                     "vLLM, first turn chatsvc / vLLM",
                     f"{_n(p50(ours), 2)} / {_n(p50(r.get('ours_off')), 2)} / {_n(p50(vllm), 2)}; "
                     f"{_n(p50(ours, 'restart_return'), 2)} / {_n(p50(vllm, 'restart_return'), 2)}, "
                     f"{_n((ours or {}).get('restart_first_s'), 2)} / {_n((vllm or {}).get('restart_first_s'), 2)}"))
    return rows


def _quantization(f: dict[str, Any]) -> list[tuple[str, str]]:
    acc = f.get("accuracy", {})
    # The int8 variant `--quantization int8` runs here (the kernel `auto` picks) first: it is the headline.
    default = f"int8-{f.get('auto_kernel')} fp32"
    names = sorted(acc, key=lambda name: name != default)
    return [(f"{name}: next-token agreement with float32 (ShareGPT), KL nats",
             f"{_n(acc[name]['sharegpt']['argmax_agreement'], 3)}, {_n(acc[name]['sharegpt']['kl'], 4)}")
            for name in names if "sharegpt" in acc[name]]


def _tensor_parallel(f: dict[str, Any]) -> list[tuple[str, str]]:
    runs = {r["tp"]: r for r in f.get("runs", [])}
    rows = [(f"TP={tp} output tok/s", _n(r["tok_s"])) for tp, r in sorted(runs.items())]
    if 1 in runs and len(runs) > 1:
        tp = max(runs)
        rows.insert(0, (f"TP={tp} / TP=1 output tok/s", _x(runs[tp]["tok_s"] / runs[1]["tok_s"])))
        rows.append((f"collectives' share of TP={tp} time", f"{runs[tp]['comm_share']:.0%}"))
    return rows


def _scale_out(f: dict[str, Any]) -> list[tuple[str, str]]:
    s = f.get("setups", {})
    rows = [(f"{name}: output tok/s, TTFT p50 ms, prefix hit rate",
             f"{_n(v.get('output_tok_s'))}, {_n(v.get('ttft_p50_ms'), 0)}, {_n(v.get('prefix_hit_rate'), 2)}")
            for name, v in s.items()]
    if "affinity" in s and "random" in s:
        rows.insert(0, ("affinity / random routing output tok/s",
                        _x(s["affinity"]["output_tok_s"] / s["random"]["output_tok_s"])))
    return rows


def _gateway(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"gateway CPU s per 1,000 streamed tokens, {mode}", _n(f.get(f"{mode}_gateway_cpu_s_per_1k"), 4))
            for mode in ("openai", "ws", "sse") if f.get(f"{mode}_gateway_cpu_s_per_1k") is not None]


def _soak(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [("turns checked, lost, duplicated", f"{f.get('turns_checked')}, {f.get('lost')}, {f.get('duplicated')}"),
            ("all checks pass", "yes" if f.get("ok") else "no"),
            ("5xx outside the fault windows", str(f.get("http_5xx_outside_faults"))),
            ("RSS growth", f"{f.get('rss_growth_pct')}%")]


def _soak_split(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [("turns checked, lost, duplicated", f"{f.get('turns_checked')}, {f.get('lost')}, {f.get('duplicated')}"),
            ("replies cut by the rolling restarts", str(f.get("replies_cut_by_rolling_restarts"))),
            ("well-behaved TTFT p99 before / during the hostile burst",
             f"{_n(f.get('ttft_p99_before_burst_s'), 3)} s / {_n(f.get('ttft_p99_during_burst_s'), 3)} s"),
            ("all checks pass", "yes" if f.get("ok") else "no")]


def _huge_pages(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"decode step on 4 KiB / 2 MiB pages, {rows} sequences", _x(v, 3))
            for rows, v in sorted(f.get("small_over_huge", {}).items(), key=lambda kv: int(kv[0]))]


def _kv_layout(f: dict[str, Any]) -> list[tuple[str, str]]:
    rows = f.get("rows")
    return [(f"decode attention, {rows} sequences x {ctx} tokens, {name} / lockstep", _x(v.get(name), 3))
            for ctx, v in sorted(f.get("over_lockstep", {}).items(), key=lambda kv: int(kv[0]))
            for name in ("contiguous", "random")]


def _gemm_row_band(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [("decode step of 32 sequences, padded to 33 rows / exact", _x(f.get("decode_padded_over_exact"), 3)),
            ("packed linears, 32 rows / 33 rows", _x(f.get("band_over_33"), 3))]


def _kernels_gpu(f: dict[str, Any]) -> list[tuple[str, str]]:
    decode = f.get("decode", {}).get("b256_c8192_hq9_hkv3_d64_bfloat16", {})
    prefill = f.get("prefill_b8_q2048", {})
    return [("checks against the float32 reference pass", "yes" if f.get("checks_ok") else "no"),
            ("decode, 256 sequences x 8k context: bandwidth / device copy", _n(decode.get("frac_of_copy"), 2)),
            ("prefill 8 x 2k tokens, Triton / torch reference", _x(prefill.get("speedup_vs_torch"), 1))]


def _kv(f: dict[str, Any]) -> list[tuple[str, str]]:
    return [("KV utilization, paged / max-length reservation",
             f"{_n(f.get('paged_utilization'), 3)} / {_n(f.get('max_len_utilization'), 3)}"),
            ("mean running sequences, paged / max-length",
             f"{_n(f.get('paged_mean_running'))} / {_n(f.get('max_len_mean_running'))}")]


@dataclass(frozen=True)
class Benchmark:
    title: str
    what: str
    figures: Callable[[dict[str, Any]], list[tuple[str, str]]]


# In the order the pages show them: the user-facing comparisons first, then the component benchmarks.
BENCHMARKS: dict[str, Benchmark] = {
    "serving_vs_vllm": Benchmark(
        "Serving: chatsvc vs vLLM", "The same `chatsvc bench --mode openai` load against `chatsvc serve` and vLLM's "
        "CPU backend on one machine, same model and dtype, in alternated rounds; ratios are medians over rounds.",
        _serving),
    "offline_throughput": Benchmark(
        "Offline throughput", "200 ShareGPT prompts at once through the engine (`LLM.generate`), transformers' "
        "static batching, and the engine with max-length KV reservation.", _offline),
    "scale_out": Benchmark(
        "Scale-out", "One `chatsvc serve` vs a gateway with two Redis-fed workers, routed by session/persona "
        "affinity or at random.", _scale_out),
    "gateway_overhead": Benchmark(
        "Gateway CPU per token", "The gateway's own CPU per streamed token against a fake engine, per transport.",
        _gateway),
    "soak": Benchmark(
        "Soak", "30 minutes of mixed session traffic with a Redis restart and an engine kill half-way: nothing lost, "
        "nothing leaked.", _soak),
    "soak_split": Benchmark(
        "Split soak", "30 minutes of session traffic on two gateways and two workers through rolling restarts, "
        "kill -9s, a Sentinel failover and a hostile key's burst: nothing lost, no reply cut.", _soak_split),
    "kv_utilization": Benchmark(
        "KV-cache utilization", "A simulated schedule of 1,000 requests: paged blocks vs one max-length "
        "reservation per sequence (no model; the figures do not depend on the machine).", _kv),
    "cpu_attention": Benchmark(
        "CPU paged attention", "The C++ paged-attention kernel vs the torch reference on a decode step's inputs.",
        _cpu_attention),
    "step_ab": Benchmark(
        "Decode step A/B", "The engine's decode step at a base commit and at the record's commit, in turns.", _step_ab),
    "serving_ab": Benchmark(
        "Serving A/B", "Two configurations of `chatsvc serve` on the same load in alternated rounds.", _serving_ab),
    "grammar_engines": Benchmark(
        "Grammar engines", "xgrammar vs llguidance for structured outputs, on this model's tokenizer.",
        _grammar_engines),
    "structured_output": Benchmark(
        "Structured outputs when serving", "Workload 32 on one `chatsvc serve` with every request under a JSON "
        "schema vs none, in alternated rounds, and the grammar's mask work per step.", _structured_output),
    "session_return": Benchmark(
        "Returning conversations", "Sessions whose history the pool no longer holds come back: the first "
        "token of their next turn with the KV tiers off (recompute) and on, after a warm, and after a restart.",
        _session_return),
    "session_return_vs_vllm": Benchmark(
        "Returning conversations: chatsvc vs vLLM", "The same returning sessions served over HTTP by `chatsvc "
        "serve` with its KV tiers on and off and by vLLM with prefix caching, same 1 GiB device KV pool, one "
        "request in flight; then after a restart of each server.", _session_return_vs_vllm),
    "quantization_accuracy": Benchmark(
        "int8 quantization", "What `--quantization int8` costs in accuracy (vs float32 logits) and buys in "
        "projection speed.", _quantization),
    "tensor_parallel": Benchmark(
        "Tensor parallelism", "Throughput of TP=1 vs TP=N on one machine and what the collectives cost.",
        _tensor_parallel),
    "huge_pages": Benchmark(
        "Huge pages", "The decode step with torch's large allocations on 2 MiB vs 4 KiB pages.", _huge_pages),
    "kv_layout": Benchmark(
        "KV block layout", "Decode attention over the same sequences with their blocks in the pool in lockstep "
        "(a fresh pool), contiguous per sequence, and at random (a long-running pool's reuse order).",
        _kv_layout),
    "kernels_gpu": Benchmark(
        "Triton kernels on a GPU", "The Triton paged-attention and cache kernels checked against the float32 "
        "reference and timed against torch and a device-to-device copy.", _kernels_gpu),
    "gemm_row_band": Benchmark(
        "GEMM row band", "oneDNN's slow packed-GEMM row band and what padding out of it buys a decode step.",
        _gemm_row_band),
}


# ---------------------------------------------------------------------------------------------- the paper


def _latency_vs_rate(f: dict[str, Any]) -> list[tuple[str, str]]:
    s = f["summary"]

    def paged_over(workload: str, *baselines: str) -> str:
        # A bound where a curve never crossed the threshold in the rates swept (">=", "<="); "?" neither did.
        w = s.get(workload, {})
        ratios, bounds = w.get("ratio_paged_over", {}), w.get("ratio_bound", {})
        signs = {"=": "", ">=": "≥", "<=": "≤"}
        return " / ".join("?" if bounds.get(b) == "?" else signs[bounds.get(b, "=")] + _x(ratios.get(b))
                          for b in baselines)

    rows = [("Fig. 12, ShareGPT: sustained rate, paged / Orca (Max), (Oracle)",
             f"**{paged_over('sharegpt', 'max', 'oracle')}** (paper 2.7-8× / 1.7-2.7×)")]
    # Fig. 13: at the highest ShareGPT rate both ran, the requests paged batched per Orca (Oracle)'s.
    both = {}
    for run in f.get("runs", []):
        if run["workload"] == "sharegpt" and run["policy"] in ("paged", "oracle"):
            both.setdefault(run["rate"], {})[run["policy"]] = run["mean_batched"]
    rates = [r for r, b in both.items() if len(b) == 2 and b["oracle"]]
    if rates:
        top = both[max(rates)]
        rows.append(("Fig. 13, ShareGPT: mean batched requests, paged / Orca (Oracle)",
                     f"**{top['paged'] / top['oracle']:.2f}×** at {max(rates):.2f} req/s (paper 2.4-4.3×)"))
    widths = [k for k in s if k.startswith("alpaca ") and "oracle" in s[k].get("ratio_paged_over", {})]
    if widths:
        rows.append(("Fig. 14, Alpaca-like: sustained rate, paged / Orca (Oracle), " + ", ".join(
            k.removeprefix("alpaca ") for k in widths),
            "**" + ", ".join(paged_over(k, "oracle") for k in widths)
            + "** (paper up to 2.3× for beam search)"))
    rows.append(("Fig. 17, chatbot: sustained rate, paged / Orca (Max), (Pow2), (Oracle)",
                 f"**{paged_over('chatbot', 'max', 'pow2', 'oracle')}** (paper about 2×)"))
    return rows


def _goodput_vs_vllm(f: dict[str, Any]) -> list[tuple[str, str]]:
    s, slo = f["summary"], f.get("slo_ms", {})
    bound = ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items())
    return [(f"SLO goodput ({bound}), peak: chatsvc serve / vLLM",
             f"**{_x(s.get('ratio_ours_over_vllm'))}** ({_n(s['ours']['peak_goodput_req_s'], 2)} / "
             f"{_n(s['vllm']['peak_goodput_req_s'], 2)} req/s; no such figure in the paper)")]


# The paper's end-to-end experiments: their records are docs/paper/<name>.txt (text, plots and JSON last),
# one each, replaced by a new run (git keeps the old ones).
PAPER_RECORDS: dict[str, Benchmark] = {
    "latency_vs_rate": Benchmark(
        "Paper: latency vs rate", "Normalized latency against request rate in this engine, paged allocation "
        "against the Orca reservations (Figs. 12-14, 17).", _latency_vs_rate),
    "goodput_vs_vllm": Benchmark(
        "Paper: goodput vs vLLM", "SLO goodput against request rate over HTTP, `chatsvc serve` against vLLM.",
        _goodput_vs_vllm),
}


def paper_records(paper: Path = PAPER) -> list[Record]:
    out = []
    for name in PAPER_RECORDS:
        file = paper / f"{name}.txt"
        if not file.exists():
            continue
        final = _last_json(file.read_text())
        host = final.get("machine") or {}
        # Both run the model in its default dtype (auto: bf16 where the CPU has it natively).
        cls = machine_class(list(host.get("isa", [])), "auto")
        out.append(Record(name, cls, f"{PAPER.relative_to(ROOT).as_posix()}/{file.name}", "", str(host.get("commit")),
                          str(host.get("cpu")), str(final.get("command", "")), final))
    return out


def paper_rows(papers: list[Record]) -> list[str]:
    return [f"| {PAPER_RECORDS[r.benchmark].title} | `{r.cls}` | {what}: {value} | [{Path(r.path).name}]({r.path}) |"
            for r in papers for what, value in figures(r, PAPER_RECORDS)]


def figures(r: Record, specs: dict[str, Benchmark] = BENCHMARKS) -> list[tuple[str, str]]:
    spec = specs.get(r.benchmark)
    try:
        return spec.figures(r.final) if spec else []
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"{r.path}: its JSON lacks what the {r.benchmark} figures need ({exc!r})") from exc


def _order(rs: list[Record]) -> list[Record]:
    rank = {name: i for i, name in enumerate(BENCHMARKS)}
    return sorted(rs, key=lambda r: (rank.get(r.benchmark, len(rank)), r.benchmark, r.cls))


# ---------------------------------------------------------------------------------------------- the index


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def holding_commit(entry: dict[str, str]) -> str:
    """The newest commit whose copy of ``entry['path']`` is the record of ``entry['date']``: its slot may hold a
    newer record by now, committed or not."""
    for sha in _git("log", "--format=%h", "--", entry["path"]).split():
        text = _git("show", f"{sha}:{entry['path']}")
        if text and parse(entry["benchmark"], entry["class"], entry["path"], text).date == entry["date"]:
            return sha
    return "unknown"


def build_index(kept: list[Record], previous: dict[str, Any]) -> dict[str, Any]:
    """The index of ``kept``; the records ``previous`` listed that are gone or replaced join its superseded
    list (what the previous index said stays as it was)."""
    now = {(r.benchmark, r.cls): r for r in kept}
    superseded = list(previous.get("superseded", []))
    for old in previous.get("records", []):
        new = now.get((old["benchmark"], old["class"]))
        if new is None or new.date != old["date"] or new.path != old["path"]:
            why = (f"replaced by the record of {new.date}" if new is not None
                   else "removed")
            superseded.append({"path": old["path"], "commit": holding_commit(old), "benchmark": old["benchmark"],
                               "class": old["class"], "date": old["date"], "why": why})
    return {"generated_by": COMMAND, "records": [r.index_entry() for r in _order(kept)], "superseded": superseded}


# ---------------------------------------------------------------------------------------------- pages


def _link(r: Record, from_dir: str) -> str:
    """``r``'s record folder as a relative link from ``from_dir`` (a folder relative to the repository)."""
    depth = len(Path(from_dir).parts) if from_dir else 0
    return "../" * depth + str(Path(r.path).parent.as_posix()) + "/"


def readme_table(kept: list[Record], papers: list[Record] | None = None) -> str:
    lines = [BEGIN, "", "| benchmark | machine class | figure | record |", "|---|---|---|---|"]
    for r in _order(kept):
        first = figures(r)[:1]
        figure = f"{first[0][0]}: **{first[0][1]}**" if first else "see the record"
        title = BENCHMARKS[r.benchmark].title if r.benchmark in BENCHMARKS else r.benchmark
        lines.append(f"| {title} | `{r.cls}` | {figure} | [{r.date[:10]}]({_link(r, '')}) |")
    lines += paper_rows(papers or [])
    return "\n".join([*lines, "", END])


def performance_page(kept: list[Record]) -> str:
    out = ["# Performance", "",
           f"Generated by `{COMMAND}` from the records in [`benchmarks/results/`](../benchmarks/results/); do not edit "
           "(`tests/test_results_index.py` fails when this page and the records disagree).", "",
           "Each benchmark keeps its newest record per machine class. A class is the CPU's instruction-set tier "
           "(lowered by any ISA cap the run was made under) and the model's dtype: `avx2-fp32` (AVX2, float32), "
           "`avx512-bf16` (AVX-512 with native bf16), `amx-bf16` (AMX tiles, bf16); `any` where the figures do not "
           "depend on the machine. Numbers are comparable within a class only: bf16 matmuls are several times "
           "faster with AMX than on an AVX2 core. Each record names its CPU, cores, load averages, commit and "
           "command. Superseded records are listed, with the commit that holds each, "
           "in [`benchmarks/results/README.md`](../benchmarks/results/README.md).", ""]
    by_benchmark: dict[str, list[Record]] = {}
    for r in _order(kept):
        by_benchmark.setdefault(r.benchmark, []).append(r)
    for name, rs in by_benchmark.items():
        spec = BENCHMARKS.get(name)
        out += [f"## {spec.title if spec else name}", ""]
        if spec:
            out += [spec.what, ""]
        out += [f"Script: [`benchmarks/{name}.py`](../benchmarks/{name}.py).", ""]
        for r in rs:
            where = "machine-independent" if r.cls == "any" else r.cpu
            out += [f"### `{r.cls}`: {where}, {r.date} UTC, commit `{r.commit}`", "",
                    f"Record: [`{Path(r.path).parent.as_posix()}/`]({_link(r, 'docs')})"
                    + (f"; run as: `{r.command}`" if r.command else ""), ""]
            rows = figures(r)
            if rows:
                out += ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    return "\n".join(out).rstrip() + "\n"


def index_page(index: dict[str, Any]) -> str:
    out = ["# Benchmark records", "",
           f"Generated by `{COMMAND}`; do not edit. Each benchmark keeps its newest record per machine class in "
           "`<benchmark>/<class>/` (see `benchmarks/machine.py`, `machine_class`); the figures are on "
           "[`docs/performance.md`](../../docs/performance.md). A run replaces the record of its class (its "
           "script writes there: `--output benchmarks/results/<benchmark>/$(python benchmarks/machine.py)/record.txt` "
           "for the report-writing scripts, `serving_vs_vllm.py` by itself); then run the command above and commit "
           "the record with the pages it changed. Superseded records stay in git history: `git show "
           "<commit>:<path>` (or `git checkout <commit> -- <path>`) brings one back.", "",
           "## Kept", "", "| benchmark | class | date (UTC) | commit | CPU | record |", "|---|---|---|---|---|---|"]
    for e in index["records"]:
        folder = Path(e["path"]).parent.relative_to("benchmarks/results").as_posix()
        out.append(f"| {e['benchmark']} | `{e['class']}` | {e['date']} | `{e['commit']}` | {e['cpu']} | "
                   f"[`{folder}/`]({folder}/) |")
    out += ["", "## Superseded", "", "| path | held by commit | class | date | why |", "|---|---|---|---|---|"]
    for e in index["superseded"]:
        out.append(f"| `{e['path']}` | `{e['commit']}` | {e.get('class') or ''} | {e.get('date') or ''} | {e['why']} |")
    return "\n".join(out) + "\n"


def with_readme_table(readme: str, table: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the generated table's markers:\n{BEGIN}\n{END}")
    return readme[:start] + table + readme[end + len(END):]


def render(results: Path = RESULTS) -> dict[Path, str]:
    """Every generated file and what it should hold, from the records and the index's superseded list."""
    kept = records(results)
    previous = json.loads(INDEX_JSON.read_text()) if INDEX_JSON.exists() else {}
    index = build_index(kept, previous)
    return {INDEX_JSON: json.dumps(index, indent=1) + "\n", INDEX_MD: index_page(index),
            PERFORMANCE_MD: performance_page(kept),
            README: with_readme_table(README.read_text(), readme_table(kept, paper_records()))}


def stale(pages: dict[Path, str]) -> list[Path]:
    return [p for p, text in pages.items() if not p.exists() or p.read_text() != text]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    a = ap.parse_args()
    pages = render()
    old = stale(pages)
    if a.check:
        for p in old:
            print(f"stale: {p.relative_to(ROOT)} (run `{COMMAND}`)", file=sys.stderr)
        return 1 if old else 0
    for p in old:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(pages[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
