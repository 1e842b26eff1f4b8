"""Prompt loading, the deterministic draw, and token-exact synthetic text (with a toy tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatsvc.bench import dataset


class WordTokenizer:
    """One token per space-separated word (a toy with exact, easy-to-check counts)."""

    def encode(self, text: str) -> list[int]:
        return [hash(w) & 0xFFFF for w in text.split()]

    def decode(self, ids: list[int]) -> str:  # the toy cannot invert hashes; keeps a word per id
        return " ".join(f"w{i}" for i in ids)


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_bundled_sharegpt_prompts_load() -> None:
    prompts = dataset.load_prompts()
    assert len(prompts) == 1000
    assert all(p.strip() == p and p for p in prompts)
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_prompts_1000.json"
    if shared.exists():  # the package copy is the shared data set, unchanged
        assert dataset.default_dataset_path().read_bytes() == shared.read_bytes()


def test_max_chars_filters() -> None:
    short = dataset.load_prompts(max_chars=200)
    assert 0 < len(short) < 1000
    assert max(map(len, short)) <= 200


def test_other_formats(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    p.write_text(json.dumps(["hello", "", {"prompt": "x"}, {"conversations": [
        {"from": "gpt", "value": "ignored"}, {"from": "human", "value": " hi "}]},
        {"messages": [{"role": "user", "content": "m"}]}]))
    assert dataset.load_prompts(p) == ["hello", "x", "hi", "m"]
    q = tmp_path / "b.jsonl"
    q.write_text('{"prompt": "one"}\n\n{"text": "two"}\n')
    assert dataset.load_prompts(q) == ["one", "two"]
    (tmp_path / "c.json").write_text("[]")
    with pytest.raises(ValueError):
        dataset.load_prompts(tmp_path / "c.json")


def test_draw_is_deterministic_and_without_repeats() -> None:
    prompts = [f"p{i}" for i in range(10)]
    a = dataset.draw_sessions(prompts, sessions=3, turns=3, seed=7)
    assert a == dataset.draw_sessions(prompts, sessions=3, turns=3, seed=7)
    assert a != dataset.draw_sessions(prompts, sessions=3, turns=3, seed=8)
    assert [len(c) for c in a] == [3, 3, 3]
    flat = [p for c in a for p in c]
    assert len(set(flat)) == 9
    # More draws than prompts: every prompt used once before any repeats.
    many = [p for c in dataset.draw_sessions(prompts, sessions=4, turns=5, seed=1) for p in c]
    assert sorted(many[:10]) == sorted(prompts)


def test_system_prompt_exact_with_tokenizer_and_deterministic() -> None:
    tok = CharTokenizer()
    sp = dataset.system_prompt(341, tok)
    assert len(tok.encode(sp)) == 341
    assert sp == dataset.system_prompt(341, tok)
    assert sp.startswith("Rule 1:")
    rough = dataset.system_prompt(100, None)
    assert 300 <= len(rough) <= 400
    assert dataset.system_prompt(0) == ""


def test_fit_to_tokens_cuts_and_pads() -> None:
    tok = WordTokenizer()
    assert len(tok.encode(dataset.fit_to_tokens("a b c d e", 3, tok, filler=[]))) == 3
    padded = dataset.fit_to_tokens("a b", 7, tok, filler=["x y z"])
    assert len(tok.encode(padded)) == 7
    # Without filler a short text stays short rather than looping forever.
    assert len(tok.encode(dataset.fit_to_tokens("a b", 7, tok, filler=[]))) == 2


@pytest.mark.integration
def test_real_tokenizer_system_prompt_is_exact() -> None:
    tok = dataset.load_tokenizer()
    sp = dataset.system_prompt(341, tok)
    assert len(tok.encode(sp)) == 341
    cut = dataset.fit_to_tokens(dataset.load_prompts()[0], 128, tok, dataset.load_prompts()[1:5])
    assert 126 <= len(tok.encode(cut)) <= 128
