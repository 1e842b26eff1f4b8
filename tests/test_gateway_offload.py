"""chatsvc/offload.py: prompts are checked before tokenizing, long ones tokenized off the event loop, large
responses encoded in pieces, token texts decoded once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from chatsvc.errors import APIError
from chatsvc.offload import INLINE_CHARS, Offload, Raw, TokenTexts, dumps_in_pieces
from tests.fake_engine import FakeEngine, tiny_tokenizer


@pytest.fixture
def offload(tmp_path: Path) -> Offload:
    return Offload(FakeEngine(tiny_tokenizer(tmp_path), max_model_len=512))


@pytest.mark.parametrize("obj", [
    {"a": [1, 2.5, "x", None], "b": {"c": list(range(200))}},
    [{"t": i, "lp": [-0.5, -1.25]} for i in range(100)],
    "plain", 3, {"nested": [[1, [2, [3]]]], "e": []},
])
def test_dumps_in_pieces_is_json_dumps(obj: object) -> None:
    assert dumps_in_pieces(obj) == json.dumps(obj)


def test_raw_parts_are_written_as_they_are() -> None:
    assert dumps_in_pieces({"x": [Raw('{"a": 1}'), 2]}) == '{"x": [{"a": 1}, 2]}'


def test_token_texts_decode_each_id_once(offload: Offload) -> None:
    texts = TokenTexts(offload.tokenizer)
    ids = offload.tokenizer.encode("hello hello world")
    first = [texts(t) for t in ids]
    assert [texts(t) for t in ids] == first and len(texts.cache) == len(set(ids))
    assert "".join(first).strip() == offload.tokenizer.decode(ids).strip()


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(offload: Offload) -> None:
    too_long = "a" * (offload.max_token_chars * offload.max_model_len)
    with pytest.raises(APIError) as exc:
        await offload.encode(too_long)
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"


async def test_long_prompts_are_tokenized_on_a_worker_thread(offload: Offload, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    encode = offload.tokenizer.encode

    def recording(text: str, **kw: object) -> list[int]:
        seen.append(threading.current_thread().name)
        return list(encode(text, **kw))  # type: ignore[arg-type]

    monkeypatch.setattr(offload.tokenizer, "encode", recording)
    short = await offload.encode("hi there")
    long = await offload.encode("hi there " * (INLINE_CHARS // 9 + 1))
    assert short and long
    assert seen[0] == threading.current_thread().name and seen[1].startswith("chatsvc-cpu")
    offload.close()
