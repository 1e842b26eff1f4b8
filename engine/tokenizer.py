"""Tokenizer: a thin wrapper over a transformers fast tokenizer, from an HF directory or a GGUF file.

Converting a GGUF vocabulary with transformers takes seconds, so the result is saved once as
ordinary tokenizer files under the user cache directory, keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerFast


def cache_dir() -> Path:
    base = os.environ.get("CHATSVC_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "chatsvc"


# Spaces before punctuation, which transformers' clean-up removes where it applies it.
_CLEAN_UP_PROBE = "a . b , c ! d ? e 's f n't g 're"


def decode_mode(hf: PreTrainedTokenizerFast) -> str:
    """How ``hf.decode`` turns ids into text: "raw" (the Rust tokenizer's output as it is), "clean_up" (then
    transformers' ``clean_up_tokenization``) or, where a probe matches neither, "hf" (call ``hf.decode``).
    transformers versions differ on whether a BPE vocabulary's ``clean_up_tokenization_spaces`` is obeyed
    (5.x ignores it), so the probe asks the installed one."""
    if not hf.clean_up_tokenization_spaces:
        return "raw"
    ids = hf.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
    raw = str(hf.backend_tokenizer.decode(ids, skip_special_tokens=True))
    full = str(hf.decode(ids, skip_special_tokens=True))
    cleaned = hf.clean_up_tokenization(raw)
    if cleaned == raw:  # this vocabulary cannot show the difference
        return "hf"
    return "raw" if full == raw else "clean_up" if full == cleaned else "hf"


class Tokenizer:
    """Safe to share between threads: each thread uses its own copy of the transformers tokenizer.

    The Rust tokenizer behind it is one object with a runtime borrow check: a call that reconfigures
    it (transformers does when a call's truncation or padding differ from the last one) while another
    thread encodes with the GIL released raises "Already borrowed" on tokenizers builds without an
    internal lock. Per-thread copies were chosen over one lock so that the engine thread's per-token
    decodes never wait behind a long prompt being encoded on the event loop. The thread that built
    the tokenizer uses the original; any other thread pays for one copy (a few tenths of a second for
    a 49k vocabulary) on its first call.
    """

    def __init__(self, hf: PreTrainedTokenizerFast, extra_eos_ids: Iterable[int] = ()) -> None:
        self._local = threading.local()
        self._local.hf = hf
        self._original = hf
        own = () if hf.eos_token_id is None else (int(hf.eos_token_id),)
        self.eos_token_ids: frozenset[int] = frozenset((*extra_eos_ids, *own))
        self.vocab_size: int = len(hf)
        self._decode_mode = decode_mode(hf)

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """The calling thread's own transformers tokenizer."""
        try:
            return self._local.hf  # type: ignore[no-any-return]
        except AttributeError:
            self._local.hf = copy.deepcopy(self._original)
            return self._local.hf  # type: ignore[no-any-return]

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        try:
            hf = (_fast_tokenizer_class(Path(path)) or transformers.AutoTokenizer).from_pretrained(str(path))
        except Exception as e:  # transformers raises several types for missing/corrupt files
            raise ValueError(f"cannot load tokenizer from {path}: {e}") from e
        if not isinstance(hf, PreTrainedTokenizerFast):
            raise ValueError(f"tokenizer in {path} is not a fast (tokenizers-backed) tokenizer")
        return cls(hf, extra_eos_ids)

    @classmethod
    def from_gguf(cls, gguf_path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        try:
            return cls.from_dir(gguf_tokenizer_dir(gguf_path), extra_eos_ids)
        except OSError:
            # Cache not writable (read-only home, full disk): convert in memory every time instead.
            return cls(_convert_gguf_tokenizer(Path(gguf_path).resolve()), extra_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # What transformers' decode does, minus its Python layers (~3x the Rust call's cost): the engine calls
        # this twice per generated token (the detokenizer's window), between the model's forward passes.
        hf = self.hf
        if self._decode_mode == "hf":
            return str(hf.decode(list(ids), skip_special_tokens=skip_special_tokens))
        text = str(hf.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return hf.clean_up_tokenization(text) if self._decode_mode == "clean_up" else text

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: function definitions for a template that renders them (transformers' ``tools=``)."""
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self.hf.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        assert isinstance(text, str)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template writes the special tokens itself, so none are added on encoding (as transformers does).
        if not any(self._has_control_token(m.get("content")) for m in messages):
            return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
        return self._chat_with_literal_contents(messages, add_generation_prompt, tools)

    def _has_control_token(self, content: object) -> bool:
        return isinstance(content, str) and any(t in content for t in self._control_tokens())

    def _control_tokens(self) -> list[str]:
        return [t.content for t in self._original.added_tokens_decoder.values() if t.special]

    def _chat_with_literal_contents(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The template with message contents encoded as plain text: a user who types ``<|im_end|>`` gets
        the characters, never the control token, so they cannot forge a turn of another role. Only
        messages that contain a control token are encoded apart (the rest tokenize exactly as before)."""
        marker = f"\x00{secrets.token_hex(8)}\x00"
        templated = [{**m, "content": f"{marker}{i}{marker}"} if self._has_control_token(m.get("content"))
                     else m for i, m in enumerate(messages)]
        pieces = self.render_chat(templated, add_generation_prompt, tools).split(marker)
        ids: list[int] = []
        # split() alternates template text and (between a pair of markers) a message index.
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False)
            else:
                content = str(messages[int(piece)]["content"])
                ids += self.hf.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids


def gguf_tokenizer_dir(gguf_path: str | Path) -> Path:
    """Directory of tokenizer files converted from a GGUF file's metadata (converted on first use)."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "tokenizers" / f"{path.stem}-{key}"
    if (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    hf = _convert_gguf_tokenizer(path)
    # Written to a temporary sibling and renamed, so concurrent processes never see half a directory.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        hf.save_pretrained(str(tmp))
        # If another process won the race its copy is identical, so a failed rename is fine.
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fast_tokenizer_class(path: Path) -> type[PreTrainedTokenizerFast] | None:
    """The fast tokenizer class a directory's ``tokenizer_config.json`` names, looked up the way AutoTokenizer
    looks it up but without its model-config machinery, which imports torch: a gateway that holds no model
    tokenizes without loading torch. None when the directory names no usable class (AutoTokenizer decides)."""
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    for candidate in (name if name.endswith("Fast") else f"{name}Fast", name):
        found = getattr(transformers, candidate, None)
        if isinstance(found, type) and issubclass(found, PreTrainedTokenizerFast):
            return found
    return None


def _convert_gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"cannot read the tokenizer from GGUF file {path}: {e}") from e
    if not isinstance(hf, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer in GGUF file {path} did not convert to a fast tokenizer")
    return hf
