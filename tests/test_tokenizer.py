"""Tokenizer wrapper: tiny byte-level tokenizer (unit) and the GGUF tokenizer against transformers (integration)."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tiny_model import make_tiny_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import engine.tokenizer as tokmod
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer, decode_mode, gguf_tokenizer_dir

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Ünïcödé — “quotes”, 日本語, emoji 🤖👍🏽",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "Spaces before punctuation , like this . Or ! And ? It 's , isn't , we 're , I 'm , they 've",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


def test_tiny_round_trip_and_eos(tiny: Tokenizer) -> None:
    for text in TEXTS[:4]:
        ids = tiny.encode(text)
        assert all(0 <= i < tiny.vocab_size for i in ids)
        assert tiny.decode(ids) == text
    assert tiny.eos_token_ids == frozenset({tiny.hf.convert_tokens_to_ids("<|im_end|>")})


def test_special_tokens_skipped_only_on_request(tiny: Tokenizer) -> None:
    ids = tiny.encode(TEXTS[4])
    assert tiny.hf.convert_tokens_to_ids("<|im_start|>") in ids
    assert tiny.decode(ids, skip_special_tokens=False) == TEXTS[4]
    assert tiny.decode(ids) == "user\nspecial tokens inline"


@pytest.mark.parametrize("force_bpe_clean_up", [False, True])
def test_decode_equals_transformers_with_clean_up_on(tiny: Tokenizer, force_bpe_clean_up: bool) -> None:
    """decode skips transformers' Python layers: where a tokenizer asks for clean-up, the installed transformers
    decides whether a BPE vocabulary gets it (5.x: only with its override), and decode follows it."""
    hf = copy.deepcopy(tiny.hf)
    hf.clean_up_tokenization_spaces = True
    if force_bpe_clean_up:
        hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    tok = Tokenizer(hf)
    assert decode_mode(hf) in ("raw", "clean_up")  # the probe told the two apart
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert decode_mode(tiny.hf) == "raw"


def test_chat_template_renders_chatml(tiny: Tokenizer) -> None:
    msgs = CONVERSATIONS[1]
    with_prompt = tiny.apply_chat_template(msgs)
    without = tiny.apply_chat_template(msgs, add_generation_prompt=False)
    assert tiny.decode(without, skip_special_tokens=False) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    assert with_prompt[: len(without)] == without
    assert tiny.decode(with_prompt[len(without):], skip_special_tokens=False) == "<|im_start|>assistant\n"


def test_threads_share_one_tokenizer_safely(tiny: Tokenizer) -> None:
    """Encode, decode and chat templates hammered from several threads at once, while one thread also
    calls the transformers tokenizer with truncation on and off (which reconfigures the Rust backend
    object between calls): every thread gets the single-threaded results and none sees an error.

    Each thread works on its own backend object. A shared one is truncated under the other threads'
    feet, and on tokenizers builds that check borrows at run time (0.21, for one) a reconfiguration
    that meets an encode raises "Already borrowed".
    """
    text = TEXTS[2] * 20
    ids = tiny.encode(text)
    chat = tiny.apply_chat_template(CONVERSATIONS[1])
    expected = {"encode": ids, "decode": tiny.decode(ids), "chat": chat}
    threads = 6
    start = threading.Barrier(threads)
    backends: set[int] = set()

    def work(i: int) -> list[str]:
        start.wait()
        backends.add(id(tiny.hf._tokenizer))
        bad = []
        for k in range(150):
            got = {"encode": tiny.encode(text), "decode": tiny.decode(ids),
                   "chat": tiny.apply_chat_template(CONVERSATIONS[1])}
            if i == 0:
                tiny.hf(text, truncation=bool(k % 2), max_length=8)
            if got != expected:
                bad.append(f"thread {i}, round {k}")
        return bad

    with ThreadPoolExecutor(threads) as pool:
        failures = [f for bad in pool.map(work, range(threads)) for f in bad]
    assert failures == []
    assert len(backends) == threads  # no two threads ever shared the Rust object


def test_missing_chat_template_is_a_value_error(tiny: Tokenizer) -> None:
    bare = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tiny.hf.backend_tokenizer))
    with pytest.raises(ValueError, match="chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


def test_bad_tokenizer_dir_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)


# ---- the default model's GGUF tokenizer ----------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, object, Path]:
    """(ours, converted into a fresh cache dir; transformers' own GGUF tokenizer; the cache dir)."""
    path = default_model_path()
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("CHATSVC_CACHE_DIR", str(cache))
    try:
        ours = Tokenizer.from_gguf(path)
    finally:
        mp.undo()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref, cache


@pytest.mark.integration
def test_gguf_tokenizer_matches_transformers(gguf_pair: tuple[Tokenizer, object, Path]) -> None:
    ours, ref, _ = gguf_pair
    assert ours.vocab_size == len(ref) == 49152  # type: ignore[arg-type]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # type: ignore[attr-defined]
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == ref.encode(  # type: ignore[attr-defined]
                text, add_special_tokens=False)
    # The GGUF template adds SmolLM's default system prompt when none is given.
    assert "You are a helpful AI assistant" in ours.decode(ours.apply_chat_template(CONVERSATIONS[0]))
    assert ours.eos_token_ids == frozenset({ours.hf.convert_tokens_to_ids("<|im_end|>")})


@pytest.mark.integration
def test_gguf_tokenizer_conversion_is_cached(gguf_pair: tuple[Tokenizer, object, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, cache = gguf_pair
    monkeypatch.setenv("CHATSVC_CACHE_DIR", str(cache))
    (converted,) = (cache / "tokenizers").iterdir()
    assert (converted / "tokenizer.json").is_file()

    class NoConversion:
        @staticmethod
        def from_pretrained(*args: object, **kwargs: object) -> None:
            raise AssertionError("converted again despite the cache")

    monkeypatch.setattr(tokmod.transformers, "AutoTokenizer", NoConversion)
    assert gguf_tokenizer_dir(default_model_path()) == converted


def test_a_converted_tokenizer_loads_without_torch(gguf_pair: tuple[Tokenizer, object, Path]) -> None:
    """A gateway without a model tokenizes with the class the tokenizer's config names, not AutoTokenizer
    (whose model-config machinery imports torch)."""
    import os
    import subprocess
    import sys

    _, _, cache = gguf_pair
    code = ("import sys\nfrom engine.tokenizer import Tokenizer, gguf_tokenizer_dir\n"
            "from engine.model_files import default_model_path\n"
            "tok = Tokenizer.from_dir(gguf_tokenizer_dir(default_model_path()))\n"
            "assert tok.encode('Hello') and 'torch' not in sys.modules, sorted(sys.modules)[:3]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "CHATSVC_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unwritable_cache_falls_back_to_in_memory_conversion(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    def unwritable(path: object) -> Path:
        raise PermissionError("read-only cache")

    converted: list[Path] = []

    def convert(path: Path) -> object:
        converted.append(path)
        return tiny.hf

    monkeypatch.setattr(tokmod, "gguf_tokenizer_dir", unwritable)
    monkeypatch.setattr(tokmod, "_convert_gguf_tokenizer", convert)
    tok = Tokenizer.from_gguf(tmp_path / "model.gguf", extra_eos_ids=[0])
    assert converted == [(tmp_path / "model.gguf").resolve()]
    assert tok.hf is tiny.hf and tok.eos_token_ids == tiny.eos_token_ids | {0}
