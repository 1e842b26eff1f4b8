"""What the paper experiments share: the ShareGPT prompts as token counts, and the engine's step loop with a
stand-in for the model.

Prompts: ``../shared/data/sharegpt_prompts_1000.json`` (fallback ``chatsvc/data/``), each prompt's first turn
as one user message in the default model's chat template (SmolLM2-135M-Instruct, ChatML), counted with its
tokenizer.

The stand-in runs the engine's own ``Scheduler`` and ``BlockManager`` exactly as ``LLMEngine.step`` does
(schedule -> update -> fork an ``n > 1`` group when its prompt is done -> append one token per sampling
sequence -> finish at ``max_tokens``) and appends a fixed token instead of running the model. With prefix
caching off and every request generating exactly ``max_tokens`` (``ignore_eos``), no block decision depends on
a token's value, so the block accounting is the engine's, token for token, and deterministic.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.scheduler import Scheduler  # noqa: E402

DATA_CANDIDATES = (
    ROOT / ".." / "shared" / "data" / "sharegpt_prompts_1000.json",
    ROOT / "chatsvc" / "data" / "sharegpt_prompts_1000.json",
)
PAPER_DIR = ROOT / "docs" / "paper"


def sharegpt_prompt_lengths() -> list[int]:
    """Token count of every ShareGPT prompt in the default model's chat template, in file order."""
    return [len(ids) for ids in sharegpt_prompt_ids()]


def sharegpt_prompt_ids() -> list[list[int]]:
    """Every ShareGPT prompt in the default model's chat template, as token ids, in file order."""
    from engine.model_files import load_tokenizer

    for path in DATA_CANDIDATES:
        if path.exists():
            rows = json.loads(path.read_text())
            break
    else:
        raise FileNotFoundError(f"no ShareGPT prompts at any of {[str(p) for p in DATA_CANDIDATES]}")
    tokenizer, _ = load_tokenizer()
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": row["conversations"][0]["value"]}]))
            for row in rows]


def request_tokens(index: int, length: int) -> list[int]:
    """Distinct token ids per request, so that no two requests could ever share a block by content."""
    return [(index * 7919 + j) % 49152 for j in range(length)]


def drive(scheduler: Scheduler, on_step: Callable[[Scheduler], None], max_model_len: int) -> int:
    """Run every queued request to its end, calling ``on_step`` after each ``schedule()`` (the step's blocks
    allocated, before its tokens are computed); returns the number of steps."""
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        on_step(scheduler)
        scheduler.update(out)
        for item in out.scheduled:
            if not item.samples:
                continue
            group = item.group
            seqs = [item.seq]
            if group.needs_fork and item.seq is group.seqs[0]:
                seqs += scheduler.fork(group)
            for seq in seqs:
                seq.token_ids.append(1)
                if (seq.num_output_tokens >= (group.sampling_params.max_tokens or 0)
                        or seq.num_tokens >= max_model_len):
                    scheduler.finish_seq(group, seq, "length")
        steps += 1
        if steps > 10_000_000:
            raise RuntimeError("no progress")
    return steps


def write_record(output: Path, lines: list[str], plot: Callable[[Path], None]) -> None:
    """The record (its last line the JSON one) to ``output``, its figure beside it as PNG, and the record
    but its JSON line to stdout."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n")
    png = output.with_suffix(".png")
    plot(png)
    print("\n".join(lines[:-1]))
    print(f"wrote {output} and {png}")
