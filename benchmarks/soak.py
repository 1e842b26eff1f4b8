"""Soak: mixed session traffic against a real ``chatsvc serve`` (real model, engine in its child process)
and its own redis-server (append-only, fsync always), with one Redis restart and one engine kill half-way.

Traffic, from ``--clients`` concurrent clients, each on a session with a random persona (replaced every
few turns so contexts stay short): SSE turns, WebSocket turns, cancels mid-reply, WebSocket drops
(close 1001 or a cut socket) followed by reconnect-and-resume, and a few malformed or oversized requests.

Checked at the end, against what the clients saw:
- every accepted turn (its POST got 200, or its WS message got a first frame) is in its session's
  history exactly once, followed by an assistant message ("lost" and "duplicated" count the others);
- the KV blocks are free again at idle (all but the persona pins);
- the gateway's RSS grew < 5% from the end of warm-up (20%) to the end (with its engine child: up to
  the faults, which replace that child);
- Redis's key count stays bounded; no 5xx outside the injected fault windows;
- p99 TTFT before the faults and after them.

    python benchmarks/soak.py --duration-s 1800 > benchmarks/results/soak/$(python benchmarks/machine.py)/record.txt

The last line printed is one JSON object with these figures; the exit status is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect

REPO = Path(__file__).resolve().parent.parent
PERSONAS = ("assistant", "pirate", "tutor")
PROMPTS = ("Explain how a paged KV cache works.", "Write a short poem about the sea.",
           "What is the capital of France, and why?", "Give me three tips for learning Python.",
           "Summarise the plot of a heist movie in four sentences.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kb(pid: int, with_children: bool = False) -> int:
    """RSS of ``pid`` (and of its children: the engine process)."""
    total = 0
    for p in [pid, *(children(pid) if with_children else [])]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Redis:
    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.data_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if self.cli("PING") == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def cli(self, *args: str) -> str:
        r = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, check=False)
        return r.stdout.strip()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Stats:
    t0: float
    fault_start: float = float("inf")
    fault_end: float = float("inf")
    windows: list[tuple[float, float]] = field(default_factory=list)
    accepted: int = 0
    checked: int = 0
    lost: int = 0
    duplicated: int = 0
    ttft_before: list[float] = field(default_factory=list)
    ttft_after: list[float] = field(default_factory=list)
    errors_5xx: list[tuple[float, str]] = field(default_factory=list)
    lost_turns: list[str] = field(default_factory=list)  # what each lost turn's session held after it
    counts: dict[str, int] = field(default_factory=dict)
    # (started, first token) of every reply, and (started, ended, outcome) of every turn: the split soak
    # (soak_split.py) reads them against its own windows.
    ttfts: list[tuple[float, float]] = field(default_factory=list)
    turns: list[tuple[float, float, str]] = field(default_factory=list)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def ttft(self, started: float, first: float) -> None:
        self.ttfts.append((started, first - started))
        if started > self.fault_end:
            self.ttft_after.append(first - started)
        elif first < self.fault_start:
            self.ttft_before.append(first - started)

    def ended(self, started: float, outcome: str) -> None:
        """A turn's end as its client saw it: ``whole`` (its reply's terminal event, finished as the client asked),
        or what cut it (``no_terminal``: the stream ended without one; ``finish_interrupted``; ``error_<code>``)."""
        self.turns.append((started, time.monotonic(), outcome))

    def status(self, code: int, what: str) -> None:
        if code >= 500:
            self.errors_5xx.append((time.monotonic(), f"{what}: {code}"))


def outcome(ev: dict[str, Any], cancelled: bool) -> str:
    """A terminal event's outcome for ``Stats.ended``: ``whole`` if the reply ended as its client asked."""
    if ev["type"] == "error":
        return f"error_{ev.get('code')}"
    reason = ev.get("finish_reason")
    return "whole" if reason in ("stop", "length") or cancelled and reason == "abort" else f"finish_{reason}"


class Client:
    def __init__(self, base: str, stats: Stats, rng: random.Random, max_tokens: int,
                 headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.ws_base = base.replace("http://", "ws://")
        self.headers = headers or {}  # an API key's Authorization, on every request and WebSocket
        self.stats = stats
        self.rng = rng
        self.max_tokens = max_tokens
        self.sid: str | None = None
        self.turns = 0
        self.pending: list[str] = []  # user messages of this session's accepted turns
        self.accepted_at: dict[str, float] = {}

    def refused(self) -> None:
        """A request got 503 or no connection: where there are several gateways, the next goes elsewhere."""

    def accept(self, content: str) -> None:
        self.turns += 1
        self.stats.accepted += 1
        self.pending.append(content)
        self.accepted_at[content] = time.monotonic()

    async def verify(self, http: httpx.AsyncClient) -> None:
        """Every accepted turn of the session is in its history exactly once, answered."""
        if self.sid is None or not self.pending:
            return
        deadline = time.monotonic() + 120
        while True:  # a turn whose reader left may still be generating (or waiting for Redis)
            r = await http.get(f"{self.base}/v1/sessions/{self.sid}")
            self.stats.status(r.status_code, "verify")
            if r.status_code == 200 and not r.json()["busy"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        if r.status_code == 404:  # the session is gone, and every turn it had accepted with it
            self.stats.count("verify_session_gone")
            self.stats.lost += len(self.pending)
            self.stats.checked += len(self.pending)
            self.pending = []
            return
        r.raise_for_status()
        msgs = r.json()["messages"]
        for c in self.pending:
            where = [i for i, m in enumerate(msgs) if m["role"] == "user" and m["content"] == c]
            if not where or where[0] + 1 >= len(msgs) or msgs[where[0] + 1]["role"] != "assistant":
                self.stats.lost += 1
                after = [(m["role"], m.get("finish_reason")) for m in msgs[where[0]:where[0] + 3]] if where else None
                self.stats.lost_turns.append(f"session {self.sid}, accepted at "
                                             f"{self.accepted_at.get(c, 0) - self.stats.t0:.1f}s: {after}")
            self.stats.duplicated += max(0, len(where) - 1)
        self.stats.checked += len(self.pending)
        self.pending = []

    async def session(self, http: httpx.AsyncClient) -> str:
        if self.sid is None or self.turns >= 4:
            if self.sid is not None:
                await self.verify(http)
                r = await http.delete(f"{self.base}/v1/sessions/{self.sid}")
                self.stats.status(r.status_code, "delete")
            r = await http.post(f"{self.base}/v1/sessions", json={"persona": self.rng.choice(PERSONAS)})
            self.stats.status(r.status_code, "create")
            r.raise_for_status()
            self.sid, self.turns = r.json()["id"], 0
        return self.sid

    def message(self) -> dict[str, Any]:
        return {"content": f"{self.rng.choice(PROMPTS)} [{self.rng.randrange(10**9)}]",
                "max_tokens": self.rng.randint(8, self.max_tokens), "temperature": 0.7}

    async def sse_turn(self, http: httpx.AsyncClient, cancel: bool) -> None:
        sid = await self.session(http)
        msg = self.message()
        started = time.monotonic()
        last = ""
        async with http.stream("POST", f"{self.base}/v1/sessions/{sid}/messages", json=msg) as r:
            self.stats.status(r.status_code, "sse")
            if r.status_code != 200:
                await r.aread()
                if r.status_code == 503:
                    self.refused()
                await asyncio.sleep(0.5)  # refused (busy, or a fault window): do not spin
                return
            self.accept(msg["content"])
            try:
                end, last = await self._read_sse(http, r, sid, started, cancel)
            except httpx.HTTPError:
                end = None  # the connection broke (its gateway killed): resumed below
        if end is None:  # no terminal event: the gateway stopped; its turn goes on elsewhere (hand-off, take-over)
            self.stats.count("sse_no_terminal")
            self.refused()
            end = await self._resume_sse(http, sid, last)
        self.stats.ended(started, end or "no_terminal")

    async def _read_sse(self, http: httpx.AsyncClient, r: httpx.Response, sid: str, started: float | None,
                        cancel: bool) -> tuple[str | None, str]:
        """Read one reply's events: (its outcome, or None without a terminal event; the last event id)."""
        deltas, last = 0, ""
        async for line in r.aiter_lines():
            if line.startswith("id:"):
                last = line[3:].strip()
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev["type"] == "delta":
                deltas += 1
                if deltas == 1 and started is not None:
                    self.stats.ttft(started, time.monotonic())
                if cancel and deltas == 3:
                    c = await http.post(f"{self.base}/v1/sessions/{sid}/cancel")
                    self.stats.status(c.status_code, "cancel")
            elif ev["type"] in ("done", "error"):
                self.stats.count(f"sse_{ev.get('finish_reason', ev.get('code'))}")
                return outcome(ev, cancel), last
        return None, last

    async def _resume_sse(self, http: httpx.AsyncClient, sid: str, last: str) -> str | None:
        """Resume a reply whose stream ended early, as a client does: from its last event id, on whichever
        gateway answers, for up to a minute."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            try:
                async with http.stream("GET", f"{self.base}/v1/sessions/{sid}/stream",
                                       headers={"Last-Event-ID": last} if last else {}) as r:
                    self.stats.status(r.status_code, "sse_resume")
                    if r.status_code == 200:
                        end, more = await self._read_sse(http, r, sid, None, False)
                        last = more or last
                        if end is not None:
                            self.stats.count("sse_resumed")
                            return end
                    else:
                        await r.aread()
                        if r.status_code in (404, 409):  # no reply to resume: it ended and was stored
                            return f"resume_{r.status_code}"
            except httpx.HTTPError:
                pass
            self.refused()
        return None

    async def ws_turn(self, http: httpx.AsyncClient, drop: bool) -> None:
        sid = await self.session(http)
        msg = self.message()
        last: str | None = None
        async with connect(f"{self.ws_base}/v1/ws", open_timeout=30, additional_headers=self.headers) as ws:
            await ws.send(json.dumps({"type": "hello", "session_id": sid}))
            if (hello := json.loads(await ws.recv()))["type"] == "error":
                self.stats.count(f"ws_hello_{hello.get('code')}")
            started = time.monotonic()
            await ws.send(json.dumps({"type": "message", **msg}))
            frame = json.loads(await ws.recv())
            if frame["type"] == "error":
                self.stats.count(f"ws_refused_{frame['code']}")
                await asyncio.sleep(0.5)
                return
            self.accept(msg["content"])
            self.stats.ttft(started, time.monotonic())
            while frame["type"] == "delta":
                last = frame["id"]
                if drop and self.rng.random() < 0.3:
                    break
                frame = json.loads(await ws.recv())
            else:
                self.stats.count(f"ws_{frame.get('finish_reason', frame.get('code'))}")
                self.stats.ended(started, outcome(frame, False))
                return
            if self.rng.random() < 0.5:
                await ws.close(code=1001)  # a page reload
            else:
                ws.transport.abort()  # a dropped connection: no close frame
                self.stats.count("ws_cut")
        self.stats.count("ws_dropped")
        await asyncio.sleep(self.rng.uniform(0.1, 1.0))
        async with connect(f"{self.ws_base}/v1/ws", open_timeout=30, additional_headers=self.headers) as ws:
            await ws.send(json.dumps({"type": "hello", "session_id": sid}))
            if (hello := json.loads(await ws.recv()))["type"] == "error":
                self.stats.count(f"ws_resume_hello_{hello.get('code')}")
            await ws.send(json.dumps({"type": "resume", "after": last}))
            while (frame := json.loads(await ws.recv()))["type"] == "delta":
                pass
            self.stats.count(f"ws_resumed_{frame.get('finish_reason', frame.get('code'))}")
            self.stats.ended(started, outcome(frame, False))

    async def bad_request(self, http: httpx.AsyncClient) -> None:
        sid = await self.session(http)
        kind = self.rng.choice(["malformed", "oversized", "bad_field"])
        if kind == "malformed":
            r = await http.post(f"{self.base}/v1/sessions/{sid}/messages", content=b"{not json",
                                headers={"content-type": "application/json"})
        elif kind == "oversized":
            r = await http.post(f"{self.base}/v1/chat/completions", content=b"x" * (2 << 20))
        else:
            r = await http.post(f"{self.base}/v1/chat/completions", json={"messages": "nope"})
        self.stats.status(r.status_code, f"bad_{kind}")
        self.stats.count(f"bad_{r.status_code}")

    async def run(self, until: float) -> None:
        async with httpx.AsyncClient(timeout=120, headers=self.headers) as http:
            while time.monotonic() < until:
                pick = self.rng.random()
                try:
                    if pick < 0.35:
                        await self.sse_turn(http, cancel=False)
                    elif pick < 0.45:
                        await self.sse_turn(http, cancel=True)
                    elif pick < 0.75:
                        await self.ws_turn(http, drop=False)
                    elif pick < 0.95:
                        await self.ws_turn(http, drop=True)
                    else:
                        await self.bad_request(http)
                except Exception as exc:  # noqa: BLE001 - a fault window: counted, the client goes on
                    self.stats.count(f"client_error_{type(exc).__name__}")
                    self.refused()
                    self.turns = 99  # verified and replaced on its next turn
                    await asyncio.sleep(0.5)
            try:
                await self.verify(http)
            except Exception as exc:  # noqa: BLE001 - its turns stay unchecked, which fails the check
                self.stats.count(f"verify_error_{type(exc).__name__}")


async def wait_ready(http: httpx.AsyncClient, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(base + "/ready")).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError("the server did not become ready")


async def faults(args: argparse.Namespace, stats: Stats, red: Redis, serve_pid: int, base: str) -> None:
    """Half-way: restart Redis (down ``--redis-down-s``), then kill the engine child process."""
    await asyncio.sleep(args.duration_s * 0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        stats.fault_start = time.monotonic()
        red.kill()
        await asyncio.sleep(args.redis_down_s)
        red.start()
        await wait_ready(http, base, 120)
        stats.windows.append((stats.fault_start, time.monotonic() + 2))
        await asyncio.sleep(10)
        engine_start = time.monotonic()
        # The engine child is the one holding the model: the largest of the gateway's children.
        killed = max(children(serve_pid), key=rss_kb)
        os.kill(killed, signal.SIGKILL)
        # The window lasts until a new engine child serves: /ready alone could still answer 200 from before
        # the gateway noticed the death (on a busy machine that takes more than a second).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and killed in children(serve_pid):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
        await wait_ready(http, base, 300)
        stats.fault_end = time.monotonic() + 2
        stats.windows.append((engine_start, stats.fault_end))


async def sample(stats: Stats, red: Redis, serve_pid: int, until: float, out: dict[str, list[tuple[float, int]]]) -> None:
    while time.monotonic() < until:
        out["rss"].append((time.monotonic(), rss_kb(serve_pid)))
        out["rss_total"].append((time.monotonic(), rss_kb(serve_pid, with_children=True)))
        keys = red.cli("DBSIZE")
        if keys.isdigit():
            out["keys"].append((time.monotonic(), int(keys)))
        await asyncio.sleep(5)


def p99(xs: list[float]) -> float | None:
    return round(statistics.quantiles(xs, n=100)[98], 4) if len(xs) >= 2 else None


async def main_async(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    red = Redis(tmp)
    red.start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "chatsvc.cli", "serve", "--port", str(port), "--redis-url", red.url,
           "--max-model-len", "1024", "--log-level", "warning", *(["--model", args.model] if args.model else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = subprocess.Popen(cmd, cwd=REPO, env=env)
    figures: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            await wait_ready(http, base, 600)
        stats = Stats(time.monotonic())
        until = stats.t0 + args.duration_s
        rng = random.Random(args.seed)
        clients = [Client(base, stats, random.Random(rng.random()), args.max_tokens) for _ in range(args.clients)]
        samples: dict[str, list[tuple[float, int]]] = {"rss": [], "rss_total": [], "keys": []}
        await asyncio.gather(faults(args, stats, red, serve.pid, base), sample(stats, red, serve.pid, until, samples),
                             *(c.run(until) for c in clients))
        # Idle: nothing running, every block free but the persona pins.
        async with httpx.AsyncClient(timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:
                kv = (await http.get(base + "/v1/kv")).json()
                pinned = sum(len(b) for b in kv["pins"].values())
                idle_ok = kv["requests_running"] == 0 and kv["kv_blocks_free"] == kv["kv_blocks_total"] - pinned
                if idle_ok or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        warm_end = stats.t0 + args.duration_s * 0.2
        # The gateway's own RSS; the engine child is replaced by the injected fault, so its figure (with
        # the gateway's) is reported from before the fault only.
        warm = [v for t, v in samples["rss"] if t >= warm_end]
        rss_growth = 100.0 * (warm[-1] - warm[0]) / warm[0] if len(warm) >= 2 else None
        before = [v for t, v in samples["rss_total"] if warm_end <= t < stats.fault_start]
        total_growth = 100.0 * (before[-1] - before[0]) / before[0] if len(before) >= 2 else None
        keys = [v for _, v in samples["keys"]]
        half = stats.t0 + args.duration_s * 0.5
        keys_first = max((v for t, v in samples["keys"] if t < half), default=0)
        keys_second = max((v for t, v in samples["keys"] if t >= half), default=0)
        outside = [e for t, e in stats.errors_5xx if not any(a <= t <= b for a, b in stats.windows)]
        figures = {
            "duration_s": args.duration_s, "clients": args.clients, "turns_accepted": stats.accepted,
            "turns_checked": stats.checked, "lost": stats.lost, "duplicated": stats.duplicated,
            "kv_free_at_idle": idle_ok, "rss_growth_pct": None if rss_growth is None else round(rss_growth, 2),
            "rss_with_engine_growth_pct_before_faults": None if total_growth is None else round(total_growth, 2),
            "redis_keys_max_first_half": keys_first, "redis_keys_max_second_half": keys_second,
            "redis_keys_end": keys[-1] if keys else None,
            "http_5xx_outside_faults": len(outside), "http_5xx_in_faults": len(stats.errors_5xx) - len(outside),
            "ttft_p99_before_s": p99(stats.ttft_before), "ttft_p99_after_s": p99(stats.ttft_after),
            "outcomes": dict(sorted(stats.counts.items())),
        }
        checks = {"no_turn_lost": stats.lost == 0 and stats.duplicated == 0 and stats.checked == stats.accepted,
                  "kv_free_at_idle": idle_ok,
                  "rss_growth_below_5pct": rss_growth is not None and rss_growth < 5.0,
                  "redis_keys_bounded": keys_second <= max(2 * keys_first, keys_first + 200),
                  "no_5xx_outside_faults": not outside}
        figures["checks"] = checks
        figures["ok"] = all(checks.values())
        for e in outside[:10]:
            print("5xx outside the fault windows:", e, file=sys.stderr)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
        red.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(figures))
    return 0 if figures.get("ok") else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96, help="upper bound of each reply's random max_tokens")
    p.add_argument("--redis-down-s", type=float, default=3.0)
    p.add_argument("--model", default=None, help="model path (default: the server's, SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
