"""Incremental detokenization with stop strings, for streaming.

Byte-level tokens can end in the middle of a UTF-8 character, and SentencePiece-style decoders
drop the leading space of the first token they see, so text cannot be produced by decoding each
new token alone. Instead a short window of tokens is decoded: ``ids[prefix:read]`` was already
turned into text, ``ids[prefix:]`` is decoded now, and the difference is new text. While the
new text ends in U+FFFD (an unfinished character) nothing is emitted and the window grows. The
concatenated deltas therefore equal ``decode(output_ids)``.

Stop strings are searched in the decoded text. Text that could still be the start of a stop
string is held back until the next token shows it is not, so a stop string split over several
tokens never reaches the client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.beam import end_tokens
from engine.request import SamplingParams

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class DetokenizerStep:
    text_delta: str
    stopped: bool = False
    stop_str: str | None = None  # the stop string that matched
    stop_token_id: int | None = None  # or the stop / EOS token that ended generation


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas and detects stop strings and stop tokens.

    ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)``: a transformers
    tokenizer or ``engine.tokenizer.Tokenizer``. EOS ids come from ``eos_token_ids`` or, when not
    given, from the tokenizer. A stop token (EOS unless ``ignore_eos``, or one of
    ``stop_token_ids``) ends the stream; its text is left out unless ``include_stop_str_in_output``.
    ``prompt_token_ids`` is accepted for interface symmetry but unused: the output text is the
    decode of the output tokens alone, exactly what a non-streaming response returns.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Iterable[int] | None = None) -> None:
        self._tokenizer: Decoder = tokenizer
        self._params = params
        self._skip_special = params.skip_special_tokens
        eos = _eos_ids(tokenizer) if eos_token_ids is None else eos_token_ids
        self._stop_tokens = end_tokens(eos, params.stop_token_ids, params.ignore_eos)
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        self._ids: list[int] = []  # output tokens that are part of the text
        self._num_output_tokens = 0  # all output tokens seen, a hidden stop token included
        self._prefix = 0  # ids[prefix:read] is the context already turned into text
        self._read = 0
        self._text = ""  # text decoded so far (held-back characters included)
        self._emitted = 0  # characters of _text already returned
        self._stopped = False

    @property
    def output_text(self) -> str:
        """Text of the output so far, held-back characters included; cut at a matched stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        if self._stopped:
            return DetokenizerStep("", stopped=True)
        stop_token: int | None = None
        for pos, tok in enumerate(new_token_ids):
            if tok in self._stop_tokens:
                stop_token = tok
                keep = pos + 1 if self._params.include_stop_str_in_output else pos
                new_token_ids = new_token_ids[:keep]
                self._num_output_tokens += pos + 1
                break
        else:
            self._num_output_tokens += len(new_token_ids)

        checked_len = len(self._text)
        self._ids.extend(new_token_ids)
        self._decode_window(force=stop_token is not None)

        if self._stops and self._num_output_tokens > self._params.min_tokens:
            match = self._find_stop(checked_len)
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._params.include_stop_str_in_output else start
                self._text = self._text[:end]
                return self._finish(stop_str=stop)
        if stop_token is not None:
            return self._finish(stop_token_id=stop_token)

        safe_end = len(self._text)
        if not self._params.include_stop_str_in_output:
            safe_end -= self._held_back()
        delta = self._text[self._emitted : safe_end] if safe_end > self._emitted else ""
        self._emitted = max(self._emitted, safe_end)
        return DetokenizerStep(delta)

    def flush(self) -> str:
        """Everything not yet returned; call once when the sequence finishes without a stop match."""
        if self._stopped:
            return ""
        self._decode_window(force=True)
        return self._rest()

    def _finish(self, stop_str: str | None = None, stop_token_id: int | None = None) -> DetokenizerStep:
        self._stopped = True
        return DetokenizerStep(self._rest(), stopped=True, stop_str=stop_str, stop_token_id=stop_token_id)

    def _rest(self) -> str:
        """The text not returned yet, all of it, now returned."""
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta

    def _decode_window(self, force: bool) -> None:
        """Append the text of tokens past ``read`` unless it ends mid-character (and not ``force``)."""
        if self._read == len(self._ids):
            return
        known = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if not force and (len(full) <= len(known) or full.endswith(_REPLACEMENT)):
            return
        self._text += full[len(known) :]
        self._prefix = self._read
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _find_stop(self, checked_len: int) -> tuple[int, str] | None:
        """The earliest stop string ending past ``checked_len`` (earlier ones were searched before)."""
        found = ((self._text.find(stop, max(0, checked_len - len(stop) + 1)), stop) for stop in self._stops)
        return min(((at, stop) for at, stop in found if at >= 0), key=lambda match: match[0], default=None)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._text
        return next((n for n in range(min(self._max_stop_len - 1, len(text)), 0, -1)
                     if any(stop.startswith(text[-n:]) for stop in self._stops)), 0)


def _eos_ids(tokenizer: Any) -> set[int]:
    # engine.tokenizer.Tokenizer has a set ``eos_token_ids``; transformers tokenizers an int ``eos_token_id``.
    found: set[int] = set()
    for name in ("eos_token_ids", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, Iterable):
            found.update(int(v) for v in value)
    return found
