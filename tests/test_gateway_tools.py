"""Tool calling (chatsvc/tools.py, ``tools`` / ``tool_choice`` / ``parallel_tool_calls``): the reply's split into
content and calls as it streams, the prompt's rendering of tools, calls and results through the real model's
template, and through the real ``openai`` SDK against a live server running the default model in an engine
process: calls that validate, streamed deltas that assemble to the whole reply, tool results in sessions and
WebSocket frames, and bad input refused with a 400 before anything is stored or queued."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from gateway_fixtures import LiveServer, default_model_path, finished_requests, redis_proc, sdk_server  # noqa: F401
from pydantic import BaseModel, Field

from chatsvc.tools import (
    ToolCallParser,
    chat_prompt_ids,
    fallback_tools_text,
    parse_reply,
    prompt_messages,
    template_takes_tools,
)

# Bounded strings: a 135M model may otherwise write letters until max_tokens (an honest "length", no call).
Short = Annotated[str, Field(max_length=40)]


class Weather(BaseModel):
    city: Short
    unit: Literal["celsius", "fahrenheit"]


class Search(BaseModel):
    query: Short
    limit: Annotated[int, Field(ge=1, le=10)]


def _tool(name: str, description: str, params: type[BaseModel]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params.model_json_schema()}}


TOOLS = [_tool("get_weather", "Get the current weather in a city", Weather),
         _tool("search_web", "Search the web and return the top results", Search)]
ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": Weather, "search_web": Search}
PROMPTS = ["What's the weather in Paris right now?",
           "Find me a recipe for pancakes.",
           "Is it raining in Tokyo? Answer in celsius.",
           "Search for the latest news about Mars rovers."]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


# ---------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_parser_splits_calls_in_any_pieces(piece: int) -> None:
    """Fed in pieces of any size, the calls come out whole: id and name once, the arguments in fragments
    that add up to the call's JSON text, and no markup as content."""
    second = CALL.replace("get_weather", "search_web").replace('"city": "Paris", "unit": "celsius"',
                                                               '"query": "a \\"}\\n</tool_call>", "limit": 2')
    text = CALL + "\n" + second
    parser = ToolCallParser()
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = parser.feed(text[i:i + piece])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    content, deltas = content + c, deltas + d
    assert content == ""
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "search_web")]
    assert all(d.id.startswith("call_") and len(d.id) == 29 for d in firsts if d.id)
    args = ["".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Paris", "unit": "celsius"},
                                             {"query": 'a "}\n</tool_call>', "limit": 2}]
    assert [c["function"]["arguments"] for c in parser.calls] == args
    content_whole, calls = parse_reply(text)
    assert content_whole is None and [c["function"]["arguments"] for c in calls] == args


@pytest.mark.parametrize("text", ["Hello there.", "<tool", "<b>bold</b>", "<tool_call> not a call", ""])
def test_parser_passes_text_through(text: str) -> None:
    parser = ToolCallParser()
    out = "".join(parser.feed(ch)[0] for ch in text) + parser.finish()[0]
    assert out == text and not parser.called
    assert parse_reply(text) == (text, [])


def test_cut_call_keeps_its_arguments_so_far() -> None:
    """A reply cut at max_tokens inside a call reports what was written (its finish reason says length)."""
    content, calls = parse_reply(CALL[:60])
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == CALL[CALL.index('{"city'):60]


# ---------------------------------------------------------------------------------------------- the prompt


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


def test_fallback_prompt_lists_tools_and_replays_calls_and_results(tokenizer: Any) -> None:
    """SmolLM2's template has no tool syntax: the tools follow the system prompt, a past call is its
    ``<tool_call>`` block and its result a ``<tool_response>`` block in a user message."""
    assert not template_takes_tools(tokenizer.hf)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.hf.decode(chat_prompt_ids(tokenizer, messages, TOOLS))
    expected = ("<|im_start|>system\nBe brief.\n\n" + fallback_tools_text(TOOLS) + "<|im_end|>\n"
                "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                "<|im_start|>assistant\n" + CALL + "<|im_end|>\n"
                '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n'
                "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert text == expected
    assert json.dumps(TOOLS[1]) in text
    # Without tools shown the conversation renders as before, and a plain conversation as it always did.
    plain = [{"role": "user", "content": "hi"}]
    assert chat_prompt_ids(tokenizer, plain) == tokenizer.apply_chat_template(plain)


def test_native_template_gets_tools_and_argument_objects() -> None:
    """A template that names ``tools`` gets them as transformers passes them, with argument objects."""
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages[0].tool_calls[0].function.arguments.city }}"

    class Hf:
        chat_template = template

    assert template_takes_tools(Hf()) and not template_takes_tools(object())
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages, shown = prompt_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], TOOLS, True)
    assert shown == TOOLS
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert call["function"]["arguments"] == '{"city": "Rome"}'  # the caller's message is not changed


# ---------------------------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(sdk_server: LiveServer) -> LiveServer:  # noqa: F811
    return sdk_server


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _valid(call: Any) -> None:
    assert call.id.startswith("call_") and call.type == "function", call
    ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)


def _at_once(*calls: Callable[[], Any]) -> list[Any]:
    """The calls' results, the requests sent together so that the engine batches them: a batch of replies
    costs little more than one, where one after another costs each in full."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


@pytest.fixture(scope="module")
def required_replies(client: openai.OpenAI, model: str) -> dict[str, list[Any]]:
    """Each prompt's four ``required`` replies (one call greedy, one call sampled, parallel calls sampled, a
    named function), all sixteen asked at once."""
    def ask(prompt: str, **extra: Any) -> Callable[[], Any]:
        return lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      tools=TOOLS, **extra)  # type: ignore[arg-type]

    asks = [ask(prompt, **extra) for prompt in PROMPTS for extra in (
        {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 150, "temperature": 0},
        {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 150, "temperature": 0.9, "seed": 11},
        {"tool_choice": "required", "max_tokens": 120, "temperature": 0.9, "seed": 4},
        {"tool_choice": {"type": "function", "function": {"name": "search_web"}}, "parallel_tool_calls": False,
         "max_tokens": 150, "temperature": 0.9, "seed": 5})]
    replies = _at_once(*asks)
    return {prompt: replies[4 * i : 4 * i + 4] for i, prompt in enumerate(PROMPTS)}


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_tool_calls_validate(required_replies: dict[str, list[Any]], prompt: str) -> None:
    """``required``: every reply is calls whose arguments validate against their tool's schema, greedy and
    sampled; one call without parallel calls; with them, as many as the model writes (a small model may
    repeat calls until max_tokens: then only the last, cut one, is incomplete); a named choice calls that
    function."""
    greedy, sampled, many, one = required_replies[prompt]
    for done in (greedy, sampled):
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls, choice
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])
    choice = many.choices[0]
    assert choice.message.content is None and choice.message.tool_calls, choice
    whole = choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    for call in whole:
        _valid(call)
    calls = one.choices[0].message.tool_calls
    assert one.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, one
    assert calls[0].function.name == "search_web"
    _valid(calls[0])


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_streamed_tool_calls_assemble_to_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    """OpenAI's stream: a call's id and name on its first delta, then argument fragments; no markup as
    content; assembled, the same calls as the reply sent whole (greedy)."""
    messages: Any = [{"role": "user", "content": PROMPTS[0]}]
    kwargs: Any = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required",
                   "max_tokens": 150, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.function and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and (d.function is None or d.function.name is None), d
                calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
    assert content == "" and reason == "tool_calls"
    assert whole.message.tool_calls
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_auto_and_none(client: openai.OpenAI, model: str) -> None:
    """``auto``: text without markup or calls that validate; ``none``: text, and the tools are not in the
    prompt; a tool result sent back is read and answered."""
    messages: Any = [{"role": "user", "content": PROMPTS[2]}]
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "celsius"}'}}

    def ask(**kwargs: Any) -> Callable[[], Any]:
        return lambda: client.chat.completions.create(model=model, **{"messages": messages, **kwargs})

    *texts, auto, none, bare, after = _at_once(
        *(ask(tools=TOOLS, max_tokens=60, **extra)
          for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 2}, {"temperature": 1.0, "seed": 3})),
        ask(tools=TOOLS, max_tokens=1, temperature=0),
        ask(tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0),
        ask(max_tokens=1, temperature=0),
        ask(tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0, messages=[
            *messages, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_abc", "content": '{"rain": true, "temperature": 18}'}]))
    for done in texts:
        choice = done.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for tool_call in choice.message.tool_calls:
                _valid(tool_call)
        else:
            assert "<tool_call>" not in (choice.message.content or "")
    assert auto.usage and none.usage and bare.usage
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens < auto.usage.prompt_tokens
    assert after.choices[0].message.content and after.choices[0].finish_reason in ("stop", "length")


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 8, **fields}


def _with_params(params: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": params}}]


CALLED = [{"role": "user", "content": "hi"},
          {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": "{}"}}]}]


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/chat/completions", _chat(tools=_with_params({"type": "object", "properties": {"a": {"type": "strnig"}}})),
     "Invalid type: strnig"),
    ("/v1/chat/completions", _chat(tools=_with_params({"type": "object", "if": {}, "then": {}}),
                                   tool_choice="none"), "Unimplemented keys"),
    ("/v1/chat/completions", _chat(tools=_with_params({"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
                                   tool_choice="required"), "does not exist"),
    ("/v1/chat/completions", _chat(tools=TOOLS + TOOLS[:1]), "two tools are named 'get_weather'"),
    ("/v1/chat/completions", _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice names 'nope', which is not among the tools"),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice requires tools"),
    ("/v1/chat/completions", _chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "name"),
    ("/v1/chat/completions", _chat(tools=TOOLS, response_format={"type": "json_object"}),
     "response_format cannot be combined with tools"),
    ("/v1/chat/completions", {"messages": [*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
     "answers tool_call_id 'call_2', which no earlier assistant message called"),
    ("/v1/chat/completions", {"messages": [*CALLED, {"role": "tool", "content": "x"}]}, "tool_call_id"),
    ("/v1/completions", {"prompt": "hi", "tools": TOOLS}, "'tools' is not supported"),
])
def test_bad_tool_input_is_a_400_and_reaches_no_engine(server: LiveServer, path: str, body: dict[str, Any],
                                                       message: str) -> None:
    before = finished_requests(server)
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()
    assert finished_requests(server) == before


def _events(server: LiveServer, sid: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/messages", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, events


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_tool_result_round_trips_through_a_session(server: LiveServer, redis_proc: Any,  # noqa: F811
                                                    tokenizer: Any) -> None:
    """A session reply under ``required`` is stored with its calls; the tool's result posted back is stored
    as a turn and, with the call, replayed into the next prompt; a result for no call stores nothing."""
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    status, events = _events(server, sid, {"content": PROMPTS[0], "tools": TOOLS, "tool_choice": "required",
                                           "parallel_tool_calls": False, "max_tokens": 150, "temperature": 0})
    assert status == 200
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls", done
    call = done["message"]["tool_calls"][0]
    Weather.model_validate_json(call["function"]["arguments"])
    assert done["message"]["content"] == ""
    status, bad = _events(server, sid, {"role": "tool", "tool_call_id": "call_nope", "content": "x"})
    assert status == 400 and "matches no tool call of this session" in bad[0]["error"]["message"]
    status, bad = _events(server, sid, {"content": "x", "tool_choice": "required"})
    assert status == 400 and "tool_choice requires tools" in bad[0]["error"]["message"]
    assert len(httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"]) == 2
    result = '{"temperature": 21, "sky": "clear"}'
    status, events = _events(server, sid, {"role": "tool", "tool_call_id": call["id"], "content": result,
                                           "tools": TOOLS, "tool_choice": "none", "max_tokens": 40,
                                           "temperature": 0})
    assert status == 200 and events[-1]["type"] == "done", events[-1]
    stored = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"] == [call] and stored[1]["finish_reason"] == "tool_calls"
    assert stored[2]["tool_call_id"] == call["id"] and stored[2]["content"] == result
    assert "tool_calls" not in stored[3] and stored[3]["content"]
    # The third turn's prompt is the history with the call and the result in it, exactly.
    import redis as sync_redis

    from chatsvc.store.keys import prompt_key, session_key

    r = sync_redis.Redis.from_url(redis_proc.url)
    system = r.get(prompt_key(r.hget(session_key(sid), "prompt_sha").decode()))  # type: ignore[union-attr]
    assert isinstance(system, bytes)
    prompt = chat_prompt_ids(tokenizer, [
        {"role": "system", "content": system.decode()}, {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result}])
    assert stored[3]["prompt_tokens"] == len(prompt)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_ws_message_frame_takes_tools(server: LiveServer) -> None:
    """A WebSocket ``message`` frame with tools gets calls in its done frame; a tool result frame is a turn."""
    from websockets.sync.client import connect

    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello"}))
        session = json.loads(ws.recv())
        ws.send(json.dumps({"type": "message", "content": PROMPTS[3], "tools": TOOLS,
                            "tool_choice": {"type": "function", "function": {"name": "search_web"}},
                            "max_tokens": 150, "temperature": 0}))
        while (frame := json.loads(ws.recv()))["type"] == "delta":
            pass
        assert frame["type"] == "done", frame
        call = frame["message"]["tool_calls"][0]
        assert call["function"]["name"] == "search_web"
        Search.model_validate_json(call["function"]["arguments"])
        ws.send(json.dumps({"type": "message", "role": "tool", "tool_call_id": call["id"],
                            "content": "1. Perseverance finds ancient lake bed", "max_tokens": 30}))
        while (frame := json.loads(ws.recv()))["type"] == "delta":
            pass
        assert frame["type"] == "done", frame
    stored = httpx.get(f"{server.url}/v1/sessions/{session['id']}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
