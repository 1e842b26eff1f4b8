"""Scale-out on one machine: (a) ``chatsvc serve`` in one process, (b) one gateway (``serve --engine redis``) and
two ``chatsvc worker`` processes with affinity routing, (c) the same with random routing.

Each setup gets a fresh redis-server, its server processes, and the same multi-turn persona workload: ``chatsvc
bench --mode sse`` with sessions of several turns whose system prompt is a shared persona (``--system-prompt-
tokens``), greedy, fixed output lengths. Reported per setup:

* output tokens/s, requests/s, TTFT p50 / p99 (from ``chatsvc bench``);
* prefix-cache hit rate: hit / queried prompt tokens over the run, from the gateway's /metrics (for (b) and (c)
  the sum over the workers). What affinity must show: within 10% of (a); random visibly below;
* the Redis hop: mean worker-write to gateway-read time of an output entry (one per request per engine step)
  and per output token, from ``chatsvc_worker_hop_seconds`` / ``_entries`` (same clock: one machine);
* routing decisions and failovers.

On a 2-core machine (b) will not be faster than (a): the two workers split the cores one engine had alone, and
the gateway and Redis take their share. The figures to watch there are the hit rate and the hop.

    python benchmarks/scale_out.py --sessions 8 --turns 3 --max-tokens 32 --json benchmarks/results/scale_out/$(python benchmarks/machine.py)/record.json

The last line printed is one JSON object: {"setups": {name: {...}}, "config": {...}, "machine": {cpu, isa, cores,
commit, ...}, "load": {setup: load averages before/after}}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

SETUPS = ("single", "affinity", "random")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "chatsvc.cli", *args]


class Procs:
    """Child processes started for one setup; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        log = (self.log_dir / f"{name}.log").open("wb")
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop; killing it", file=sys.stderr)
                proc.kill()
                proc.wait(10)


def wait_ready(url: str, procs: Procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in procs.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {procs.log_dir / name}.log")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s:.0f}s")


def scrape(url: str) -> dict[str, float]:
    """The /metrics samples this benchmark reads: name{labels} -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    wanted = ("chatsvc_prefix_cache_hit_tokens_total", "chatsvc_prefix_cache_queried_tokens_total",
              "chatsvc_worker_hop_seconds_total", "chatsvc_worker_hop_entries_total", "chatsvc_route_decisions_total")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in wanted:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


@contextmanager
def setup(name: str, args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    """Start one setup's Redis and servers; yields the gateway's URL."""
    procs = Procs(log_dir)
    redis_port, port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    data = Path(tempfile.mkdtemp(prefix=f"scale-out-{name}-"))
    engine = ["--kv-cache-mb", str(args.kv_cache_mb)]
    if args.model:
        engine += ["--model", args.model]
    try:
        procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(data)])
        if name == "single":
            procs.start("serve", _cli("serve", "--port", str(port), "--redis-url", redis_url, "--log-level",
                                      "warning", *engine))
        else:
            for i in range(args.workers):
                procs.start(f"worker{i}", _cli("worker", "--redis-url", redis_url, "--name", f"w{i}", "--log-level",
                                               "warning", "--engine-threads", str(args.worker_threads), *engine))
            procs.start("gateway", _cli("serve", "--engine", "redis", "--route-policy", name, "--port", str(port),
                                        "--redis-url", redis_url, "--log-level", "warning",
                                        *(["--model", args.model] if args.model else [])))
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, procs, args.startup_timeout)
        if name != "single":  # every worker registered, not just the first
            deadline = time.monotonic() + args.startup_timeout
            while len(httpx.get(url + "/v1/kv", timeout=10).json().get("workers", {})) < args.workers:
                if time.monotonic() > deadline:
                    raise RuntimeError("not every worker registered")
                time.sleep(0.5)
        yield url
    finally:
        procs.stop()
        shutil.rmtree(data, ignore_errors=True)


def run_setup(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    with setup(name, args, log_dir) as url:
        before = scrape(url)
        report = log_dir / f"bench-{name}.json"
        bench = _cli("bench", "--url", url, "--mode", "sse", "--sessions", str(args.sessions), "--turns",
                     str(args.turns), "--system-prompt-tokens", str(args.system_prompt_tokens), "--max-tokens",
                     str(args.max_tokens), "--temperature", "0", "--ignore-eos", "--seed", str(args.seed),
                     "--no-progress", "--json", str(report))
        if args.input_tokens:
            bench += ["--input-tokens", str(args.input_tokens)]
        subprocess.run(bench, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
        after = scrape(url)
    s = json.loads(report.read_text())

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    queried = delta("chatsvc_prefix_cache_queried_tokens_total")
    entries = delta("chatsvc_worker_hop_entries_total")
    hop_s = delta("chatsvc_worker_hop_seconds_total")
    routes = {re.sub(r'.*reason="(\w+)".*', r"\1", k): v - before.get(k, 0.0) for k, v in after.items()
              if k.startswith("chatsvc_route_decisions_total")}
    return {
        "completed": s["completed"], "errors": s["errors"],
        "output_tok_s": s["output_tok_s"], "request_s": s["request_s"],
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "prefix_hit_rate": delta("chatsvc_prefix_cache_hit_tokens_total") / queried if queried else None,
        "hop_ms_per_entry": 1000 * hop_s / entries if entries else None,
        "hop_ms_per_token": 1000 * hop_s / s["total_output_tokens"] if entries and s["total_output_tokens"] else None,
        "route_decisions": {k: v for k, v in routes.items() if v},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch threads per worker (default: half the cores each)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="per engine (each worker, or the single server)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompt-tokens", type=int, default=200, help="the shared persona's size")
    p.add_argument("--input-tokens", type=int, default=0, help="cut or pad user messages to this many tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the result here")
    args = p.parse_args()
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    unknown = set(names) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups: {sorted(unknown)}")
    log_dir = Path(tempfile.mkdtemp(prefix="scale-out-logs-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    host = machine.describe()
    print(f"machine: {host.line()}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    loads: dict[str, Any] = {}
    for name in names:
        with machine.load_window(name, loads):
            results[name] = run_setup(name, args, log_dir)
    header = f"{'setup':<10}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}{'hit rate':>10}{'hop/entry':>11}"
    print(header)
    for name, r in results.items():
        def f(v: float | None, spec: str) -> str:
            return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

        print(f"{name:<10}{f(r['output_tok_s'], '9.1f')}{f(r['request_s'], '8.3f')}{f(r['ttft_p50_ms'], '10.0f')}"
              f"{f(r['ttft_p99_ms'], '9.0f')}{f(r['prefix_hit_rate'], '10.3f')}{f(r['hop_ms_per_entry'], '11.2f')}")
    out = {"setups": results, "config": {**vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "machine": host.as_dict(), "load": loads}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
