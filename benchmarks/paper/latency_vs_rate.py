"""The PagedAttention paper's headline (Figs. 12, 13, 14 and 17): normalized latency against request rate,
paged KV allocation against the Orca baselines, all in this engine so that only memory management differs.

Systems: ``kv_reservation`` = paged (this engine), max (Orca Max: ``max_model_len`` slots per request at
admission), pow2 (prompt + the next power of two of the true output length), oracle (prompt + exactly the true
output length); the true lengths come from the trace (``SamplingParams.reserve_output_tokens``).

Each run drives the real ``LLMEngine`` (real model, greedy unless sampling ``n``, ``ignore_eos`` so every
request generates its trace length) in this process with arrivals in wall-clock time: a Poisson process at the
run's rate for ``--window`` seconds; a request is added once its arrival time has passed and the engine steps
while any is unfinished. Normalized latency: the mean over requests of (finish - arrival) / output tokens, in
s/token. A run still busy ``--window`` seconds after its last arrival is stopped (its unfinished requests count
with their latency so far: a lower bound, marked). Batched requests (Fig. 13): the requests running in a step
(admitted, holding KV), averaged over the run's steps weighted by their duration.

Memory, not compute, must bound admission, as on the paper's GPUs: the KV pool holds ``--kv-tokens`` tokens,
a few Max reservations; ``max_num_seqs`` is far above what any policy fits. Prefix caching is off (the paper's
traces share no prefix; the chat template's system prompt would otherwise be shared by all).

Rates: each workload is first timed with one request alone (its e2e seconds ``T1`` and normalized latency
``L1``, the unloaded latency); the sweep's rates are ``--rate-multipliers`` x 1/T1, and each system's sweep
stops at the first rate above the threshold ``--threshold`` x L1 (higher rates only queue more). The rate a
system sustains: where its curve crosses the threshold, interpolated between the swept rates; a system that
never crosses it sustains at least the highest rate swept, and a ratio is then a bound (``>=``, ``<=``) or, where
neither system crossed, not measured (``?``).

Order: ShareGPT and Alpaca (Figs. 12, 13), the chatbot (Fig. 17), then Fig. 14 (paged and Oracle only); no run
starts after ``--budget-min`` minutes, and a sweep cut short says so in the record.

Usage: python benchmarks/paper/latency_vs_rate.py [--quick] [--figures 12,13,14,17] [--output PATH]
Writes the record (machine, model, command, commit, tables, JSON last line) and one PNG per figure beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency_plots import plot_batched, plot_chatbot, plot_fig12, plot_fig14  # noqa: E402
from traces import (  # noqa: E402
    TraceRequest,
    alpaca_like_trace,
    chatbot_trace,
    poisson_arrivals,
    sharegpt_trace,
)
from workload import PAPER_DIR, ROOT, sharegpt_prompt_ids  # noqa: E402

from benchmarks.machine import describe, load_avg  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

POLICIES = ("paged", "max", "pow2", "oracle")
LABELS = {"paged": "paged (vLLM)", "max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}
# Paper, Fig. 12 (OPT-13B/66B/175B on A100s, ShareGPT): vLLM sustains 2.7-8x Orca (Max), 1.7-2.7x Orca (Oracle).
PAPER_RATIOS = {"max": "2.7-8x", "oracle": "1.7-2.7x"}


@dataclass(frozen=True)
class Workload:
    name: str
    trace: list[TraceRequest]
    max_model_len: int
    kv_tokens: int
    n: int = 1
    beam_width: int = 0

    def params(self, request: TraceRequest, index: int) -> SamplingParams:
        out = request.output_tokens
        if self.beam_width:
            return SamplingParams(use_beam_search=True, best_of=self.beam_width, temperature=0.0, max_tokens=out,
                                  ignore_eos=True, reserve_output_tokens=out)
        if self.n > 1:
            return SamplingParams(n=self.n, temperature=1.0, seed=index, max_tokens=out, ignore_eos=True,
                                  reserve_output_tokens=out)
        return SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, reserve_output_tokens=out)


@dataclass
class Run:
    workload: str
    policy: str
    rate: float
    requests: int
    finished: int
    seconds: float
    normalized_latency: float
    mean_latency_s: float
    mean_batched: float
    output_tokens_per_s: float
    preemptions: int
    stopped: bool  # still busy at the cap: its latency is a lower bound


@dataclass
class Sweep:
    workload: str
    base_rate: float  # 1 / T1, requests/s one at a time
    unloaded_latency: float  # L1, s/token
    threshold: float  # s/token
    runs: list[Run] = field(default_factory=list)
    cut_short: bool = False  # the time budget ran out before every run of the sweep

    def curve(self, policy: str) -> list[Run]:
        return sorted((r for r in self.runs if r.policy == policy), key=lambda r: r.rate)

    def sustained(self, policy: str) -> float | None:
        """The rate at which ``policy``'s curve first crosses the threshold (linear between swept rates); the
        highest rate swept when it never does; None when even the lowest is over it."""
        below: Run | None = None
        for run in self.curve(policy):
            # A run stopped still busy did not keep up, whatever its (lower-bound) latency: at least the threshold.
            latency = max(run.normalized_latency, self.threshold) if run.stopped else run.normalized_latency
            if self.over(run):
                if below is None:
                    return None
                frac = (self.threshold - below.normalized_latency) / (latency - below.normalized_latency)
                return below.rate + frac * (run.rate - below.rate)
            below = run
        return below.rate if below else None

    def never_crossed(self, policy: str) -> bool:
        """Whether ``policy`` stayed under the threshold at every rate swept: its sustained rate is then only
        a lower bound (the highest rate swept)."""
        curve = self.curve(policy)
        return bool(curve) and not any(self.over(r) for r in curve)

    def bound(self, policy: str) -> str:
        """How paged's ratio over ``policy`` reads: "=" measured, ">=" paged never crossed (a lower bound),
        "<=" only ``policy`` never crossed (an upper bound), "?" neither crossed (no ratio)."""
        paged, other = self.never_crossed("paged"), self.never_crossed(policy)
        return "?" if paged and other else ">=" if paged else "<=" if other else "="

    def over(self, run: Run) -> bool:
        """Whether the run is past the threshold: too slow, or stopped still busy."""
        return run.stopped or run.normalized_latency > self.threshold

    def ratio(self, policy: str) -> float | None:
        paged, other = self.sustained("paged"), self.sustained(policy)
        return paged / other if paged and other and self.bound(policy) != "?" else None


def make_engine(kv_tokens: int, max_model_len: int, args: argparse.Namespace) -> Any:
    from engine.engine import LLMEngine

    engine = LLMEngine.from_args(
        block_size=args.block_size, num_kv_blocks=-(-kv_tokens // args.block_size), max_model_len=max_model_len,
        enable_prefix_caching=False, max_num_seqs=256, max_num_batched_tokens=args.max_batched_tokens,
        max_waiting=100_000)
    # Warm-up (first-step allocations), off the clock.
    engine.add_request("warmup", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                reserve_output_tokens=2), prompt_token_ids=[1, 2, 3, 4])
    while engine.has_unfinished():
        engine.step()
    return engine


def use_policy(engine: Any, policy: str) -> None:
    """Switch the idle engine's admission policy: loading the model once per policy would cost more than a
    run on a busy 2-core machine, and the scheduler reads its config afresh at every step."""
    if engine.has_unfinished():
        raise RuntimeError("switch the policy only between runs")
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, kv_reservation=policy)
    engine.scheduler_config = engine.scheduler.config


def serve(engine: Any, workload: Workload, policy: str, rate: float, arrivals: list[float],
          cap_s: float) -> Run:
    """Serve the trace's first ``len(arrivals)`` requests arriving at ``arrivals`` (s from now)."""
    trace = workload.trace[: len(arrivals)]
    if len(trace) < len(arrivals):
        raise ValueError(f"{workload.name}: {len(arrivals)} arrivals but a trace of {len(trace)}")
    before = engine.stats()
    finish: dict[int, float] = {}
    start = time.perf_counter()
    added = 0
    busy_s = batched_s = 0.0
    stopped = False
    while added < len(trace) or engine.has_unfinished():
        now = time.perf_counter() - start
        if now > arrivals[-1] + cap_s:
            stopped = True
            for i in range(added):
                if i not in finish:
                    engine.abort_request(f"q{i}")
            break
        while added < len(trace) and arrivals[added] <= now:
            request = trace[added]
            engine.add_request(f"q{added}", workload.params(request, added), prompt_token_ids=list(request.prompt_ids))
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        t0 = time.perf_counter()
        deltas = engine.step()
        t1 = time.perf_counter()
        ended = {int(d.request_id[1:]) for d in deltas if d.request_finished}
        for i in ended:
            finish[i] = t1 - start
        busy_s += t1 - t0
        batched_s += (t1 - t0) * (engine.stats().requests_running + len(ended))
    end = time.perf_counter() - start
    latencies = [finish.get(i, end) - arrivals[i] for i in range(added)]
    outputs = [trace[i].output_tokens for i in range(added)]
    after = engine.stats()
    return Run(
        workload=workload.name, policy=policy, rate=rate, requests=added, finished=len(finish), seconds=end,
        normalized_latency=sum(lat / out for lat, out in zip(latencies, outputs, strict=True)) / max(1, added),
        mean_latency_s=sum(latencies) / max(1, added), mean_batched=batched_s / busy_s if busy_s else 0.0,
        output_tokens_per_s=sum(trace[i].output_tokens * max(1, workload.n) for i in finish) / end,
        preemptions=(after.preemptions_swap + after.preemptions_recompute
                     - before.preemptions_swap - before.preemptions_recompute),
        stopped=stopped)


def sweep(engine: Any, workload: Workload, policies: tuple[str, ...], multipliers: list[float],
          args: argparse.Namespace, log: Callable[[str], None]) -> Sweep:
    # The unloaded latency: a request of the trace's mean output length, alone, on the paged engine.
    mean_out = sum(r.output_tokens for r in workload.trace) / len(workload.trace)
    typical = min(workload.trace, key=lambda r: abs(r.output_tokens - mean_out))
    alone_workload = Workload(workload.name, [typical], workload.max_model_len, workload.kv_tokens, workload.n,
                              workload.beam_width)
    use_policy(engine, "paged")
    alone = serve(engine, alone_workload, "paged", 0.0, [0.0], cap_s=600.0)
    result = Sweep(workload.name, 1.0 / alone.mean_latency_s, alone.normalized_latency,
                   args.threshold * alone.normalized_latency)
    log(f"{workload.name}: alone {alone.mean_latency_s:.2f} s ({alone.normalized_latency:.3f} s/token); "
        f"threshold {result.threshold:.3f} s/token; base rate {result.base_rate:.3f} req/s")
    for policy in policies:
        use_policy(engine, policy)
        for k, multiplier in enumerate(multipliers):
            if time.monotonic() > args.deadline:
                result.cut_short = True
                log(f"  {policy:>6}: the time budget is spent, the rest of the sweep is left out")
                break
            rate = multiplier * result.base_rate
            arrivals = poisson_arrivals(rate, args.window, args.seed + k, args.min_requests)
            # A system that keeps up finishes within a few unloaded request times of the last arrival.
            run = serve(engine, workload, policy, rate, arrivals, cap_s=max(args.window, 3 / result.base_rate))
            result.runs.append(run)
            log(f"  {policy:>6} rate {rate:.3f}: {run.normalized_latency:.3f} s/token, batched "
                f"{run.mean_batched:.1f}, {run.finished}/{run.requests} done{' (stopped)' if run.stopped else ''}")
            if result.over(run):
                break
    return result


def fmt(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny traces, a few minutes on 2 cores (arrivals run in wall-clock time)")
    parser.add_argument("--figures", default="12,13,14,17", help="which of 12,13,14,17 to run (13 comes with 12)")
    parser.add_argument("--window", type=float, default=15.0, help="seconds of arrivals per run")
    parser.add_argument("--min-requests", type=int, default=3)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--rate-multipliers", type=floats, default=[2.0, 4.0, 8.0, 16.0],
                        help="the rates of Figs. 12, 13, as multiples of 1/T1")
    parser.add_argument("--chat-multipliers", type=floats, default=[1.0, 3.0, 6.0])
    parser.add_argument("--fig14-multipliers", type=floats, default=[2.0, 6.0, 12.0])
    parser.add_argument("--budget-min", type=float, default=24.0,
                        help="no new run starts after this many minutes; a sweep cut short says so")
    parser.add_argument("--threshold", type=float, default=4.0,
                        help="the sustained-rate bound, as a multiple of the unloaded normalized latency")
    parser.add_argument("--sharegpt-output-mean", type=float, default=32.0)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512, help="ShareGPT and Alpaca (Max reserves it)")
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV pool, ShareGPT and Alpaca")
    parser.add_argument("--chat-context", type=int, default=1024)
    parser.add_argument("--chat-max-model-len", type=int, default=2048)
    parser.add_argument("--chat-kv-tokens", type=int, default=6144)
    parser.add_argument("--fig14-widths", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=PAPER_DIR / "latency_vs_rate.txt")
    args = parser.parse_args()
    if args.quick:
        args.window, args.min_requests, args.rate_multipliers = 2.0, 2, [1.0, 8.0]
        args.chat_multipliers, args.fig14_multipliers = [1.0, 8.0], [4.0]
        args.sharegpt_output_mean, args.max_output, args.max_model_len, args.kv_tokens = 4.0, 8, 96, 192
        args.chat_context, args.chat_max_model_len, args.chat_kv_tokens = 48, 128, 256
        args.fig14_widths = [2]
    args.figure_set = {int(f) for f in args.figures.split(",")}
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    args.deadline = time.monotonic() + 60 * args.budget_min
    load_before = load_avg()
    prompts = sharegpt_prompt_ids()
    if args.quick:
        prompts = [p[-40:] for p in prompts]
    count = 400
    sweeps: dict[str, Sweep] = {}
    figures = args.figure_set

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {line}", flush=True)

    short_len = args.max_model_len
    short = make_engine(args.kv_tokens, short_len, args) if figures & {12, 13, 14} else None
    log("engine loaded")
    if figures & {12, 13}:
        share = Workload("sharegpt", sharegpt_trace(prompts, count, args.sharegpt_output_mean, args.max_output,
                                                    short_len, args.seed), short_len, args.kv_tokens)
        sweeps["sharegpt"] = sweep(short, share, POLICIES, args.rate_multipliers, args, log)
    alpaca = alpaca_like_trace(prompts, count, args.seed, max_output=args.max_output,
                               **({"input_mean": 8.0, "output_mean": 4.0, "max_input": 24} if args.quick else {}))
    if figures & {12, 13}:
        sweeps["alpaca"] = sweep(short, Workload("alpaca", alpaca, short_len, args.kv_tokens), POLICIES,
                                 args.rate_multipliers, args, log)
    if 17 in figures:
        chat = chatbot_trace(prompts, count, args.chat_context, args.sharegpt_output_mean, args.max_output,
                             args.seed)
        chat_engine = make_engine(args.chat_kv_tokens, args.chat_max_model_len, args)
        sweeps["chatbot"] = sweep(chat_engine, Workload("chatbot", chat, args.chat_max_model_len, args.chat_kv_tokens),
                                  POLICIES, args.chat_multipliers, args, log)
        del chat_engine
    if 14 in figures:  # last: the time budget cuts it first
        short = short or make_engine(args.kv_tokens, short_len, args)
        for width in args.fig14_widths:
            for kind in ("n", "beam"):
                name = f"alpaca {kind}={width}"
                workload = Workload(name, alpaca, short_len, args.kv_tokens, n=width if kind == "n" else 1,
                                    beam_width=width if kind == "beam" else 0)
                sweeps[name] = sweep(short, workload, ("paged", "oracle"), args.fig14_multipliers, args, log)
    write(args, sweeps, load_before, load_avg(), time.perf_counter() - started)


def write(args: argparse.Namespace, sweeps: dict[str, Sweep], load_before: tuple[float, float, float],
          load_after: tuple[float, float, float], seconds: float) -> None:
    machine = describe()
    script = str(Path(sys.argv[0]).resolve().relative_to(ROOT))
    command = "python " + " ".join(shlex.quote(a) for a in [script, *sys.argv[1:]])
    lines = [
        "PagedAttention paper Figs. 12, 13, 14, 17: normalized latency against request rate, paged against the "
        "Orca reservations",
        f"machine: {machine.line()}",
        f"command: {command}",
        "model: SmolLM2-135M-Instruct (default dtype), the real LLMEngine in this process, arrivals in wall-clock "
        "time",
        f"load average (1, 5, 15 min): before {load_before}, after {load_after}; {seconds / 60:.1f} min in all",
        f"settings: KV pool {args.kv_tokens} tokens, max_model_len {args.max_model_len} (ShareGPT, Alpaca); "
        f"chatbot: context {args.chat_context}, max_model_len {args.chat_max_model_len}, KV pool "
        f"{args.chat_kv_tokens} tokens; ShareGPT/chatbot output mean {args.sharegpt_output_mean} (max "
        f"{args.max_output}); {args.window} s of Poisson arrivals per run (at least {args.min_requests}); "
        f"rates {args.rate_multipliers} x 1/T1; threshold {args.threshold} x the unloaded normalized latency; "
        f"prefix caching off; block size {args.block_size}",
        "memory bounds admission: the pool holds "
        f"{args.kv_tokens // args.max_model_len} Max reservations (ShareGPT/Alpaca) and "
        f"{args.chat_kv_tokens // args.chat_max_model_len} (chatbot), against max_num_seqs 256",
        "",
    ]
    for name, s in sweeps.items():
        lines.append(f"{name}: T1 {1 / s.base_rate:.2f} s alone, L1 {s.unloaded_latency:.3f} s/token, threshold "
                     f"{s.threshold:.3f} s/token")
        lines.append(f"  {'system':>14} {'req/s':>7} {'s/token':>8} {'batched':>8} {'done':>7} {'tok/s':>7} "
                     f"{'preempt':>8}")
        for r in s.runs:
            mark = " (stopped: lower bound)" if r.stopped else ""
            lines.append(f"  {LABELS[r.policy]:>14} {r.rate:7.3f} {r.normalized_latency:8.3f} {r.mean_batched:8.1f} "
                         f"{r.finished:>3}/{r.requests:<3} {r.output_tokens_per_s:7.1f} {r.preemptions:8}{mark}")
        policies = sorted({r.policy for r in s.runs}, key=POLICIES.index)
        sustained = ", ".join(f"{LABELS[p]} {'>=' if s.never_crossed(p) else ''}{fmt(s.sustained(p))}"
                              for p in policies)
        ratios = ", ".join(f"vs {LABELS[p]} " + ("- (neither crossed)" if s.bound(p) == "?" else
                                                   f"{'' if s.bound(p) == '=' else s.bound(p)}{fmt(s.ratio(p), 'x')}")
                           for p in policies if p != "paged")
        lines.append(f"  sustained req/s under the threshold: {sustained}; paged {ratios}")
        if s.cut_short:
            lines.append(f"  cut short: the {args.budget_min}-minute budget ran out during this sweep")
        lines.append("")
    if "sharegpt" in sweeps:
        s = sweeps["sharegpt"]
        def bounded(policy: str) -> str:  # "=" reads as a plain measured ratio
            return f"{'' if s.bound(policy) == '=' else s.bound(policy) + ' '}{fmt(s.ratio(policy), 'x')}"

        lines.append(f"ShareGPT: paged sustains {bounded('max')} Orca (Max)'s rate (paper {PAPER_RATIOS['max']}) "
                     f"and {bounded('oracle')} Orca (Oracle)'s (paper {PAPER_RATIOS['oracle']}); >= a lower bound, "
                     "? neither crossed the threshold")
    summary = {name: {"base_rate": s.base_rate, "unloaded_latency": s.unloaded_latency, "threshold": s.threshold,
                      "sustained": {p: s.sustained(p) for p in POLICIES if s.curve(p)},
                      "ratio_paged_over": {p: s.ratio(p) for p in POLICIES if p != "paged" and s.curve(p)},
                      "ratio_bound": {p: s.bound(p) for p in POLICIES if p != "paged" and s.curve(p)},
                      "never_crossed": [p for p in POLICIES if s.never_crossed(p)]}
               for name, s in sweeps.items()}
    lines.append(json.dumps({"summary": summary, "runs": [asdict(r) for s in sweeps.values() for r in s.runs],
                             "load_before": load_before, "load_after": load_after, "seconds": seconds,
                             "machine": machine.as_dict(), "command": command}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    stem = args.output.with_suffix("")
    pngs = []
    if {"sharegpt", "alpaca"} <= sweeps.keys():
        pngs.append(plot_fig12(sweeps["sharegpt"], sweeps["alpaca"], Path(f"{stem}_fig12.png"), LABELS))
        pngs.append(plot_batched(sweeps["sharegpt"], sweeps["alpaca"], Path(f"{stem}_fig13.png"), LABELS))
    fig14 = [s for name, s in sweeps.items() if name.startswith("alpaca ")]
    if fig14:
        pngs.append(plot_fig14(fig14, Path(f"{stem}_fig14.png"), LABELS))
    if "chatbot" in sweeps:
        pngs.append(plot_chatbot(sweeps["chatbot"], Path(f"{stem}_fig17.png"), LABELS))
    print("\n".join(lines[:-1]))
    print(f"wrote {args.output} and {', '.join(str(p) for p in pngs)}")


if __name__ == "__main__":
    main()
