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


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(("fields", "kind", "parallel", "shown"), [
    ({}, "tool_calls_auto", True, True),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls", False, True),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_calls", False, True),
    ({"tool_choice": "none"}, None, False, False),
])
def test_tool_choice_maps_to_a_grammar(fields: dict[str, object], kind: str | None, parallel: bool,
                                       shown: bool) -> None:
    """Each tool choice's grammar; ``none`` shows no tools and constrains nothing, but its tools are still
    compiled (``checked_grammar``) so that a bad schema is refused whatever the choice."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                                                **fields})
    spec = req.sampling_params(8).grammar
    assert (spec.kind if spec else None) == kind and (spec.parallel if spec else False) == parallel
    assert req.calls_tools() == shown and req.grammar_param() == "tools"
    checked = req.checked_grammar()
    assert checked is not None and checked.kind.startswith("tool_calls")


def test_messages_carry_tool_calls_and_results() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""}]})
    assert [m.openai() for m in req.messages][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "", "tool_call_id": "call_1"}]
    msg = SessionMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "4 C"})
    assert msg.stored() == {"role": "tool", "content": "4 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": "auto"}, "tool_choice requires tools"),
    ({"tools": [TOOL, TOOL]}, "two tools are named"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not among the tools"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "y"}]},
     "which no earlier assistant message called"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "only a tool message has one"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "x",
      "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, "only assistant messages"),
])
def test_bad_tool_fields_are_validation_errors(body: dict[str, object], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
