"""Experiment 2 of the PagedAttention paper (Fig. 16): throughput when every request starts with the same
prefix (the paper's 1-shot and 5-shot translation prompts, 80 and 341 tokens), prefix caching on against off.

With caching on, the engine finds the prefix's full blocks by hash and shares them by reference count: a
request prefills only its own tokens and holds only its own blocks, so the same KV budget runs more requests
at once. Off, every request prefills and holds the whole prefix.

Workload: ``--num-requests`` requests, each ``--prefix-tokens`` of a shared prefix (text of the ShareGPT
prompts after the first ``--num-requests``, as token ids) followed by its own ShareGPT prompt in the chat
template (the shortest ``--num-requests`` of them, cut to ``--max-user-tokens``), ``--max-tokens`` output
tokens each (``ignore_eos``, greedy), all queued at once on the real ``LLMEngine`` (default dtype) with a KV
budget of ``--kv-blocks`` blocks. One warm-up request (which also computes the prefix, as a served system
prompt would be) runs before the clock starts. Reported: requests per second of wall time, and the ratio
on / off for each prefix (a ratio: absolute times on a shared machine say little). Paper (OPT-13B, WMT16):
1.67x with the 1-shot prefix, 3.58x with the 5-shot.

Usage: python benchmarks/paper/shared_prefix.py [--prefix-tokens 80,340] [--num-requests 48] [--max-tokens 16]
           [--kv-blocks 192] [--output docs/paper/shared_prefix.txt]
Writes the record (machine line, command, one row per prefix and setting, JSON last line) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import PAPER_DIR, ROOT, sharegpt_prompt_ids, write_record  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

PAPER = {80: 1.67, 341: 3.58}


@dataclass
class Run:
    prefix_tokens: int
    caching: bool
    requests: int
    seconds: float
    requests_per_s: float
    prefix_hit_tokens: int
    preemptions: int


def run(prefix: list[int], users: list[list[int]], caching: bool, args: argparse.Namespace) -> Run:
    from engine.engine import LLMEngine

    engine = LLMEngine.from_args(block_size=args.block_size, num_kv_blocks=args.kv_blocks,
                                 enable_prefix_caching=caching, max_model_len=args.max_model_len,
                                 max_waiting=len(users) + 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("warmup", params, prompt_token_ids=prefix + users[0])
    while engine.has_unfinished():
        engine.step()
    hits_before = engine.stats().prefix_cache_hit_tokens
    for i, user in enumerate(users):
        engine.add_request(f"r{i}", params, prompt_token_ids=prefix + user)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return Run(len(prefix), caching, len(users), seconds, len(users) / seconds,
               stats.prefix_cache_hit_tokens - hits_before,
               stats.preemptions_swap + stats.preemptions_recompute)


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = sorted({r.prefix_tokens for r in runs})
    ratios = [_ratio(runs, p) for p in prefixes]
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    bars = ax.bar(range(len(prefixes)), ratios, 0.5, label="this engine")
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    for i, p in enumerate(prefixes):
        paper = PAPER[min(PAPER, key=lambda q: abs(q - p))]
        ax.plot([i - 0.3, i + 0.3], [paper, paper], color="black", linestyle="--",
                label="paper (OPT-13B, WMT16)" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(prefixes)), [f"shared prefix of {p} tokens" for p in prefixes])
    ax.set_ylabel("throughput, prefix caching on / off")
    ax.set_ylim(0, 1.25 * max(max(ratios), max(PAPER.values())))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ratio(runs: list[Run], prefix: int) -> float:
    on = next(r for r in runs if r.prefix_tokens == prefix and r.caching)
    off = next(r for r in runs if r.prefix_tokens == prefix and not r.caching)
    return on.requests_per_s / off.requests_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix-tokens", default="80,340", help="shared prefix lengths, comma-separated")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-user-tokens", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--output", type=Path, default=PAPER_DIR / "shared_prefix.txt")
    args = parser.parse_args()
    lengths = [int(p) for p in args.prefix_tokens.split(",")]

    ids = sharegpt_prompt_ids()
    users = [p[: args.max_user_tokens] for p in sorted(ids, key=len)[: args.num_requests]]
    text = [t for p in ids[args.num_requests :] for t in p]
    runs = [run(text[:n], users, caching, args) for n in lengths for caching in (False, True)]

    machine = describe()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]).resolve().relative_to(ROOT)),
                                                              *sys.argv[1:]])
    lines = [
        "Experiment 2 (PagedAttention paper Fig. 16): a shared prefix, prefix caching on against off",
        f"machine: {machine.line()}",
        f"command: {command}",
        "model: SmolLM2-135M-Instruct (default dtype), the real LLMEngine",
        f"settings: {args.num_requests} requests queued at once, each the shared prefix + its own prompt "
        f"(mean {sum(map(len, users)) / len(users):.0f} tokens), {args.max_tokens} output tokens (greedy, "
        f"ignore_eos); KV budget {args.kv_blocks} blocks of {args.block_size}; a warm-up request first",
        "",
        f"{'prefix':>7}{'caching':>9}{'requests':>10}{'seconds':>9}{'req/s':>8}{'hit tokens':>12}{'preempt':>9}",
    ]
    for r in runs:
        lines.append(f"{r.prefix_tokens:>7}{'on' if r.caching else 'off':>9}{r.requests:>10}{r.seconds:>9.2f}"
                     f"{r.requests_per_s:>8.2f}{r.prefix_hit_tokens:>12}{r.preemptions:>9}")
    lines.append("")
    for n in lengths:
        paper = PAPER[min(PAPER, key=lambda q: abs(q - n))]
        lines.append(f"prefix of {n} tokens: caching on / off = {_ratio(runs, n):.2f}x (paper: {paper}x)")
    lines += [
        "With caching, a request prefills and holds only its own tokens: less compute per request and more",
        "requests in the same KV budget; both grow with the prefix's share of the prompt.",
        json.dumps({"results": [asdict(r) for r in runs], "machine": machine.as_dict(), "command": command}),
    ]
    title = (f"Shared prefix: throughput with prefix caching on / off\nSmolLM2-135M, {args.num_requests} requests, "
             f"{args.max_tokens} output tokens, KV budget {args.kv_blocks} blocks")
    write_record(args.output, lines, lambda png: plot(runs, png, title))


if __name__ == "__main__":
    main()
