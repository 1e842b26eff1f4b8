"""Experiment 1 of the PagedAttention paper (section 6.3, Fig. 15): the fraction of KV blocks that sharing
saves, for parallel sampling (a request's ``n`` samples share its prompt blocks) and for beam search (its ``k``
beams share their common prefix blocks, whatever the model makes them diverge on).

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

Beam search: which beams survive, fork and drop depends on the model's log-probabilities, so a stand-in
cannot replay it: the real ``LLMEngine`` (default dtype) runs ``--beam-prompts`` requests of each workload (the
real ShareGPT prompt tokens, cut like the others) with ``use_beam_search``, ``best_of = k``, ``ignore_eos``
(every beam runs ``--beam-max-tokens`` tokens, as the samples do) and counts blocks after each ``schedule()``
the same way: held (shared once) against every beam's table length (before the first beam step, ``k``
copies of the prompt's table). The paper (OPT-13B, Alpaca) saves 37.6% to 55.2% for k = 2..6.

Usage: python benchmarks/paper/sharing.py [--num-prompts 50] [--max-tokens 64] [--n 2,4,6]
           [--beam-k 2,4,6] [--beam-prompts 16] [--beam-max-tokens 32]
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

from workload import (  # noqa: E402
    PAPER_DIR,
    ROOT,
    drive,
    request_tokens,
    sharegpt_prompt_ids,
    sharegpt_prompt_lengths,
    write_record,
)

from benchmarks.machine import describe  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.plan import SchedulerOutput  # noqa: E402
from engine.request import SamplingParams, SequenceGroup  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

PAPER_PARALLEL_SAMPLING = (0.061, 0.098)
PAPER_BEAM_SEARCH = (0.376, 0.552)
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
    mode: str = "parallel"  # or "beam": n is then the beam width k


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
            # Only the prompt's sequence exists yet (before the fork, or before a beam search's first step):
            # unshared, there would be n of it.
            if group.needs_fork or (group.beam is not None and len(group.seqs) == 1):
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


def measure_beams(workload: str, prompts: list[list[int]], k: int, args: argparse.Namespace) -> Sharing:
    """Beam search with width ``k`` on the real engine (see the module's docstring)."""
    from engine.engine import LLMEngine

    engine = LLMEngine.from_args(block_size=args.block_size, num_kv_blocks=args.beam_kv_blocks,
                                 enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", SamplingParams(use_beam_search=True, best_of=k, n=k, ignore_eos=True,
                                                   max_tokens=args.beam_max_tokens), prompt_token_ids=ids)
    count = BlockCount(k)
    schedule = engine.scheduler.schedule

    def counted() -> SchedulerOutput:
        out = schedule()
        count(engine.scheduler)
        return out

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute == 0, "raise --beam-kv-blocks"
    return Sharing(workload, k, len(prompts), sum(len(p) for p in prompts) / len(prompts), count.steps,
                   count.held / count.steps, count.unshared / count.steps, 1 - count.held / count.unshared, "beam")


def plot(results: list[Sharing], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    cases = list(dict.fromkeys((r.mode, r.n) for r in results))
    fig, ax = plt.subplots(figsize=(6.4 + 0.6 * max(0, len(cases) - 3), 4.0))
    width = 0.8 / len(workloads)
    for k, workload in enumerate(workloads):
        values = [next((100 * r.saving for r in results if r.workload == workload and (r.mode, r.n) == case), 0.0)
                  for case in cases]
        xs = [i + (k - (len(workloads) - 1) / 2) * width for i in range(len(cases))]
        bars = ax.bar(xs, values, width, label=workload)
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    for mode, (lo, hi) in (("parallel", PAPER_PARALLEL_SAMPLING), ("beam", PAPER_BEAM_SEARCH)):
        idx = [i for i, case in enumerate(cases) if case[0] == mode]
        if idx:
            ax.fill_between([min(idx) - 0.45, max(idx) + 0.45], 100 * lo, 100 * hi, color="grey", alpha=0.25,
                            label="paper (OPT-13B, Alpaca)" if mode == "parallel" else None)
            ax.text(max(idx) + 0.45, 100 * hi, f"paper {100 * lo:.1f}-{100 * hi:.1f}%", fontsize=7, ha="right",
                    va="bottom", color="dimgrey")
    ax.set_xticks(range(len(cases)), [f"n = {n}" if mode == "parallel" else f"beam k = {n}" for mode, n in cases])
    ax.set_ylim(0, 130 * max(max(r.saving for r in results), PAPER_BEAM_SEARCH[1] if any(
        r.mode == "beam" for r in results) else 0))  # room above the bars for the legend
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
    parser.add_argument("--beam-k", default="2,4,6", help="beam widths, comma-separated ('' for none)")
    parser.add_argument("--beam-prompts", type=int, default=16, help="requests per workload for beam search")
    parser.add_argument("--beam-max-tokens", type=int, default=32)
    parser.add_argument("--beam-kv-blocks", type=int, default=4096)
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
    beam_ks = [int(k) for k in args.beam_k.split(",") if k]
    if beam_ks:
        ids = sharegpt_prompt_ids()
        beam_limit = args.max_model_len - args.beam_max_tokens
        order = {"sharegpt": list(range(len(ids))), "short": sorted(range(len(ids)), key=lambda i: len(ids[i]))}
        for name, idx in order.items():
            prompts = [ids[i][:beam_limit] for i in idx[: args.beam_prompts]]
            results += [measure_beams(name, prompts, k, args) for k in beam_ks]
    checked = check_against_engine(args) if args.check_engine else "not checked against the engine (--no-check-engine)"

    machine = describe()
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]).resolve().relative_to(ROOT)),
                                                              *sys.argv[1:]])
    lines = [
        "Experiment 1 (PagedAttention paper section 6.3, Fig. 15), parallel sampling and beam search: KV blocks "
        "saved by sharing",
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
        f"beam search: k = {args.beam_k or 'none'}, the first {args.beam_prompts} prompts of each workload, "
        f"{args.beam_max_tokens} tokens per beam (ignore_eos), the real engine and model (default dtype)",
        "",
        f"{'mode':<10}{'workload':<10}{'n/k':>4}{'requests':>10}{'prompt tok':>12}{'steps':>8}{'held':>10}"
        f"{'unshared':>10}{'saved':>9}",
    ]
    for r in results:
        lines.append(f"{r.mode:<10}{r.workload:<10}{r.n:>4}{r.requests:>10}{r.mean_prompt_tokens:>12.1f}{r.steps:>8}"
                     f"{r.mean_blocks_held:>10.1f}{r.mean_blocks_unshared:>10.1f}{100 * r.saving:>8.1f}%")
    lo, hi = PAPER_PARALLEL_SAMPLING
    lines += ["", f"paper (OPT-13B on Alpaca: prompts of 19 tokens and outputs of 58 on average, its Fig. 11): "
                  f"{100 * lo:.1f}% to {100 * hi:.1f}% saved for n = 2..6. Here:"]
    for name in workloads:
        rows = [r for r in results if r.workload == name and r.mode == "parallel"]
        lines.append(f"  {name}: prompts of {rows[0].mean_prompt_tokens:.0f} tokens on average (30 of them the "
                     f"chat template), {100 * min(r.saving for r in rows):.1f}% to "
                     f"{100 * max(r.saving for r in rows):.1f}% saved")
    beams = [r for r in results if r.mode == "beam"]
    if beams:
        lo, hi = PAPER_BEAM_SEARCH
        lines.append(f"paper, beam search: {100 * lo:.1f}% to {100 * hi:.1f}% saved for k = 2..6. Here:")
        for name in workloads:
            rows = [r for r in beams if r.workload == name]
            lines.append(f"  {name}: prompts of {rows[0].mean_prompt_tokens:.0f} tokens on average, "
                         f"{100 * min(r.saving for r in rows):.1f}% to {100 * max(r.saving for r in rows):.1f}% saved")
    lines += [
        "The saving is the prompt's share of the blocks the samples would otherwise duplicate: it grows with the",
        "prompt and with n, and shrinks as the outputs grow. Beams also share the output blocks they have in",
        "common (a beam forks from another mid-output), so beam search saves more than sampling.",
        json.dumps({"results": [asdict(r) for r in results], "machine": machine.as_dict(), "command": command}),
    ]
    title = (f"Parallel sampling and beam search: KV blocks saved by sharing\nSmolLM2-135M, block size "
             f"{args.block_size}, {args.max_tokens} tokens per sample, {args.beam_max_tokens} per beam")
    write_record(args.output, lines, lambda png: plot(results, png, title))


if __name__ == "__main__":
    main()
