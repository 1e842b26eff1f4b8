"""Structured outputs through the gateway (chatsvc/structured.py, ``response_format`` on the OpenAI routes):
the real ``openai`` SDK's ``parse()`` against a live server running the default model in an engine process
(so each request's grammar crosses the process transport), streamed and not, over 50 real prompts at once
with three models, greedy and sampled; a reply cut short reported as ``length``; a session's own
``response_format``; and bad schemas refused with a 400 before anything reaches the engine or the store."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from fake_engine import fake_gateway
from gateway_fixtures import (  # noqa: F401
    LiveServer,
    RedisProc,
    default_model_path,
    finished_requests,
    redis_proc,
    sdk_server,
)
from pydantic import BaseModel, Field

from chatsvc.bench.dataset import default_dataset_path
from chatsvc.structured import Grammars

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


# Bounded strings and numbers: a 135M model may otherwise write digits or letters until max_tokens (an honest
# "length", but no object for parse()).
Short = Annotated[str, Field(max_length=40)]


class Capital(BaseModel):
    city: Short
    country: Short
    population: Annotated[int, Field(ge=0, le=10**9)]


class Review(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    stars: Annotated[int, Field(ge=1, le=5)]
    summary: Short


# ASCII words and punctuation, at most 40 characters: one token or fewer each, so a whole object of the
# models below fits in PARSE_MAX_TOKENS and every reply the grammar allows can end with "stop".
Phrase = Annotated[str, Field(pattern=r"^[A-Za-z0-9 ,.'!?-]{1,40}$")]


class TopicCard(BaseModel):
    topic: Phrase
    kind: Literal["question", "request", "instruction", "statement"]
    difficulty: Annotated[int, Field(ge=1, le=10)]


class Opinion(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    stars: Annotated[int, Field(ge=1, le=5)]
    summary: Phrase


class Day(BaseModel):
    year: Annotated[int, Field(ge=1900, le=2100)]
    month: Annotated[int, Field(ge=1, le=12)]


class Plan(BaseModel):
    title: Phrase
    start: Day
    tags: Annotated[list[Literal["work", "family", "travel", "health", "tech", "study", "other"]],
                    Field(min_length=1, max_length=3)]


PARSE_MAX_TOKENS = 160
ASKS: list[tuple[type[BaseModel], str]] = [
    (TopicCard, "Classify this message as JSON with its topic, its kind and its difficulty from 1 to 10:\n\n"),
    (Opinion, "Give your opinion of this message as a JSON review with a sentiment, stars and a summary:\n\n"),
    (Plan, "Turn this message into a JSON plan with a title, a start date and tags:\n\n"),
]


def _real_prompts(count: int) -> list[str]:
    """The first ``count`` short ASCII first-turn prompts of the ShareGPT sample the package bundles (the shared
    one, byte for byte: tests/test_bench_dataset.py), so the test runs in any clone: questions, code requests,
    chit-chat, pasted text."""
    texts = [item["conversations"][0]["value"] for item in json.loads(default_dataset_path().read_text())]
    return [t for t in texts if 40 <= len(t) <= 300 and t.isascii()][:count]


PROMPTS: list[tuple[type[BaseModel], str]] = [
    (Capital, "What is the capital of France? Answer in JSON with city, country and population."),
    (Capital, "Tell me about the capital of Japan, as JSON."),
    (Review, "Review this: 'The soup was cold and the waiter was rude.' Answer in JSON."),
]


@pytest.fixture(scope="module")
def server(sdk_server: LiveServer) -> LiveServer:  # noqa: F811
    return sdk_server


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


SAMPLINGS: list[dict[str, Any]] = [{"temperature": 0}, {"temperature": 0.8, "seed": 3}]


@pytest.fixture(scope="module")
def parsed(client: openai.OpenAI, model: str) -> list[list[Any]]:
    """Each of PROMPTS' ``parse()`` choices, greedy and sampled, all asked at once so that the engine batches
    them."""
    def ask(job: tuple[tuple[type[BaseModel], str], dict[str, Any]]) -> Any:
        (shape, prompt), sampling = job
        return client.chat.completions.parse(model=model, messages=[{"role": "user", "content": prompt}],
                                             response_format=shape, max_tokens=120, **sampling).choices[0]

    jobs = [(ask_for, sampling) for ask_for in PROMPTS for sampling in SAMPLINGS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(ask, jobs))
    return [choices[i : i + len(SAMPLINGS)] for i in range(0, len(choices), len(SAMPLINGS))]


@pytest.mark.parametrize(("index", "shape"), list(enumerate(shape for shape, _ in PROMPTS)),
                         ids=["capital-fr", "capital-jp", "review"])
def test_sdk_parse_returns_the_pydantic_object(parsed: list[list[Any]], index: int, shape: type[BaseModel]) -> None:
    """``parse()`` sends the model's strict JSON schema; the reply validates against it, greedy and sampled."""
    for choice in parsed[index]:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, shape), choice.message.content


def test_sdk_parse_validates_for_50_real_prompts_greedy_and_sampled(client: openai.OpenAI, model: str) -> None:
    """50 real prompts, each under one of three models (strings, enums, bounded integers, a nested object, a
    list), greedy and sampled, sent at once so the engine batches them: every reply ends with "stop" and
    ``parse()`` hands back its model's object."""
    prompts = _real_prompts(50)
    assert len(prompts) == 50
    jobs = [(ASKS[i % 3], text, sampling) for i, text in enumerate(prompts)
            for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 1000 + i})]

    def ask(job: tuple[tuple[type[BaseModel], str], str, dict[str, Any]]) -> tuple[type[BaseModel], Any]:
        (shape, ask_for), text, sampling = job
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": ask_for + text}],
                                             response_format=shape, max_tokens=PARSE_MAX_TOKENS, **sampling)
        return shape, done.choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(ask, jobs))
    assert len(replies) == 100
    for shape, choice in replies:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, shape), choice.message.content
        assert shape.model_validate_json(choice.message.content) == choice.message.parsed
    # Sampling went its own ways, under the same grammars.
    greedy = [c.message.content for _, c in replies[0::2]]
    sampled = [c.message.content for _, c in replies[1::2]]
    assert sum(g != s for g, s in zip(greedy, sampled, strict=True)) >= 10


def test_reply_cut_short_is_length_not_an_object(client: openai.OpenAI, model: str) -> None:
    """A reply that runs out of tokens mid-object ends with "length" (the JSON so far, unclosed); ``parse()``
    raises the SDK's ``LengthFinishReasonError`` rather than handing back an object."""
    messages: list[Any] = [{"role": "user", "content": ASKS[2][1] + "Visit grandma in Lisbon next spring."}]
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=model, messages=messages, response_format=Plan, max_tokens=6,
                                      temperature=0)
    schema: Any = {"type": "json_schema", "json_schema": {"name": "plan", "strict": True,
                                                         "schema": Plan.model_json_schema()}}
    cut = client.chat.completions.create(model=model, messages=messages, response_format=schema, max_tokens=6,
                                         temperature=0).choices[0]
    assert cut.finish_reason == "length" and cut.message.content.startswith('{"title": "'), cut
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.content)


def test_streamed_reply_is_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    """Streaming changes how the JSON arrives, not what it is; /v1/completions takes response_format too."""
    schema: Any = {"type": "json_schema", "json_schema": {"name": "capital", "strict": True,
                                                     "schema": Capital.model_json_schema()}}
    messages: list[Any] = [{"role": "user", "content": PROMPTS[0][1]}]
    whole = client.chat.completions.create(model=model, messages=messages, response_format=schema,
                                           max_tokens=120, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=messages, response_format=schema,
                                                 max_tokens=120, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    Capital.model_validate_json(text)
    done = client.completions.create(model=model, prompt="A JSON object describing a cat:", max_tokens=60,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].text), dict)
    else:  # "length" is honest: the object was still open
        assert done.choices[0].finish_reason == "length" and done.choices[0].text.startswith("{")


@pytest.mark.parametrize(("fmt", "message"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}},
     "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "response_format"),
])
def test_bad_response_format_is_a_400_and_reaches_no_engine(server: LiveServer, fmt: dict[str, Any],
                                                            message: str) -> None:
    before = finished_requests(server)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**body, "response_format": fmt, "max_tokens": 8}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_value" and message in err["message"], err
    assert finished_requests(server) == before
    assert server.gateway.engine.stats().requests_waiting == 0  # type: ignore[attr-defined]


def test_ws_message_frame_takes_response_format(server: LiveServer) -> None:
    """A WebSocket ``message`` frame with a schema gets a reply that validates and is stored as the turn's
    text; a bad schema is an error frame, and the session stores no message for it."""
    from websockets.sync.client import connect

    schema = {"type": "json_schema", "json_schema": {"name": "review", "schema": Review.model_json_schema()}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}}
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello"}))
        session = json.loads(ws.recv())
        ws.send(json.dumps({"type": "message", "content": "hi", "response_format": bad}))
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["code"] == "invalid_value", frame
        assert httpx.get(f"{server.url}/v1/sessions/{session['id']}").json()["messages"] == []
        ws.send(json.dumps({"type": "message", "content": PROMPTS[2][1], "response_format": schema,
                            "max_tokens": 120, "temperature": 0}))
        text = ""
        while (frame := json.loads(ws.recv()))["type"] == "delta":
            text += frame["text"]
        assert frame["type"] == "done" and frame["message"]["finish_reason"] == "stop", frame
    Review.model_validate_json(text)
    stored = httpx.get(f"{server.url}/v1/sessions/{session['id']}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["content"] == text


def test_ws_hello_creates_a_session_with_its_response_format(server: LiveServer) -> None:
    """A hello that opens a new session may carry the session's ``response_format`` (a bad one is an error
    frame and no session); its messages then follow it without sending it."""
    from websockets.sync.client import connect

    schema = {"type": "json_schema", "json_schema": {"name": "review", "schema": Review.model_json_schema()}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}}
    before = len(httpx.get(server.url + "/v1/sessions").json()["data"])
    with connect(server.ws_url + "/v1/ws") as ws:
        ws.send(json.dumps({"type": "hello", "response_format": bad}))
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["code"] == "invalid_value", frame
        assert len(httpx.get(server.url + "/v1/sessions").json()["data"]) == before
        ws.send(json.dumps({"type": "hello", "response_format": schema}))
        session = json.loads(ws.recv())
        assert session["type"] == "session" and session["response_format"]["json_schema"]["name"] == "review"
        ws.send(json.dumps({"type": "message", "content": PROMPTS[2][1], "max_tokens": 120, "temperature": 0}))
        text = ""
        while (frame := json.loads(ws.recv()))["type"] == "delta":
            text += frame["text"]
        assert frame["type"] == "done" and frame["message"]["finish_reason"] == "stop", frame
    Review.model_validate_json(text)


def _session_reply(server: LiveServer, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    """Posts a message and reads its reply (SSE) to the end; the stored assistant message."""
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"max_tokens": 120, "temperature": 0, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"][-1]


def test_session_response_format_applies_to_each_turn_and_a_message_overrides(server: LiveServer) -> None:
    """A session created with a schema holds every turn to it and shows it; PATCH changes it for the next
    turns; a message's own ``response_format`` wins for that turn; a bad schema is a 400 on create and on
    update, and changes nothing."""
    review = {"type": "json_schema", "json_schema": {"name": "review", "schema": Review.model_json_schema()}}
    capital = {"type": "json_schema", "json_schema": {"name": "capital", "schema": Capital.model_json_schema()}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}}
    sessions = server.url + "/v1/sessions"
    before = len(httpx.get(sessions).json()["data"])
    for fmt in (bad, {"type": "xml"}):
        r = httpx.post(sessions, json={"response_format": fmt})
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text
    assert len(httpx.get(sessions).json()["data"]) == before  # nothing stored

    created = httpx.post(sessions, json={"response_format": review})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    assert created.json()["response_format"]["json_schema"]["schema"] == Review.model_json_schema()
    for prompt in (PROMPTS[2][1], "Review this: 'Great battery, terrible screen.'"):
        reply = _session_reply(server, sid, {"content": prompt})
        assert reply["finish_reason"] == "stop", reply
        Review.model_validate_json(reply["content"])

    override = _session_reply(server, sid, {"content": PROMPTS[0][1], "response_format": capital})
    assert override["finish_reason"] == "stop", override
    Capital.model_validate_json(override["content"])

    r = httpx.patch(f"{sessions}/{sid}", json={"response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert httpx.get(f"{sessions}/{sid}").json()["response_format"]["json_schema"]["name"] == "review"
    r = httpx.patch(f"{sessions}/{sid}", json={"response_format": capital, "title": "capitals"})
    assert r.status_code == 200 and r.json()["title"] == "capitals", r.text
    reply = _session_reply(server, sid, {"content": PROMPTS[1][1]})
    assert reply["finish_reason"] == "stop", reply
    Capital.model_validate_json(reply["content"])

    r = httpx.patch(f"{sessions}/{sid}", json={"response_format": None})
    assert r.status_code == 200 and r.json()["response_format"] is None, r.text
    assert httpx.patch(f"{sessions}/{sid}", json={"persona": "other"}).status_code == 400


def test_gateway_builds_its_grammar_compiler_before_it_serves(redis_proc: RedisProc,  # noqa: F811
                                                              tmp_path: Path) -> None:
    """The build holds the GIL for about a second on the real vocabulary: done at start, before any request,
    not by the first grammar request on a live event loop."""
    with fake_gateway(redis_proc.url, tmp_path) as live:
        grammars = live.server.config.app.state.gateway.grammars  # type: ignore[attr-defined]
        assert grammars.ready
        assert httpx.post(live.url + "/v1/chat/completions", timeout=30, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}}).status_code == 400


def test_a_tokenizer_without_a_compiler_refuses_only_grammar_requests(caplog: pytest.LogCaptureFixture) -> None:
    class SlowTokenizer:  # what llguidance refuses: not a fast tokenizer
        hf = object()
        eos_token_ids: tuple[int, ...] = ()

    grammars = Grammars()
    grammars.prepare(SlowTokenizer())
    assert not grammars.ready and "structured outputs are refused" in caplog.text
