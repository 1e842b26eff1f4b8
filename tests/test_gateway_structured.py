"""Structured outputs through the gateway (chatsvc/structured.py, ``response_format`` on the OpenAI routes):
the real ``openai`` SDK's ``parse()`` against a live server running the default model in an engine process
(so each request's grammar crosses the process transport), streamed and not, and bad schemas refused with a
400 before anything reaches the engine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from gateway_fixtures import LiveServer, default_model_path, redis_proc  # noqa: F401
from pydantic import BaseModel, Field

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


PROMPTS: list[tuple[type[BaseModel], str]] = [
    (Capital, "What is the capital of France? Answer in JSON with city, country and population."),
    (Capital, "Tell me about the capital of Japan, as JSON."),
    (Review, "Review this: 'The soup was cold and the waiter was rude.' Answer in JSON."),
]


@pytest.fixture(scope="module")
def server(redis_proc) -> Iterator[LiveServer]:  # noqa: F811
    import redis as sync_redis

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store
    from engine.engine_process import ProcessEngine

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    eng = ProcessEngine.from_args(default_model_path(), dtype="float32", attention_backend="torch",
                                  num_kv_blocks=256, max_num_seqs=8)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), Settings(max_n=4))
    with LiveServer(app) as live:
        live.gateway = app.state.gateway  # type: ignore[attr-defined]
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _finished(server: LiveServer) -> float:
    """Requests the gateway has seen finish, whatever the reason."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^chatsvc_requests_finished_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


@pytest.mark.parametrize(("shape", "prompt"), PROMPTS, ids=["capital-fr", "capital-jp", "review"])
def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI, model: str, shape: type[BaseModel],
                                               prompt: str) -> None:
    """``parse()`` sends the model's strict JSON schema; the reply validates against it, greedy and sampled."""
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": prompt}],
                                             response_format=shape, max_tokens=120, **extra)  # type: ignore[arg-type]
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, shape), choice.message.content


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
    before = _finished(server)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**body, "response_format": fmt, "max_tokens": 8}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_value" and message in err["message"], err
    assert _finished(server) == before
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
