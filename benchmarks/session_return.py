"""Returning conversations: the first token of a session's next turn with the KV tiers on and off, after a
warm, and after a restart.

``--sessions`` chat sessions, each a real ShareGPT conversation (``chatsvc/data/sharegpt_prompts_1000.json``)
rendered with the model's chat template and cut to ``L`` tokens of history, for each ``L`` of ``--lengths``.
The sessions take turns round robin, one request in flight (so a TTFT is the restore or recompute of one
history, not a queue), each turn a new user message and ``--max-tokens`` greedy tokens; a session's think
time is the other sessions' turns (and ``--think-s`` more of idle engine). The device pool holds
``--pool-fraction`` of the sessions' histories, so every returning session has been pushed out of it.

* ``off``: no tiers. Round 1 builds the histories, round 2 returns: each returning turn prefills its whole
  history again (the recompute).
* ``tiers``: ``--kv-host-bytes`` holding ``--host-fraction`` of the histories and a disk tier holding all.
  Round 1 builds, round 2 returns (the history comes back from host or disk), round 3 returns after a warm
  (``LLMEngine.warm_prefix`` on the session's history, as the gateway sends when a client opens the
  session, then the think time on an idle engine).
* ``restart``: the ``tiers`` engine is closed (its host tier written to disk) and a new engine starts on the
  same disk directory; after one request of nobody's (the process' first forward pass sets up its kernels,
  ``restart_kernel_warmup_s``), round 4 returns to every session, its first turn reported apart.

The engine runs in this process (``LLMEngine``), in the dtype ``--dtype auto`` resolves to (bf16 where oneDNN
runs it natively, float32 elsewhere); TTFT is from ``add_request`` to the step that samples the first token. Ratios are of TTFT p50s at the longest
history: recompute / tiers, recompute / warm, restart / tiers (goal: <= ~1), and the flatness of the tiers'
p50 over the lengths (longest / shortest).

Usage: python benchmarks/session_return.py [--lengths 512,1024,2048] [--sessions 10] [--max-tokens 8]
    [--pool-fraction 0.25] [--host-fraction 0.5] [--think-s 0.2] [--quick] [--output FILE]
Last line: one JSON object {"lengths": {L: {"off_return": {p50, p99, n}, "tiers_return": ..., "warm_return":
..., "restart_return": ..., "restart_first_s", "build": ..., "hits": {...}}}, "ratios": {...}, "sessions",
"pool_blocks", "host_blocks", "cpu", "isa", "cores", "commit", "torch", "dtype", "load_before", "load_after"}
(seconds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import machine  # noqa: E402

from engine.engine import LLMEngine  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

PROMPTS = ROOT / "chatsvc" / "data" / "sharegpt_prompts_1000.json"
SYSTEM = "You are a helpful assistant. Answer carefully and completely."
# The user messages of the returning turns: short, as a follow-up usually is.
FOLLOW_UPS = ("Thanks. Can you say that more briefly?", "What would you add to that?",
              "Give me one example of the last point.", "Summarize our conversation in one sentence.")


@dataclass
class Session:
    sid: str
    token_ids: list[int]  # the conversation so far: prompts and replies, as the engine computed them
    ttfts: list[float] = field(default_factory=list)


def conversations(tok: Tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` histories of ``length`` tokens: ShareGPT conversations rendered with the chat template,
    followed by more of them until long enough, cut, and closed with a user message asking for a reply."""
    data = json.loads(PROMPTS.read_text())
    out = []
    cursor = 0
    for i in range(count):
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        ids: list[int] = []
        while len(ids) < length:
            conv = data[cursor % len(data)]["conversations"]
            cursor += 1
            for turn in conv:
                role = "user" if turn["from"] == "human" else "assistant"
                messages.append({"role": role, "content": turn["value"]})
            if messages[-1]["role"] == "user":
                messages.append({"role": "assistant", "content": "I see. Let me think about that."})
            ids = tok.apply_chat_template(messages, add_generation_prompt=False)
        tail = tok.encode(f"<|im_start|>user\n{FOLLOW_UPS[i % len(FOLLOW_UPS)]}<|im_end|>\n"
                          "<|im_start|>assistant\n")
        out.append(ids[: length - len(tail)] + tail)
    return out


def follow_up(tok: Tokenizer, turn: int) -> list[int]:
    text = FOLLOW_UPS[turn % len(FOLLOW_UPS)]
    return list(tok.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


def run_turn(engine: LLMEngine, session: Session, rid: str, params: SamplingParams) -> tuple[float, int]:
    """One turn of ``session`` (its ``token_ids`` are the prompt): (TTFT in s, cached prompt tokens); the reply
    is appended to the session."""
    started = time.perf_counter()
    group = engine.add_request(rid, params, prompt_token_ids=list(session.token_ids))
    ttft = None
    while engine.has_unfinished():
        engine.step()
        if ttft is None and group.seqs[0].output_token_ids:
            ttft = time.perf_counter() - started
    assert ttft is not None, f"{rid} produced no token"
    session.token_ids = session.token_ids + list(group.seqs[0].output_token_ids)
    session.ttfts.append(ttft)
    return ttft, group.num_cached_tokens


def idle(engine: LLMEngine, seconds: float) -> None:
    """The engine loop while nobody sends a request: it installs the disk reads a warm started."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(0.005)


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p99": round(p99, 4), "n": len(ordered),
            "max": round(ordered[-1], 4)}


def round_of(engine: LLMEngine, sessions: list[Session], turn: int, params: SamplingParams, think_s: float,
             warm: bool = False) -> tuple[list[float], list[int]]:
    ttfts, cached = [], []
    for s in sessions:
        if warm:
            # The gateway warms the history when the client opens the session; then the user types.
            engine.warm_prefix(s.sid, s.token_ids)
        idle(engine, think_s)
        if turn > 0:
            s.token_ids = s.token_ids + follow_up(engine.tokenizer, turn + len(s.sid))
        ttft, hit = run_turn(engine, s, f"{s.sid}-t{turn}", params)
        ttfts.append(ttft)
        cached.append(hit)
    return ttfts, cached


def tier_hits(engine: LLMEngine) -> dict[str, int]:
    st = engine.stats()
    return {"host_hit_blocks": st.kv_host_hit_blocks, "disk_hit_blocks": st.kv_disk_hit_blocks,
            "offloaded_blocks": st.kv_host_offloaded_blocks, "spilled_blocks": st.kv_disk_spilled_blocks,
            "warm_loaded_blocks": st.kv_warm_loaded_blocks, "warm_read_blocks": st.kv_warm_read_blocks,
            "disk_failed_loads": st.kv_disk_failed_loads}


def measure_length(length: int, a: argparse.Namespace, disk_root: Path) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    block_size = 16
    # A history and the three turns the run adds to it (a follow-up of ~20 tokens and a reply each).
    blocks_per_session = -(-(length + 3 * (a.max_tokens + 20)) // block_size)
    # One session's whole conversation must fit the pool; the fraction is of every session's.
    pool_blocks = max(blocks_per_session + 2, round(a.pool_fraction * a.sessions * blocks_per_session))
    # A disk read may fill at most half the host tier (engine.kv_tiers): a whole history must fit that half.
    host_blocks = max(2 * blocks_per_session + 2, round(a.host_fraction * a.sessions * blocks_per_session))

    def engine(**tiers: Any) -> LLMEngine:
        return LLM(dtype=a.dtype, num_kv_blocks=pool_blocks, block_size=block_size, **tiers).engine

    off = engine()
    block_bytes = off.block_bytes
    histories = conversations(off.tokenizer, a.sessions, length)
    result: dict[str, Any] = {"pool_blocks": pool_blocks, "host_blocks": host_blocks,
                              "blocks_per_session": blocks_per_session}

    build_and_return(off, histories, params, a.think_s, "off", result)
    del off

    disk_dir = disk_root / f"kv-{length}"
    tier_args = {"kv_host_bytes": host_blocks * block_bytes, "kv_disk_dir": str(disk_dir),
                 "kv_disk_bytes": 64 << 30}
    tiers = engine(**tier_args)
    sessions = build_and_return(tiers, histories, params, a.think_s, "tiers", result)
    result["tiers_hits"] = tier_hits(tiers)
    warmed, cached = round_of(tiers, sessions, 2, params, a.think_s, warm=True)
    result["warm_return"] = summary(warmed)
    result["warm_cached_tokens"] = summary([float(c) for c in cached])
    result["warm_hits"] = tier_hits(tiers)
    tiers.close()
    del tiers

    started = time.perf_counter()
    restarted = engine(**tier_args)
    result["restart_start_s"] = round(time.perf_counter() - started, 3)
    # A fresh process' first forward pass also sets up its kernels (oneDNN primitives, thread pool): paid
    # once by any server before its first request, on a prompt of nobody's, so the returns measure restores.
    started = time.perf_counter()
    run_turn(restarted, Session("warmup", list(range(1000, 1040))), "warmup", params)
    result["restart_kernel_warmup_s"] = round(time.perf_counter() - started, 3)
    again, cached = round_of(restarted, sessions, 3, params, a.think_s)
    result["restart_return"] = summary(again)
    result["restart_first_s"] = round(again[0], 4)
    result["restart_cached_tokens"] = summary([float(c) for c in cached])
    result["restart_hits"] = tier_hits(restarted)
    restarted.close()
    del restarted
    shutil.rmtree(disk_dir, ignore_errors=True)
    return result


def build_and_return(engine: LLMEngine, histories: list[list[int]], params: SamplingParams, think_s: float,
                     phase: str, result: dict[str, Any]) -> list[Session]:
    """Each session's history built (turn 0), then each one back after the others (turn 1): TTFTs and cached
    tokens under ``phase`` in ``result``. Returns the sessions, for the phases that follow."""
    sessions = [Session(f"s{i}", list(h)) for i, h in enumerate(histories)]
    build, _ = round_of(engine, sessions, 0, params, 0.0)
    back, cached = round_of(engine, sessions, 1, params, think_s)
    result[f"{phase}_build"] = summary(build)
    result[f"{phase}_return"] = summary(back)
    result[f"{phase}_cached_tokens"] = summary([float(c) for c in cached])
    return sessions


def ratio(num: float, den: float) -> float | None:
    return round(num / den, 2) if den > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048", help="history lengths in tokens, comma-separated")
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens of each reply")
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="of the sessions' histories the pool holds")
    ap.add_argument("--host-fraction", type=float, default=0.5, help="of the histories the host tier holds")
    ap.add_argument("--think-s", type=float, default=0.2, help="idle engine time before each returning turn")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--disk-dir", type=Path, default=None, help="where the disk tier writes (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="4 sessions of 64 tokens, 1-token replies: the plumbing")
    ap.add_argument("--output", type=Path, default=None, help="also write the report to this file, replacing it "
                    "(a record: benchmarks/results/session_return/$(python benchmarks/machine.py)/record.txt)")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.sessions, a.max_tokens, a.think_s = "64", 4, 1, 0.05
    a.dtype = machine.resolve_dtype(a.dtype)
    lengths = [int(x) for x in a.lengths.split(",")]
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("session_return", load_before)
    command = " ".join(["python", "benchmarks/session_return.py", *sys.argv[1:]])
    started = datetime.now(UTC)
    by_length: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="session-return-", dir=a.disk_dir) as tmp:
        for length in lengths:
            by_length[length] = measure_length(length, a, Path(tmp))
            print(f"L={length}: " + json.dumps(by_length[length]), file=sys.stderr, flush=True)
    load_after = machine.load_avg()
    top, low = by_length[max(lengths)], by_length[min(lengths)]
    ratios = {
        "recompute_over_tiers_p50": ratio(top["off_return"]["p50"], top["tiers_return"]["p50"]),
        "recompute_over_warm_p50": ratio(top["off_return"]["p50"], top["warm_return"]["p50"]),
        "restart_over_tiers_p50": ratio(top["restart_return"]["p50"], top["tiers_return"]["p50"]),
        "restart_first_over_tiers_p50": ratio(top["restart_first_s"], top["tiers_return"]["p50"]),
        "tiers_p50_longest_over_shortest": ratio(top["tiers_return"]["p50"], low["tiers_return"]["p50"]),
        "off_p50_longest_over_shortest": ratio(top["off_return"]["p50"], low["off_return"]["p50"]),
        "at_length": max(lengths),
    }
    lines = [
        f"# {started:%Y-%m-%dT%H:%M:%SZ}  commit {host.commit}  command: {command}",
        f"machine: {host.line()}; dtype {a.dtype}",
        f"uptime (1, 5, 15-min load) before: {' '.join(map(str, load_before))}; after: "
        f"{' '.join(map(str, load_after))}",
        f"sessions {a.sessions}, lengths {lengths}, replies {a.max_tokens} tokens, pool {a.pool_fraction} and host "
        f"tier {a.host_fraction} of the histories, think {a.think_s} s, dtype {a.dtype}, one request in flight",
        "",
        "| L | recompute p50 / p99 | tiers p50 / p99 | warm p50 / p99 | restart p50 / p99 | restart first |",
        "|---|---|---|---|---|---|",
    ]
    for length, r in by_length.items():
        cells = [f"{r[k]['p50']:.3f} / {r[k]['p99']:.3f}"
                 for k in ("off_return", "tiers_return", "warm_return", "restart_return")]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {r['restart_first_s']:.3f} |")
    lines.append("")
    lines.append(json.dumps({"lengths": by_length, "ratios": ratios, "sessions": a.sessions,
                             "max_tokens": a.max_tokens, "think_s": a.think_s, "cpu": host.cpu, "isa": host.isa,
                             "cores": host.cores, "commit": host.commit, "torch": host.torch, "dtype": a.dtype,
                             "load_before": list(load_before), "load_after": list(load_after),
                             "quick": a.quick}))
    machine.report(lines, a.output)


if __name__ == "__main__":
    main()
