"""The OpenAI-compatible routes (chatsvc.openai_routes) served by uvicorn over the fake engine and a real Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import REPLY, FakeEngine, engine_fixture, fake_gateway  # noqa: F401
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok"), max_model_len=MAX_LEN, max_n=4,
                      retry_after_s=3) as live:
        yield live


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def sse_data(resp: httpx.Response) -> list[str]:
    return [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}], **extra}


def last_request(engine: FakeEngine) -> Any:
    return engine.submitted[list(engine.submitted)[-1]]


def test_models_lists_the_served_model(server: LiveServer) -> None:
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in data] == [("fake-model", MAX_LEN)]


def test_chat_completion_templates_the_messages_and_returns_the_reply(server: LiveServer, engine: FakeEngine) -> None:
    r = post(server, "/v1/chat/completions", chat(max_tokens=50))
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                                "finish_reason": "stop"}]
    # "developer" is the system role to the chat template.
    expected = engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Hi"}])
    assert last_request(engine).prompt_token_ids == expected
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["usage"]["completion_tokens"] == len(engine.reply_ids)


def test_max_completion_tokens_wins_over_max_tokens(server: LiveServer, engine: FakeEngine) -> None:
    body = post(server, "/v1/chat/completions", chat(max_tokens=50, max_completion_tokens=2)).json()
    assert last_request(engine).params.max_tokens == 2
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2


def test_without_max_tokens_the_completion_may_fill_the_context(server: LiveServer, engine: FakeEngine) -> None:
    post(server, "/v1/chat/completions", chat())
    sub = last_request(engine)
    assert sub.params.max_tokens == MAX_LEN - len(sub.prompt_token_ids)


def test_chat_stream_with_usage(server: LiveServer, engine: FakeEngine) -> None:
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=chat(stream=True, stream_options={"include_usage": True})) as r:
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(engine.reply_ids)
    assert len({c["id"] for c in chunks}) == 1


def test_n_samples_with_logprobs(server: LiveServer, engine: FakeEngine) -> None:
    body = post(server, "/v1/chat/completions", chat(n=2, max_tokens=3, logprobs=True, top_logprobs=2)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert [t["token"] for t in content] == [engine.tokenizer.decode([i], skip_special_tokens=False)
                                                 for i in engine.reply_ids[:3]]
        assert all(t["logprob"] == -0.5 and [x["logprob"] for x in t["top_logprobs"]] == [-0.5, -1.0]
                   for t in content)
    assert body["usage"]["completion_tokens"] == 6  # both samples


def test_chat_stream_with_logprobs_and_usage(server: LiveServer, engine: FakeEngine) -> None:
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=chat(stream=True, max_tokens=3, logprobs=True, top_logprobs=1,
                                stream_options={"include_usage": True})) as r:
        data = sse_data(r)
    chunks = [json.loads(d) for d in data[:-1]]
    assert [list(c) for c in chunks] == [["id", "object", "created", "model", "choices", "usage"]] * 4
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [c["delta"] for c in choices][0]["role"] == "assistant"
    assert [len(c["logprobs"]["content"][0]["top_logprobs"]) for c in choices] == [1, 1, 1]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 3


def test_completion_of_a_string_with_echo(server: LiveServer, engine: FakeEngine) -> None:
    body = post(server, "/v1/completions", {"prompt": "The capital", "echo": True, "max_tokens": 50}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "The capital" + REPLY
    assert last_request(engine).prompt_token_ids == engine.tokenizer.encode("The capital")


def test_completion_defaults_to_16_tokens(server: LiveServer, engine: FakeEngine) -> None:
    post(server, "/v1/completions", {"prompt": "x", "ignore_eos": True})
    assert last_request(engine).params.max_tokens == 16


def test_completion_of_token_ids_streams_logprob_offsets(server: LiveServer, engine: FakeEngine) -> None:
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": [5, 6], "max_tokens": 4, "logprobs": 1, "stream": True}) as r:
        data = sse_data(r)
    assert last_request(engine).prompt_token_ids == [5, 6]
    choices = [json.loads(d)["choices"][0] for d in data[:-1]]
    offsets = [c["logprobs"]["text_offset"][0] for c in choices]
    texts = [c["text"] for c in choices]
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [
    ("/v1/chat/completions", chat(model="other"), 404, "model_not_found", "model"),
    ("/v1/chat/completions", chat(n=5), 400, "invalid_value", "n"),
    ("/v1/chat/completions", chat(max_tokens=MAX_LEN), 400, "context_length_exceeded", "max_tokens"),
    ("/v1/chat/completions", chat(messages=[]), 400, "invalid_value", "messages"),
    ("/v1/completions", {"prompt": [5, 10**6]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": "x" * (MAX_LEN * 8)}, 400, "context_length_exceeded", "messages"),
])
def test_bad_requests(server: LiveServer, path: str, body: dict[str, Any], status: int, code: str,
                      param: str) -> None:
    r = post(server, path, body)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == (status, code, param)


def test_a_full_engine_is_a_429(server: LiveServer, engine: FakeEngine) -> None:
    engine.max_running = 0
    r = post(server, "/v1/chat/completions", chat())
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert r.headers["retry-after"] == "3"


def test_a_client_leaving_a_stream_aborts_its_request(server: LiveServer, engine: FakeEngine) -> None:
    engine.step_s = 0.05
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json=chat(stream=True, max_tokens=100, ignore_eos=True)) as r:
        next(r.iter_lines())
        rid = list(engine.submitted)[-1]
    deadline = time.monotonic() + 10
    while rid not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.aborted and rid not in engine.running
