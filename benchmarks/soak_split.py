"""Soak of the split form: two gateways (``serve --engine redis``) and two ``chatsvc worker`` processes on a
Redis master + replica watched by one Sentinel (all real processes), under the traffic of benchmarks/soak.py
from well-behaved API keys spread over both gateways, through a schedule of faults:

- a rolling restart (SIGTERM, then the same command on the same port) of gateway 1, gateway 2, worker 1, worker 2;
- one ``SENTINEL FAILOVER``;
- a burst from a hostile key: 8 streamed completions with n=8 and ignore_eos, a persona PUT storm and a session
  flood, after a window of the same length without it (the well-behaved keys' TTFT baseline);
- one kill -9 of each gateway and each worker, each restarted.

Each fault waits for the previous one's recovery; the traffic runs until the duration has passed and the last
fault has recovered. Checked at the end, against what the clients saw (soak.py's check code):

- every turn a well-behaved key got accepted is stored exactly once, answered (``lost``, ``duplicated``);
- ``replies_cut_by_rolling_restarts``: well-behaved turns running during a SIGTERM window (and no other
  fault's) whose client did not get their reply whole (no terminal event even after resuming from its last
  event id, an error, or ``interrupted``): 0. A kill -9 or the failover may cut a reply; its turn must still
  be stored once (``replies_cut_in_kill9_or_failover_windows`` counts those);
- the hostile key is refused (429, 413, ...) and no request gets a 5xx outside the fault windows;
- Redis's key count and used_memory, max per half: the second half within twice the first (+200 keys);
- KV free at idle on both workers (no block held by a request; persona pins may stay).

Reported besides: the well-behaved keys' TTFT p99 before and during the burst, the hostile requests by status,
the fault windows, every turn outcome and the machine. The 30-minute run:

    python benchmarks/soak_split.py --duration-s 1800 > benchmarks/results/soak_split/$(python benchmarks/machine.py)/record.txt

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from soak import REPO, Client, Stats, free_port, p99  # noqa: E402

GOOD_KEYS = ("soak-good-a", "soak-good-b")
HOSTILE_KEY = "soak-hostile"
ADMIN_KEY = "soak-admin"
MASTER = "soak"
# Each fault's place in the run (a fraction of --duration-s); a fault starts no earlier than the previous
# one's recovery. The burst gets a window of its own length before it, free of faults, for the TTFT baseline.
SCHEDULE: tuple[tuple[float, str, str, int], ...] = (
    (0.04, "sigterm", "gateway", 0), (0.10, "sigterm", "gateway", 1), (0.16, "sigterm", "worker", 0),
    (0.24, "sigterm", "worker", 1), (0.32, "failover", "redis", 0), (0.50, "burst", "hostile", 0),
    (0.62, "kill9", "gateway", 0), (0.68, "kill9", "gateway", 1), (0.74, "kill9", "worker", 0),
    (0.84, "kill9", "worker", 1))


class Node:
    """One redis-server, a data node or (``sentinel``) a Sentinel, with its own writable config file."""

    def __init__(self, root: Path, name: str, conf: str, sentinel: bool = False) -> None:
        self.port = free_port()
        self.dir = root / name
        self.dir.mkdir()
        (self.dir / "redis.conf").write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{conf}")
        self.proc = subprocess.Popen(["redis-server", str(self.dir / "redis.conf"), *(["--sentinel"] * sentinel)],
                                     stdout=(self.dir / "log").open("wb"), stderr=subprocess.STDOUT)

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.port, socket_connect_timeout=1, decode_responses=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Topology:
    """Master, replica (append-only, fsync every second: a production setting) and one Sentinel, quorum 1.

    The master refuses writes while no replica is attached (``min-replicas-to-write 1``): a failover detaches
    the replica about a second before the Sentinel names it master, and what the old master acknowledged in
    that second would be dropped when it is demoted (turns accepted, then gone). Refused, those writes fail or
    are retried instead. Only the first master has it, so the promoted replica takes writes at once although
    none is attached to it until the Sentinel demotes the old master; with two replicas or more, every node
    would have it."""

    def __init__(self, root: Path) -> None:
        data = "appendonly yes\nappendfsync everysec\nsave \"\"\n"
        self.master = Node(root, "master", data + "min-replicas-to-write 1\nmin-replicas-max-lag 10\n")
        self.replica = Node(root, "replica", data + f"replicaof 127.0.0.1 {self.master.port}\n")
        self.sentinel = Node(root, "sentinel", sentinel=True, conf=(
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 2000\nsentinel failover-timeout {MASTER} 10000\n"))
        self.nodes = (self.master, self.replica, self.sentinel)

    @property
    def flags(self) -> list[str]:
        return ["--redis-sentinel", f"127.0.0.1:{self.sentinel.port}", "--redis-sentinel-master", MASTER]

    async def _sentinel(self, *cmd: str) -> Any:
        s = self.sentinel.client()
        try:
            return await s.execute_command("SENTINEL", *cmd)
        finally:
            await s.aclose()

    async def master_port(self) -> int:
        return int((await self._sentinel("GET-MASTER-ADDR-BY-NAME", MASTER))[1])

    async def wait_replica_synced(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if any(r["flags"] == "slave" and r["master-link-status"] == "ok"
                       for r in await self._sentinel("REPLICAS", MASTER)):
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError("the Sentinel did not see a synced replica")

    async def failover(self) -> int:
        """SENTINEL FAILOVER, retried while the Sentinel finds no replica fresh enough; the new master's port."""
        old = await self.master_port()
        deadline = time.monotonic() + 60
        while True:
            try:
                await self._sentinel("FAILOVER", MASTER)
                break
            except aioredis.ResponseError:  # NOGOODSLAVE until the replica's state is fresh; INPROG
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        while (port := await self.master_port()) == old:
            if time.monotonic() > deadline:
                raise RuntimeError("the replica was not promoted")
            await asyncio.sleep(0.2)
        return port

    async def master_figures(self) -> tuple[int, int] | None:
        """(key count, used_memory) of the master the Sentinel names now."""
        with contextlib.suppress(Exception):
            c = aioredis.Redis(port=await self.master_port(), socket_connect_timeout=1, socket_timeout=2)
            try:
                return int(await c.dbsize()), int((await c.info("memory"))["used_memory"])
            finally:
                await c.aclose()
        return None

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


class Proc:
    """A gateway or worker started with fixed arguments: restarted with the same ones, logs appended."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.log = name, args, log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})

    async def exit(self, sig: int, timeout_s: float) -> int | None:
        """Send ``sig`` and wait for the process to exit (SIGKILL past ``timeout_s``); its exit status."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if self.proc.poll() is None:
            print(f"{self.name} did not exit in {timeout_s:.0f}s; killing it", file=sys.stderr)
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Split:
    """The processes under test: the Redis topology, the gateways (by URL) and the workers."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root = args, root
        (root / "redis").mkdir()
        self.redis = Topology(root / "redis")
        (root / "secret").write_text(os.urandom(32).hex() + "\n")
        keys = [f for k in GOOD_KEYS + (HOSTILE_KEY,) for f in ("--api-key", k)]
        model = ["--model", args.model] if args.model else []
        self.urls: list[str] = []
        self.gateways: list[Proc] = []
        for i in range(2):
            port = free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            self.gateways.append(Proc(f"gateway{i + 1}", [
                sys.executable, "-m", "chatsvc.cli", "serve", "--engine", "redis", "--port", str(port),
                *self.redis.flags, *keys, "--admin-key", ADMIN_KEY, "--secret-file", str(root / "secret"),
                "--max-model-len", "1024", "--drain-timeout", str(args.drain_timeout_s), "--log-level", "warning",
                *model], root))
        self.workers = [Proc(f"worker{i + 1}", [
            sys.executable, "-m", "chatsvc.cli", "worker", *self.redis.flags, "--name", f"soak-w{i + 1}",
            "--max-model-len", "1024", "--engine-threads", str(args.worker_threads),
            "--drain-timeout", str(args.drain_timeout_s), "--log-level", "warning", *model], root)
            for i in range(2)]
        self.admin = httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {ADMIN_KEY}"})

    async def start(self) -> None:
        await self.redis.wait_replica_synced()
        for w in self.workers:
            w.start()
        for g in self.gateways:
            g.start()
        for i in range(2):
            await self.gateway_ready(i, 600)
            await self.worker_registered(i, 600)

    async def gateway_ready(self, i: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.gateways[i].proc
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"gateway {i + 1} exited ({proc.returncode}); see {self.gateways[i].log}")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.admin.get(self.urls[i] + "/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"gateway {i + 1} not ready within {timeout_s:.0f}s")

    async def kv(self) -> dict[str, Any]:
        """The admin's KV picture, from whichever gateway answers."""
        for url in self.urls:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self.admin.get(url + "/v1/kv")
                if r.status_code == 200:
                    return dict(r.json())
        return {}

    async def worker_registered(self, i: int, timeout_s: float) -> None:
        """Worker ``i``'s current process beats and the gateways see it (its id: name, pid, nonce)."""
        proc = self.workers[i].proc
        assert proc is not None
        prefix = f"soak-w{i + 1}-{proc.pid}-"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {i + 1} exited ({proc.returncode}); see {self.workers[i].log}")
            if any(w.startswith(prefix) for w in (await self.kv()).get("workers", {})):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"worker {i + 1} not registered within {timeout_s:.0f}s")

    async def idle_kv(self, timeout_s: float = 120) -> dict[str, bool]:
        """Per worker: nothing running and no block held by a request (free, cached or pinned only)."""
        deadline = time.monotonic() + timeout_s
        while True:
            kv = await self.kv()
            workers, state = kv.get("workers", {}), kv.get("state", [])
            per = {}
            for pool in kv.get("pools", []):
                held = [s for s in state[pool["offset"]:pool["offset"] + pool["num_blocks"]] if s in ("used", "shared")]
                running = workers.get(pool["worker"], {}).get("requests_running", 1)
                per[pool["worker"]] = not held and running == 0
            if len(per) == 2 and all(per.values()) or time.monotonic() > deadline:
                return per
            await asyncio.sleep(1.0)

    def stop(self) -> None:
        for p in self.gateways + self.workers:
            p.stop()
        self.redis.stop()


class SplitClient(Client):
    """A well-behaved client of one key: starts on one gateway and moves to the other when refused (503) or
    not answered, as behind a load balancer."""

    def __init__(self, urls: list[str], home: int, stats: Stats, rng: random.Random, max_tokens: int,
                 key: str) -> None:
        super().__init__(urls[home], stats, rng, max_tokens, {"authorization": f"Bearer {key}"})
        self.urls, self.at = urls, home

    def refused(self) -> None:
        self.at = (self.at + 1) % len(self.urls)
        self.base = self.urls[self.at]
        self.ws_base = self.base.replace("http://", "ws://")


async def hostile_burst(urls: list[str], until: float, refused: dict[str, int]) -> None:
    """The hostile key's burst until ``until``: 8 streams with n=8 (ignore_eos), a persona PUT storm and a
    session flood, on both gateways; every answer counted by status."""
    headers = {"authorization": f"Bearer {HOSTILE_KEY}"}

    def note(what: str, status: int) -> None:
        refused[f"{what}_{status}"] = refused.get(f"{what}_{status}", 0) + 1

    async def streams(http: httpx.AsyncClient, i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Write an endless story, part {i}."}], "n": 8,
                "max_tokens": 256, "ignore_eos": True, "stream": True}
        while time.monotonic() < until:
            with contextlib.suppress(httpx.HTTPError):
                async with http.stream("POST", urls[i % 2] + "/v1/chat/completions", json=body) as r:
                    note("stream", r.status_code)
                    async for _ in r.aiter_bytes():
                        if time.monotonic() > until:
                            break
            await asyncio.sleep(0.2)

    async def personas(http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            prompt = f"You are persona {i}-{n}. " + "Always answer at great length. " * 40
            with contextlib.suppress(httpx.HTTPError):
                r = await http.put(f"{urls[n % 2]}/v1/personas/hostile-{i}-{n % 24}", json={"system_prompt": prompt})
                note("persona", r.status_code)
            await asyncio.sleep(0.05)

    async def sessions(http: httpx.AsyncClient, i: int) -> None:
        while time.monotonic() < until:
            with contextlib.suppress(httpx.HTTPError):
                r = await http.post(urls[i % 2] + "/v1/sessions", json={})
                note("session", r.status_code)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        await asyncio.gather(*(streams(http, i) for i in range(8)), *(personas(http, i) for i in range(4)),
                             *(sessions(http, i) for i in range(2)))


async def run_faults(args: argparse.Namespace, split: Split, t0: float, windows: list[tuple[str, float, float]],
                     refused: dict[str, int]) -> None:
    """The schedule, each fault after the previous one's recovery; ``windows``: (kind, start, end) of each."""
    settle = args.settle_s
    last_end = t0
    for at, kind, what, i in SCHEDULE:
        if kind == "burst":  # a fault-free baseline window of the burst's length first
            await asyncio.sleep(max(0.0, t0 + at * args.duration_s - time.monotonic(),
                                    last_end + args.burst_s - time.monotonic()))
            start = time.monotonic()
            windows.append(("baseline", start - args.burst_s, start))
            await hostile_burst(split.urls, start + args.burst_s, refused)
            windows.append(("burst", start, time.monotonic()))
            last_end = time.monotonic()
            continue
        await asyncio.sleep(max(0.0, t0 + at * args.duration_s - time.monotonic()))
        start = time.monotonic()
        label = f"{kind}_{what}{i + 1}"
        print(f"{start - t0:7.1f}s {label}", file=sys.stderr)
        if kind == "failover":
            await split.redis.failover()
            await split.redis.wait_replica_synced()  # the old master back as the new one's replica
        elif what == "gateway":
            status = await split.gateways[i].exit(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL,
                                                  args.drain_timeout_s + 60)
            if kind == "sigterm" and status != 0:
                print(f"{label}: exit status {status}", file=sys.stderr)
            split.gateways[i].start()
            await split.gateway_ready(i, 300)
        else:
            await split.workers[i].exit(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL,
                                        args.drain_timeout_s + 60)
            split.workers[i].start()
            await split.worker_registered(i, 600)
        last_end = time.monotonic() + settle  # a take-over (a dead process's turns) lands after the restart
        windows.append((kind, start, last_end))
        await asyncio.sleep(settle)


async def sample(split: Split, stop: asyncio.Event, out: list[tuple[float, int, int]]) -> None:
    while not stop.is_set():
        figures = await split.redis.master_figures()
        if figures is not None:
            out.append((time.monotonic(), *figures))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def main_async(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="soak-split-"))
    print(f"logs in {root}", file=sys.stderr)
    load = machine.load_avg()
    machine.warn_if_busy("the split soak", load)
    split = Split(args, root)
    figures: dict[str, Any] = {}
    try:
        await split.start()
        stats = Stats(time.monotonic())
        windows: list[tuple[str, float, float]] = []
        hostile: dict[str, int] = {}
        rng = random.Random(args.seed)
        clients = [SplitClient(split.urls, i % 2, stats, random.Random(rng.random()), args.max_tokens,
                               GOOD_KEYS[i % len(GOOD_KEYS)]) for i in range(args.clients)]
        samples: list[tuple[float, int, int]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(split, stop, samples))
        faults = asyncio.create_task(run_faults(args, split, stats.t0, windows, hostile))
        until = stats.t0 + args.duration_s
        while True:  # rounds of traffic until both the duration and the schedule are done
            await asyncio.gather(*(c.run(until) for c in clients))
            if faults.done():
                break
            until = time.monotonic() + 5
        faults.result()
        stop.set()
        await sampler
        idle = await split.idle_kv()
        figures = report(args, stats, windows, hostile, samples, idle)
        figures["load"] = {"before": list(load), "after": list(machine.load_avg())}
    finally:
        await split.admin.aclose()
        split.stop()
        if not args.keep_logs:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))
    return 0 if figures.get("ok") else 1


def report(args: argparse.Namespace, stats: Stats, windows: list[tuple[str, float, float]],
           hostile: dict[str, int], samples: list[tuple[float, int, int]], idle: dict[str, bool]) -> dict[str, Any]:
    def overlaps(a: float, b: float, kinds: tuple[str, ...]) -> bool:
        return any(k in kinds and a <= e and b >= s for k, s, e in windows)

    faulty = ("sigterm", "kill9", "failover")
    # A turn running across a SIGTERM window and a kill -9 or the failover is counted for those, which
    # may cut it (its turn is still stored once).
    broken = [(a, b, o) for a, b, o in stats.turns if o != "whole"]
    cut = [(a, b, o) for a, b, o in broken if overlaps(a, b, ("sigterm",)) and not overlaps(a, b, ("kill9", "failover"))]
    outcomes: dict[str, int] = {}
    for _, _, o in stats.turns:
        outcomes[o] = outcomes.get(o, 0) + 1
    span = {k: (s, e) for k, s, e in windows if k in ("baseline", "burst")}

    def ttft_in(kind: str) -> float | None:
        if kind not in span:
            return None
        s, e = span[kind]
        return p99([v for t, v in stats.ttfts if s <= t < e])

    outside = [e for t, e in stats.errors_5xx if not any(s <= t <= e2 for k, s, e2 in windows if k in faulty)]
    end = max(t for t, *_ in samples) if samples else stats.t0
    half = stats.t0 + (end - stats.t0) / 2
    first = [(k, m) for t, k, m in samples if t < half]
    second = [(k, m) for t, k, m in samples if t >= half]
    keys1, keys2 = max((k for k, _ in first), default=0), max((k for k, _ in second), default=0)
    mem1, mem2 = max((m for _, m in first), default=0), max((m for _, m in second), default=0)
    refusals = sum(n for k, n in hostile.items() if 400 <= int(k.rsplit("_", 1)[1]) < 500)
    figures: dict[str, Any] = {
        "duration_s": args.duration_s, "ran_s": round(time.monotonic() - stats.t0, 1), "clients": args.clients,
        "turns_accepted": stats.accepted, "turns_checked": stats.checked, "lost": stats.lost,
        "duplicated": stats.duplicated, "replies_cut_by_rolling_restarts": len(cut),
        "replies_cut_in_kill9_or_failover_windows": sum(1 for a, b, _ in broken if overlaps(a, b, ("kill9", "failover"))),
        "ttft_p99_before_burst_s": ttft_in("baseline"), "ttft_p99_during_burst_s": ttft_in("burst"),
        "ttft_samples_before_burst": sum(1 for t, _ in stats.ttfts if "baseline" in span
                                         and span["baseline"][0] <= t < span["baseline"][1]),
        "hostile_by_status": dict(sorted(hostile.items())), "hostile_refused": refusals,
        "redis_keys_max_first_half": keys1, "redis_keys_max_second_half": keys2,
        "redis_used_memory_max_first_half": mem1, "redis_used_memory_max_second_half": mem2,
        "kv_free_at_idle": idle, "http_5xx_outside_faults": len(outside),
        "http_5xx_in_faults": len(stats.errors_5xx) - len(outside),
        "windows": [(k, round(s - stats.t0, 1), round(e - stats.t0, 1)) for k, s, e in windows],
        "turn_outcomes": dict(sorted(outcomes.items())), "client_outcomes": dict(sorted(stats.counts.items())),
        "machine": machine.describe().as_dict(),
    }
    done = {k for k, *_ in windows}
    checks = {
        "no_turn_lost": stats.lost == 0 and stats.duplicated == 0 and stats.checked == stats.accepted > 0,
        "no_reply_cut_by_rolling_restarts": not cut,
        "every_fault_ran": done >= {"sigterm", "kill9", "failover", "burst"} and len(windows) == len(SCHEDULE) + 1,
        "hostile_refused": refusals > 0,  # its quotas held: 429, 413 and the like
        "no_5xx_outside_faults": not outside,
        "redis_keys_bounded": keys2 <= max(2 * keys1, keys1 + 200),
        "redis_memory_bounded": mem2 <= 2 * mem1,
        "kv_free_at_idle": len(idle) == 2 and all(idle.values()),
    }
    for a, b, o in cut[:10]:
        print(f"cut by a rolling restart: {o}, {a - stats.t0:.1f}s-{b - stats.t0:.1f}s", file=sys.stderr)
    for line in stats.lost_turns[:10]:
        print("lost:", line, file=sys.stderr)
    for e in outside[:10]:
        print("5xx outside the fault windows:", e, file=sys.stderr)
    figures["checks"] = checks
    figures["ok"] = all(checks.values())
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--clients", type=int, default=8, help="well-behaved clients, over both keys and gateways")
    p.add_argument("--max-tokens", type=int, default=96, help="upper bound of each reply's random max_tokens")
    p.add_argument("--burst-s", type=float, default=None, help="the hostile burst's length (default: 8%% of the run)")
    p.add_argument("--settle-s", type=float, default=5.0, help="after each restart, before the next fault")
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="the gateways' and workers' --drain-timeout")
    p.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--model", default=None, help="model path (default: the server's, SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    args = p.parse_args()
    if args.burst_s is None:
        args.burst_s = max(15.0, 0.08 * args.duration_s)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
