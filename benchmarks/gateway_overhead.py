"""Gateway CPU per streamed token: the real app (``chatsvc.app.create_app``) served by uvicorn in this
process, against a fake engine that costs next to nothing, a real redis-server, and a load client in a
separate process (``chatsvc bench``'s client code), so what is measured is the gateway's own work.

The fake engine behaves like the real one as the gateway sees it: every ``--step-ms`` it emits one
``RequestDelta`` (one token, real SmolLM2 token text) to every running request at once. Its own CPU
time is measured on the event-loop thread and subtracted; redis-server's CPU is reported separately.

    python benchmarks/gateway_overhead.py --streams 32 --tokens 256 --modes openai,ws --repeat 3

Prints one line per run, then one JSON line with the medians. ``--profile FILE`` writes a cProfile of
the server process for the last run of each mode (FILE.<mode>) and prints its top entries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.protocol import EngineStats, KVSnapshot

_TEXT = (
    "Paged attention stores the key and value cache in fixed-size blocks, so memory for a sequence does not "
    "need to be contiguous. A block table maps each sequence's logical blocks to physical ones, which lets "
    "requests share a common prefix and lets the scheduler admit more requests at once. When memory runs "
    "out, the scheduler can preempt a request by swapping its blocks to the CPU or by recomputing them later."
)


# -- the fake engine --------------------------------------------------------------------------------
@dataclass
class _Running:
    request_id: str
    n: int
    max_tokens: int
    prompt_tokens: int
    queue: asyncio.Queue[Any]
    generated: list[int] = field(default_factory=list)


class FakeEngine:
    """The engine surface the gateway uses, stepping every ``step_s`` over all running requests."""

    def __init__(self, step_s: float) -> None:
        from engine.model_files import default_model_path
        from engine.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_gguf(default_model_path())
        self.model_name = "SmolLM2-135M-Instruct"
        self.max_model_len = 8192
        self.step_s = step_s
        ids = self.tokenizer.encode(_TEXT)
        # Decoded once: text is the engine's work, not the gateway's.
        self.vocab = [(t, self.tokenizer.decode([t])) for t in ids]
        self._running: dict[str, _Running] = {}
        self._task: asyncio.Task[None] | None = None
        self.cpu_s = 0.0  # CPU the fake engine spent on the event loop thread
        self.tokens = 0

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def generate(self, request_id: str, sampling_params: Any, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None) -> AsyncIterator[Any]:
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already in use")
        r = _Running(request_id, sampling_params.n, sampling_params.max_tokens, len(prompt_token_ids or []),
                     asyncio.Queue())
        r.generated = [0] * r.n
        self._running[request_id] = r
        return self._stream(r)

    async def _stream(self, r: _Running) -> AsyncIterator[Any]:
        try:
            while True:
                d = await r.queue.get()
                yield d
                if d.request_finished:
                    return
        finally:
            self._running.pop(r.request_id, None)

    async def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    async def pin_prefix(self, key: str, prompt_token_ids: list[int]) -> int:
        return len(prompt_token_ids) // 16 * 16

    def unpin_prefix(self, key: str) -> None:
        return None

    def warm_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> None:
        return None

    def stats(self) -> EngineStats:
        from engine.protocol import EngineStats

        return EngineStats(kv_blocks_total=1000, kv_blocks_free=1000, requests_running=len(self._running))

    def kv_snapshot(self) -> KVSnapshot:
        from engine.protocol import KVSnapshot

        return KVSnapshot()

    async def _loop(self) -> None:
        due = time.monotonic()
        while True:
            due += self.step_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            t0 = time.thread_time()
            self._step()
            self.cpu_s += time.thread_time() - t0

    def _step(self) -> None:
        from engine.protocol import RequestDelta

        for r in list(self._running.values()):
            for i in range(r.n):
                if r.generated[i] >= r.max_tokens:
                    continue
                tid, text = self.vocab[r.generated[i] % len(self.vocab)]
                r.generated[i] += 1
                fin = r.generated[i] >= r.max_tokens
                done = all(g >= r.max_tokens for g in r.generated)
                r.queue.put_nowait(RequestDelta(r.request_id, i, text, [tid], fin, "length" if fin else None, None,
                                                r.prompt_tokens, r.generated[i], 0, request_finished=done))
                self.tokens += 1


# -- helpers ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            deadline = time.monotonic() + 10
            while True:
                try:
                    if redis.Redis(port=port, socket_connect_timeout=0.2).ping():
                        break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", proc.pid
        finally:
            proc.terminate()
            proc.wait(10)


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of another process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -- the load client (a separate process) -----------------------------------------------------------
async def client_main(url: str, mode: str, streams: int, tokens: int) -> None:
    from chatsvc.bench.clients import Client, ClientConfig
    from chatsvc.bench.load import LoadConfig, run_load
    from chatsvc.bench.metrics import RequestRecord

    client = Client(ClientConfig(url=url, mode=mode, max_tokens=tokens, ignore_eos=True), max_connections=None)
    await client.prepare()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    records: list[RequestRecord] = []
    convs = [["Explain paged attention in a few sentences."] for _ in range(streams)]
    await run_load(client, convs, LoadConfig(request_timeout_s=600), records)
    await client.aclose()
    errors = sorted({f"{r.error}: {r.error_detail[:120]}" for r in records if r.error})
    print(json.dumps({"ok": sum(r.ok for r in records), "errors": errors,
                      "deltas": sum(len(r.delta_times) for r in records)}), flush=True)


# -- the server side --------------------------------------------------------------------------------
async def measure(url: str, mode: str, args: argparse.Namespace, engine: FakeEngine, redis_pid: int,
                  profile: cProfile.Profile | None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", url, "--modes", mode, "--streams", str(args.streams),
        "--tokens", str(args.tokens), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    line = await proc.stdout.readline()
    if line.strip() != b"ready":
        raise RuntimeError(f"client failed to start: {line!r}")
    await asyncio.sleep(0.5)  # let the server settle after the client's /v1/models
    cpu0, eng0, tok0, red0, wall0 = self_cpu_s(), engine.cpu_s, engine.tokens, proc_cpu_s(redis_pid), time.monotonic()
    if profile is not None:
        profile.enable()
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    result = json.loads(await proc.stdout.readline())
    if profile is not None:
        profile.disable()
    cpu1, eng1, tok1, red1, wall1 = self_cpu_s(), engine.cpu_s, engine.tokens, proc_cpu_s(redis_pid), time.monotonic()
    await proc.wait()
    toks = tok1 - tok0
    if result["errors"] or result["ok"] != args.streams or toks != args.streams * args.tokens:
        raise RuntimeError(f"{mode}: bad run {result}, {toks} tokens")
    gw = (cpu1 - cpu0) - (eng1 - eng0)
    return {"mode": mode, "tokens": toks, "wall_s": round(wall1 - wall0, 3),
            "gateway_cpu_s_per_1k": round(gw / toks * 1000, 4),
            "fake_engine_cpu_s_per_1k": round((eng1 - eng0) / toks * 1000, 4),
            "redis_cpu_s_per_1k": round((red1 - red0) / toks * 1000, 4)}


async def server_main(args: argparse.Namespace) -> dict[str, Any]:
    import uvicorn

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store

    engine = FakeEngine(args.step_ms / 1000)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    with redis_server() as (redis_url, redis_pid), tempfile.TemporaryDirectory() as web:
        store = Store.from_url(redis_url)
        app = create_app(engine, store, Settings(web_dir=Path(web)))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", timeout_graceful_shutdown=5))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                await serving
            await asyncio.sleep(0.02)
        try:
            for rep in range(args.repeat):
                for mode in args.modes:
                    prof = cProfile.Profile() if args.profile and rep == args.repeat - 1 else None
                    res = await measure(f"http://127.0.0.1:{port}", mode, args, engine, redis_pid, prof)
                    print(json.dumps(res), flush=True)
                    runs[mode].append(res)
                    if prof is not None:
                        prof.dump_stats(f"{args.profile}.{mode}")
                        buf = io.StringIO()
                        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
                        print(buf.getvalue(), file=sys.stderr)
        finally:
            server.should_exit = True
            await serving
    summary: dict[str, Any] = {"streams": args.streams, "tokens_per_stream": args.tokens, "step_ms": args.step_ms,
                               "repeat": args.repeat, "cpu": cpu_model(), "commit": git_commit()}
    for mode, rs in runs.items():
        for key in ("gateway_cpu_s_per_1k", "redis_cpu_s_per_1k", "fake_engine_cpu_s_per_1k"):
            summary[f"{mode}_{key}"] = round(statistics.median(r[key] for r in rs), 4)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (one request each)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=40.0, help="fake engine step interval")
    p.add_argument("--modes", default="openai,ws", help="comma list of openai, sse, ws")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", default=None, help="write cProfile stats of the last run per mode to FILE.<mode>")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: run as the load client
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    # Run as a script, this file's folder comes first on sys.path: put the checkout it lives in before
    # any installed copy of chatsvc, so the code measured is this checkout's.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.client:
        asyncio.run(client_main(args.client, args.modes[0], args.streams, args.tokens))
        return
    print(json.dumps(asyncio.run(server_main(args))))


if __name__ == "__main__":
    main()
