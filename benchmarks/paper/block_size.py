"""Experiment 3 of the PagedAttention paper (Fig. 18a): the block size's effect on the KV cache.

KV utilization (always; deterministic, no model): for each block size, the ShareGPT workload runs through the
engine's own scheduler and block manager (``workload.py``'s step loop, a stand-in for the model) under the
same KV budget in tokens (``--kv-tokens``, split into ``kv_tokens // block_size`` blocks). After every step's
``schedule()`` the block manager reports the device slots holding a token against the slots allocated
(``slot_usage()``); utilization is their ratio averaged over steps. Small blocks waste at most a block per
sequence; large ones waste up to ``block_size - 1`` slots per sequence, which caps the batch the budget
holds (the mean number of running sequences and the preemptions say how much).

Throughput (``--throughput``, runs the real model: 28 engine runs, about 5 minutes on 2 idle cores): a smaller draw of the same
kind (the first ``--throughput-prompts`` ShareGPT prompts, outputs uniform in 1..``--throughput-max-output``,
prompt + output cut to ``--throughput-max-len``) through ``LLMEngine`` at each block size, under one KV budget
in tokens (``--throughput-kv-tokens``, ``kv_tokens // block_size`` blocks) that holds only part of the batch,
so large blocks' waste costs concurrency as it does in the utilization part. The sizes are interleaved over
``--rounds`` rounds (every size once per round), each round's output tokens per second taken relative to the
same round's block size 16, and the median of those ratios reported with their range: the machine is shared
and slow drifts hit every size of a round alike.

Workload: the first ``--num-requests`` ShareGPT prompts in the default model's chat template, output lengths
uniform in 1..``--max-output`` (seed ``--seed``), prompts cut so prompt + output fits ``--max-model-len``; all
arrive at once; prefix caching off (distinct token ids: no block is shared), preemption by recompute.

Usage: python benchmarks/paper/block_size.py [--block-sizes 1,2,4,8,16,32,64,128,256] [--num-requests 200]
           [--kv-tokens 32768] [--throughput [--rounds 3]] [--output docs/paper/block_size.txt]
Writes the record (machine line, command, one row per block size, JSON last line) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import PAPER_DIR, ROOT, drive, request_tokens, sharegpt_prompt_lengths, write_record  # noqa: E402

from benchmarks.machine import describe, load_avg  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.request import SamplingParams, SequenceGroup  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402


@dataclass
class Utilization:
    block_size: int
    num_blocks: int
    utilization: float
    mean_running: float
    steps: int
    preemptions: int
    throughput_vs_16: float | None = None  # median over rounds of (tokens/s at this size) / (at 16)
    throughput_vs_16_range: tuple[float, float] | None = None
    throughput_preemptions: int | None = None
    cpu_throughput_vs_16: float | None = None  # the same per second of the process's CPU time


def utilization(block_size: int, prompt_lens: list[int], output_lens: list[int],
                args: argparse.Namespace) -> Utilization:
    num_blocks = args.kv_tokens // block_size
    bm = BlockManager(block_size, num_blocks, 0, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, preemption_mode="recompute",
                             max_waiting=len(prompt_lens))
    scheduler = Scheduler(config, bm)
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        scheduler.add(SequenceGroup(f"r{i}", request_tokens(i, p), SamplingParams(max_tokens=o, ignore_eos=True),
                                    arrival_time=float(i)))
    ratio_sum = 0.0
    running_sum = 0

    def on_step(s: Scheduler) -> None:
        nonlocal ratio_sum, running_sum
        filled, allocated = bm.slot_usage()
        ratio_sum += filled / allocated if allocated else 0.0
        running_sum += sum(len(g.unfinished_seqs()) for g in s.running)

    steps = drive(scheduler, on_step, args.max_model_len)
    return Utilization(block_size, num_blocks, ratio_sum / steps, running_sum / steps, steps,
                       sum(scheduler.num_preemptions.values()))


@dataclass
class ThroughputWorkload:
    prompt_lens: list[int]
    output_lens: list[int]
    kv_tokens: int
    max_len: int


def throughput_workload(args: argparse.Namespace) -> ThroughputWorkload:
    lengths = sharegpt_prompt_lengths()[: args.throughput_prompts]
    rng = random.Random(args.seed)
    output_lens = [rng.randint(1, args.throughput_max_output) for _ in lengths]
    prompt_lens = [min(p, args.throughput_max_len - o) for p, o in zip(lengths, output_lens, strict=True)]
    return ThroughputWorkload(prompt_lens, output_lens, args.throughput_kv_tokens, args.throughput_max_len)


def throughput(block_size: int, work: ThroughputWorkload) -> tuple[float, float, int]:
    """(output tokens per second of wall time, per second of this process's CPU time, preemptions) of the real
    engine on the workload, all requests at once. CPU time leaves out what other processes on the machine
    take (or a stopped process loses), though not its own threads spinning while a core is taken; wall time
    is what a client sees."""
    from engine.engine import LLMEngine

    count = len(work.prompt_lens)
    engine = LLMEngine.from_args(block_size=block_size, num_kv_blocks=work.kv_tokens // block_size,
                                 max_model_len=work.max_len, enable_prefix_caching=False,
                                 swap_space_mb=0, preemption_mode="recompute", max_waiting=count + 1)
    vocab = engine.model_config.vocab_size
    engine.add_request("warmup", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=[t % vocab for t in request_tokens(count, 16)])
    while engine.has_unfinished():
        engine.step()
    for i, (p, o) in enumerate(zip(work.prompt_lens, work.output_lens, strict=True)):
        engine.add_request(f"r{i}", SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=[t % vocab for t in request_tokens(i, p)])
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    stats = engine.stats()
    tokens = sum(work.output_lens)
    return tokens / seconds, tokens / cpu_seconds, stats.preemptions_swap + stats.preemptions_recompute


def throughput_ratios(sizes: list[int], work: ThroughputWorkload,
                      rounds: int) -> dict[int, tuple[list[float], list[float], int]]:
    """Per block size: each round's wall-time and CPU-time throughput relative to that round's block size 16,
    and the preemptions (the same every round: the schedule does not depend on timing)."""
    ratios: dict[int, tuple[list[float], list[float], int]] = {bs: ([], [], 0) for bs in sizes}
    order = sizes if 16 in sizes else [16, *sizes]
    # Untimed: the first engine in a process pays oneDNN's set-up for every new matmul shape.
    throughput(16, work)
    for r in range(rounds):
        wall: dict[int, float] = {}
        cpu: dict[int, float] = {}
        for bs in order:
            wall[bs], cpu[bs], preempted = throughput(bs, work)
            print(f"round {r + 1}/{rounds} block {bs}: {wall[bs]:.1f} tok/s, {cpu[bs]:.1f} tok/CPU-s, "
                  f"{preempted} preemptions", file=sys.stderr, flush=True)
            if bs in ratios:
                ratios[bs] = (ratios[bs][0], ratios[bs][1], preempted)
        for bs in sizes:
            ratios[bs][0].append(wall[bs] / wall[16])
            ratios[bs][1].append(cpu[bs] / cpu[16])
    return ratios


def plot(results: list[Utilization], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r.block_size for r in results]
    ax.plot(xs, [100 * r.utilization for r in results], "o-", label="KV utilization (slots holding a token)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("KV utilization (%)")
    ax.set_ylim(0, 105)
    ratios = [r.throughput_vs_16 for r in results if r.throughput_vs_16 is not None]
    if len(ratios) == len(results):
        twin = ax.twinx()
        low = [r - r_.throughput_vs_16_range[0] for r, r_ in zip(ratios, results, strict=True)
               if r_.throughput_vs_16_range]
        high = [r_.throughput_vs_16_range[1] - r for r, r_ in zip(ratios, results, strict=True)
                if r_.throughput_vs_16_range]
        twin.errorbar(xs, ratios, yerr=[low, high], fmt="s--", color="tab:orange", capsize=3,
                      label="throughput / throughput at 16 (median, range over rounds)")
        twin.set_ylim(0, max(1.2, 1.1 * max(ratios)))
        twin.set_ylabel("throughput relative to block size 16")
        twin.legend(fontsize=8, loc="lower left")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_dtype() -> str:
    from engine.engine import resolve_dtype

    return f"dtype auto: {resolve_dtype('auto')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV budget in tokens, the same for every size")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--throughput", action="store_true", help="also time the real engine (slow)")
    parser.add_argument("--throughput-prompts", type=int, default=16)
    parser.add_argument("--throughput-max-output", type=int, default=32)
    parser.add_argument("--throughput-max-len", type=int, default=256, help="prompt + output cap (tokens)")
    parser.add_argument("--throughput-kv-tokens", type=int, default=1024,
                        help="KV budget of the throughput runs in tokens, the same for every size")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds, every size once per round")
    parser.add_argument("--output", type=Path, default=PAPER_DIR / "block_size.txt")
    args = parser.parse_args()
    sizes = [int(b) for b in args.block_sizes.split(",")]

    lengths = sharegpt_prompt_lengths()[: args.num_requests]
    rng = random.Random(args.seed)
    output_lens = [rng.randint(1, args.max_output) for _ in lengths]
    prompt_lens = [min(p, args.max_model_len - o) for p, o in zip(lengths, output_lens, strict=True)]
    results = [utilization(bs, prompt_lens, output_lens, args) for bs in sizes]
    work = throughput_workload(args) if args.throughput else None
    load_before = load_avg()
    if work is not None:
        measured = throughput_ratios(sizes, work, args.rounds)
        for r in results:
            ratios, cpu_ratios, r.throughput_preemptions = measured[r.block_size]
            r.throughput_vs_16 = statistics.median(ratios)
            r.throughput_vs_16_range = (min(ratios), max(ratios))
            r.cpu_throughput_vs_16 = statistics.median(cpu_ratios)
    load_after = load_avg()

    machine = describe()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]).resolve().relative_to(ROOT)),
                                                              *sys.argv[1:]])
    lines = [
        "Experiment 3 (PagedAttention paper Fig. 18a): block size against KV utilization"
        + (" and throughput" if work else ""),
        f"machine: {machine.line()}",
        f"command: {command}",
        "model: SmolLM2-135M-Instruct tokenizer and chat template (utilization: block accounting only, no model "
        "runs)" + (f"; throughput: the real LLMEngine ({describe_dtype()})" if work else ""),
        f"workload: first {len(prompt_lens)} ShareGPT prompts (mean {sum(prompt_lens) / len(prompt_lens):.0f} "
        f"tokens), outputs uniform 1..{args.max_output} (seed {args.seed}, mean "
        f"{sum(output_lens) / len(output_lens):.0f}), all at t=0; KV budget {args.kv_tokens} tokens; "
        f"max_num_seqs {args.max_num_seqs}; prefix caching off; preemption by recompute",
        "utilization = slots holding a token / slots allocated, averaged over steps",
    ]
    if work:
        lines += [
            f"throughput workload: first {len(work.prompt_lens)} ShareGPT prompts cut to prompt + output <= "
            f"{work.max_len} (mean {sum(work.prompt_lens) / len(work.prompt_lens):.0f} tokens), outputs uniform "
            f"1..{args.throughput_max_output} (seed {args.seed}, {sum(work.output_lens)} in all), all at t=0; KV "
            f"budget {work.kv_tokens} tokens; prefix caching off; preemption by recompute",
            f"tput/16 = median over {args.rounds} interleaved rounds of (output tokens/s) / (same round's at block "
            f"16), range in brackets; cpu/16 = the same per second of the engine process's CPU time (leaves out "
            f"waiting for a core, not its threads' spinning meanwhile); tpreempt = preemptions in a throughput run; load average before "
            f"{load_before[0]:.2f}, after {load_after[0]:.2f} (shared 2-core machine: ratios, not times)",
        ]
    lines += [
        "",
        f"{'block':>6}{'blocks':>8}{'utilization':>13}{'running':>9}{'steps':>7}{'preempt':>9}"
        + (f"{'tput/16':>9}{'range':>15}{'cpu/16':>8}{'tpreempt':>10}" if work else ""),
    ]
    for r in results:
        row = (f"{r.block_size:>6}{r.num_blocks:>8}{100 * r.utilization:>12.1f}%{r.mean_running:>9.1f}"
               f"{r.steps:>7}{r.preemptions:>9}")
        if r.throughput_vs_16 is not None and r.throughput_vs_16_range is not None:
            low, high = r.throughput_vs_16_range
            row += (f"{r.throughput_vs_16:>9.2f}{f'[{low:.2f}, {high:.2f}]':>15}{r.cpu_throughput_vs_16:>8.2f}"
                    f"{r.throughput_preemptions:>10}")
        lines.append(row)
    lines += [
        "",
        "paper: block size 16 to 128 serves ShareGPT best; smaller blocks underuse the GPU's parallelism in the "
        "kernel, larger ones waste KV slots (internal fragmentation) and so batch less. Utilization here shows "
        "the second effect" + ("; tput/16 both, on a CPU, where the attention kernel gathers a position at a time "
                               "whatever the block size." if work else "; the first needs --throughput."),
        json.dumps({"results": [asdict(r) for r in results], "machine": machine.as_dict(), "command": command}),
    ]
    title = f"Block size vs KV utilization, ShareGPT ({len(prompt_lens)} requests), KV budget {args.kv_tokens} tokens"
    if work:
        title += f"\nthroughput: {len(work.prompt_lens)} requests, KV budget {work.kv_tokens} tokens, real engine"
    write_record(args.output, lines, lambda png: plot(results, png, title))


if __name__ == "__main__":
    main()
