from __future__ import annotations

import pydantic
import pytest

from chatsvc.errors import APIError
from chatsvc.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SessionMessage,
    check_event_id,
    resolve_max_tokens,
)


def test_chat_request_maps_to_sampling_params() -> None:
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": "x", "seed": 3, "max_completion_tokens": 7,
        "repetition_penalty": 1.1, "ignore_eos": True, "unknown_field": 1})
    assert req.messages[0].text() == "hi"
    assert req.requested_max_tokens() == 7
    p = req.sampling_params(7, n=2, logprobs=3)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.max_tokens, p.logprobs) == \
        (2, 0.5, 0.9, 5, ["x"], 3, 7, 3)
    assert p.repetition_penalty == 1.1 and p.ignore_eos


@pytest.mark.parametrize("bad", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
    {"messages": [{"role": "user", "content": "x"}], "top_p": 0},
    {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
    {"messages": [{"role": "user", "content": "x"}], "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "stop": [""]},
    {"messages": "hello"},
])
def test_chat_request_rejects(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate(bad)


def test_completion_prompt_forms() -> None:
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"prompt": ["a"]}).prompt == ["a"]
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": ""})
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": ["a", "b"]})


def test_session_message_blank() -> None:
    with pytest.raises(pydantic.ValidationError):
        SessionMessage.model_validate({"content": "   "})


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(None, 10, 100, None) == 90
    assert resolve_max_tokens(None, 10, 100, 16) == 16
    assert resolve_max_tokens(5, 10, 100, None) == 5
    for args in ((91, 10, 100, None), (None, 100, 100, None)):
        with pytest.raises(APIError) as e:
            resolve_max_tokens(*args)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("value", ["1:5-0", "5-0", "1:", "12", "1:18446744073709551615-18446744073709551615"])
def test_event_ids_as_sent_are_accepted(value: str) -> None:
    check_event_id(value)


@pytest.mark.parametrize("value", ["1:99999999999999999999", "1:18446744073709551616", "1:\u0661", "1:5\n",
                                   "\u0661:5", "1:5-0 ", "x", "1:-5"])
def test_event_ids_out_of_range_non_ascii_or_with_a_newline_are_400(value: str) -> None:
    with pytest.raises(APIError) as exc:
        check_event_id(value)
    assert exc.value.status == 400 and exc.value.param == "after"
