"""Experiment 1 of the PagedAttention paper (section 6.3, Fig. 15), parallel-sampling part: the fraction of KV
blocks that sharing a request's prompt blocks among its ``n`` samples saves.

Each request asks for ``n`` samples of ``--max-tokens`` tokens. The engine prefills the prompt once and forks
the ``n`` sequences onto its blocks by reference count; a sample copies the last, partly filled prompt block
when it first writes into it (copy-on-write) and owns every block after. Without sharing the same ``n``
sequences each hold a private copy of the whole prompt.

Measured from the block manager's accounting, no timing: after every step's ``schedule()``, the device blocks
the running requests hold (shared blocks once; checked equal to the pool's used count) against the blocks
the same tables hold if nothing were shared (the sum of every sequence's table length; before the fork, ``n``
copies of the prompt's table). Saving = 1 - held / unshared, both summed over all steps: the time average
of memory saved, the paper's measure. Prefix caching is off, so only the samples' own sharing counts (the
chat template's system prompt would otherwise be shared across requests too). KV pool: large enough that
nothing is preempted (checked). See ``workload.py`` for the step loop and why it is the engine's accounting.

Workloads: the first ``--num-prompts`` ShareGPT prompts (cut to ``--max-model-len`` minus the output), and
a short-prompt set, the ``--num-prompts`` shortest of the 1000. The paper (OPT-13B, Alpaca prompts, outputs
from the dataset) saves 6.1% to 9.8% for parallel sampling; our outputs are fixed at ``--max-tokens``, so the
fraction is the prompt's share of each sample's blocks: long prompts save far more than short ones.

Usage: python benchmarks/paper/sharing.py [--num-prompts 50] [--max-tokens 64] [--n 2,4,6]
           [--block-size 16] [--output docs/paper/sharing.txt]
Writes the record (the machine line, the command, one row per workload and n, the JSON last line) and a PNG
next to it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import PAPER_DIR, ROOT, drive, request_tokens, sharegpt_prompt_lengths, write_record  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.plan import SchedulerOutput  # noqa: E402
from engine.request import SamplingParams, SequenceGroup  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

PAPER_PARALLEL_SAMPLING = (0.061, 0.098)
# Enough blocks that no workload here is ever preempted (a preemption would change what is held).
POOL_BLOCKS = 1 << 17


@dataclass
class Sharing:
    workload: str
    n: int
    requests: int
    mean_prompt_tokens: float
    steps: int
    mean_blocks_held: float
    mean_blocks_unshared: float
    saving: float


class BlockCount:
    """Blocks held (shared once) and blocks unshared, summed over the steps it is called at."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.held = self.unshared = self.steps = 0

    def __call__(self, scheduler: Scheduler) -> None:
        bm = scheduler.block_manager
        blocks: set[int] = set()
        for group in scheduler.running:
            tables = [bm.block_table(seq) for seq in group.seqs if bm.has_table(seq)]
            for table in tables:
                blocks.update(table)
            if group.needs_fork:  # only the prompt's sequence exists yet: unshared, there would be n of it
                self.unshared += self.n * len(tables[0]) if tables else 0
            else:
                self.unshared += sum(len(t) for t in tables)
        assert len(blocks) == bm.device.num_blocks - bm.device.num_free, "held blocks outside running tables"
        self.held += len(blocks)
        self.steps += 1


def _scheduler(args: argparse.Namespace, num_requests: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, preemption_mode="recompute",
                             max_waiting=num_requests)
    return Scheduler(config, BlockManager(args.block_size, POOL_BLOCKS, 0, enable_prefix_caching=False))


def measure(workload: str, prompt_lens: list[int], n: int, args: argparse.Namespace) -> Sharing:
    scheduler = _scheduler(args, len(prompt_lens))
    for i, length in enumerate(prompt_lens):
        params = SamplingParams(n=n, max_tokens=args.max_tokens, ignore_eos=True)
        scheduler.add(SequenceGroup(f"r{i}", request_tokens(i, length), params, arrival_time=float(i)))
    count = BlockCount(n)
    steps = drive(scheduler, count, args.max_model_len)
    assert sum(scheduler.num_preemptions.values()) == 0, "the pool is too small: preemption changes what is held"
    return Sharing(workload, n, len(prompt_lens), sum(prompt_lens) / len(prompt_lens), steps,
                   count.held / steps, count.unshared / steps, 1 - count.held / count.unshared)


def check_against_engine(args: argparse.Namespace) -> str:
    """Run a small case through the real ``LLMEngine`` (the model, sampling, its own fork) and through the
    stand-in, counting blocks the same way; they must agree step for step. Returns the record's line."""
    from engine.engine import LLMEngine

    lens, n, tokens = [40, 70, 23], 3, 20
    check = argparse.Namespace(**{**vars(args), "max_tokens": tokens})
    sim = measure("check", lens, n, check)
    engine = LLMEngine.from_args(block_size=args.block_size, num_kv_blocks=512, enable_prefix_caching=False,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_model_len=args.max_model_len)
    vocab = engine.model_config.vocab_size
    for i, length in enumerate(lens):
        engine.add_request(f"r{i}", SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, seed=i),
                           prompt_token_ids=[t % vocab for t in request_tokens(i, length)])
    count = BlockCount(n)
    schedule = engine.scheduler.schedule

    def counted() -> SchedulerOutput:  # the engine's own schedule(), counted right after it, as the stand-in is
        out = schedule()
        count(engine.scheduler)
        return out

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    got = (count.steps, count.held, count.unshared)
    want = (sim.steps, round(sim.mean_blocks_held * sim.steps), round(sim.mean_blocks_unshared * sim.steps))
    assert got == want, f"the stand-in's count {want} differs from the engine's {got}"
    return (f"checked: prompts of {lens} tokens, n={n}, {tokens} tokens each, through LLMEngine (real model, "
            f"sampling) and the stand-in: the same {count.steps} steps, {count.held} block-steps held, "
            f"{count.unshared} unshared")


def plot(results: list[Sharing], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    ns = sorted({r.n for r in results})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / len(workloads)
    for k, workload in enumerate(workloads):
        values = [next(100 * r.saving for r in results if r.workload == workload and r.n == n) for n in ns]
        xs = [i + (k - (len(workloads) - 1) / 2) * width for i in range(len(ns))]
        bars = ax.bar(xs, values, width, label=workload)
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    lo, hi = PAPER_PARALLEL_SAMPLING
    ax.axhspan(100 * lo, 100 * hi, color="grey", alpha=0.25, label="paper (OPT-13B, Alpaca): 6.1-9.8%")
    ax.set_xticks(range(len(ns)), [f"n = {n}" for n in ns])
    ax.set_ylim(0, 130 * max(r.saving for r in results))  # room above the bars for the legend
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n", default="2,4,6", help="samples per request, comma-separated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=PAPER_DIR / "sharing.txt")
    parser.add_argument("--no-check-engine", dest="check_engine", action="store_false",
                        help="skip the cross-check of the stand-in's count against the real engine (loads the model)")
    args = parser.parse_args()
    ns = [int(n) for n in args.n.split(",")]

    lengths = sharegpt_prompt_lengths()
    limit = args.max_model_len - args.max_tokens
    workloads = {
        "sharegpt": [min(p, limit) for p in lengths[: args.num_prompts]],
        "short": sorted(min(p, limit) for p in lengths)[: args.num_prompts],
    }
    results = [measure(name, lens, n, args) for name, lens in workloads.items() for n in ns]
    checked = check_against_engine(args) if args.check_engine else "not checked against the engine (--no-check-engine)"

    machine = describe()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]).resolve().relative_to(ROOT)),
                                                              *sys.argv[1:]])
    lines = [
        "Experiment 1 (PagedAttention paper section 6.3, Fig. 15), parallel sampling: KV blocks saved by sharing",
        f"machine: {machine.line()}",
        f"command: {command}",
        "model: SmolLM2-135M-Instruct tokenizer and chat template (block accounting with a stand-in for the "
        "model: the counts do not depend on it; the 'checked' line runs the real one)",
        f"settings: block size {args.block_size}; {args.max_tokens} output tokens per sample (ignore_eos); "
        f"prefix caching off; max_num_seqs {args.max_num_seqs}; max_num_batched_tokens "
        f"{args.max_num_batched_tokens}; no preemption",
        f"workloads: sharegpt = first {args.num_prompts} ShareGPT prompts (cut to {limit} tokens); short = the "
        f"{args.num_prompts} shortest of the 1000",
        "saving = 1 - (blocks held, shared once) / (blocks the same tables hold unshared), summed over steps",
        checked,
        "",
        f"{'workload':<10}{'n':>3}{'requests':>10}{'prompt tok':>12}{'steps':>8}{'held':>10}{'unshared':>10}"
        f"{'saved':>9}",
    ]
    for r in results:
        lines.append(f"{r.workload:<10}{r.n:>3}{r.requests:>10}{r.mean_prompt_tokens:>12.1f}{r.steps:>8}"
                     f"{r.mean_blocks_held:>10.1f}{r.mean_blocks_unshared:>10.1f}{100 * r.saving:>8.1f}%")
    lo, hi = PAPER_PARALLEL_SAMPLING
    lines += ["", f"paper (OPT-13B on Alpaca: prompts of 19 tokens and outputs of 58 on average, its Fig. 11): "
                  f"{100 * lo:.1f}% to {100 * hi:.1f}% saved for n = 2..6. Here:"]
    for name in workloads:
        rows = [r for r in results if r.workload == name]
        lines.append(f"  {name}: prompts of {rows[0].mean_prompt_tokens:.0f} tokens on average (30 of them the "
                     f"chat template), {100 * min(r.saving for r in rows):.1f}% to "
                     f"{100 * max(r.saving for r in rows):.1f}% saved")
    lines += [
        "The saving is the prompt's share of the blocks the samples would otherwise duplicate: it grows with the",
        "prompt and with n, and shrinks as the outputs grow.",
        json.dumps({"results": [asdict(r) for r in results], "machine": machine.as_dict(), "command": command}),
    ]
    title = (f"Parallel sampling: KV blocks saved by sharing\nSmolLM2-135M tokens, block size {args.block_size}, "
             f"{args.max_tokens} output tokens per sample")
    write_record(args.output, lines, lambda png: plot(results, png, title))


if __name__ == "__main__":
    main()
