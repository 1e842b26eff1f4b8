"""Protocol clients: frame parsing, and each mode against the fake server in tests/bench_fakes.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from bench_fakes import FakeState, fake_server

from chatsvc.bench.clients import (
    BenchError,
    Client,
    ClientConfig,
    base_url,
    classify_error,
    handle_event,
    iter_sse,
    ws_url,
)
from chatsvc.bench.metrics import RequestRecord


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeState]]:
    with fake_server(FakeState(api_key="k")) as s:
        yield s


def new_rec() -> RequestRecord:
    return RequestRecord(session=0, turn=0, start=time.perf_counter())


def test_urls() -> None:
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert ws_url("http://h:1") == "ws://h:1/v1/ws"
    assert ws_url("https://h/v1") == "wss://h/v1/ws"


def test_handle_event_openai_chunks() -> None:
    r = new_rec()
    assert not handle_event(r, {"choices": [{"delta": {"role": "assistant"}}]}, now=1.0)
    assert r.delta_times == []  # a role-only chunk is not content: TTFT waits for text
    handle_event(r, {"choices": [{"delta": {"content": "Hi"}}]}, now=2.0)
    handle_event(r, {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]}, now=3.0)
    handle_event(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                              "prompt_tokens_details": {"cached_tokens": 4}}}, now=4.0)
    assert (r.text, r.delta_times, r.finish_reason) == ("Hi there", [2.0, 3.0], "stop")
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens, r.token_source) == (2, 9, 4, "usage")


def test_handle_event_typed_frames_and_errors() -> None:
    r = new_rec()
    assert not handle_event(r, {"type": "delta", "text": "a"}, now=1.0)
    assert not handle_event(r, {"text": "b"}, event="delta", now=2.0)
    assert handle_event(r, {"type": "done", "finish_reason": "length", "usage": {"completion_tokens": 2}})
    assert (r.text, r.finish_reason, r.output_tokens) == ("ab", "length", 2)
    with pytest.raises(BenchError) as e:
        handle_event(r, {"type": "error", "code": "queue_full", "message": "busy"})
    assert e.value.kind == "server_queue_full"
    with pytest.raises(BenchError) as e:
        handle_event(r, {"error": {"message": "x", "type": "invalid_request_error"}})
    assert e.value.kind == "server_invalid_request_error"
    assert classify_error(TimeoutError()) == ("timeout", "")
    assert classify_error(ConnectionRefusedError("no"))[0] == "connect"
    assert classify_error(aiohttp.ServerDisconnectedError())[0] == "disconnected"
    assert classify_error(aiohttp.ClientPayloadError("cut"))[0] == "disconnected"


async def run_turns(cfg: ClientConfig, turns: list[str]) -> list[RequestRecord]:
    client = Client(cfg)
    await client.prepare()
    chat = await client.open_session()
    recs = []
    try:
        for t in turns:
            r = new_rec()
            try:
                await chat.send(t, r)
            except BenchError as exc:
                r.error = exc.kind
            recs.append(r)
    finally:
        await chat.close()
        await client.aclose()
    return recs


async def test_openai_mode_resends_history_with_system_prompt(server: tuple[str, FakeState]) -> None:
    url, state = server
    before = len(state.chat_bodies)
    cfg = ClientConfig(url=url + "/v1", mode="openai", api_key="k", max_tokens=4, system_prompt="be brief",
                       ignore_eos=True, seed=3)
    recs = await run_turns(cfg, ["one", "two"])
    assert [r.text for r in recs] == ["w0 w1 w2 w3 "] * 2
    assert all(r.ok and r.output_tokens == 4 and len(r.delta_times) == 4 for r in recs)
    b1, b2 = state.chat_bodies[before:]
    assert b1["model"] == "fake-model" and b1["stream"] and b1["stream_options"] == {"include_usage": True}
    assert (b1["max_tokens"], b1["ignore_eos"], b1["seed"], b1["temperature"]) == (4, True, 3, 0.0)
    assert [m["role"] for m in b2["messages"]] == ["system", "user", "assistant", "user"]
    assert b2["messages"][2]["content"] == recs[0].text and b2["messages"][3]["content"] == "two"


async def test_response_format_goes_with_every_message(server: tuple[str, FakeState]) -> None:
    url, state = server
    before = len(state.chat_bodies)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    recs = await run_turns(ClientConfig(url=url, mode="openai", api_key="k", max_tokens=2, response_format=fmt),
                           ["one", "two"])
    assert all(r.ok for r in recs)
    assert [b["response_format"] for b in state.chat_bodies[before:]] == [fmt, fmt]


async def test_openai_mode_http_errors_and_bad_key(server: tuple[str, FakeState]) -> None:
    url, _ = server
    recs = await run_turns(ClientConfig(url=url, mode="openai", api_key="k", max_tokens=2), ["FAIL"])
    assert recs[0].error == "http_500" and recs[0].end is None
    with pytest.raises(BenchError) as e:
        await run_turns(ClientConfig(url=url, mode="openai", api_key="wrong", max_tokens=2), ["x"])
    assert e.value.kind == "http_401"


async def test_sse_mode_creates_session_streams_and_deletes(server: tuple[str, FakeState]) -> None:
    url, state = server
    recs = await run_turns(ClientConfig(url=url, mode="sse", api_key="k", max_tokens=3, persona="p"),
                           ["hello", "again", "FAIL"])
    assert [r.ok for r in recs] == [True, True, False] and recs[2].error == "http_500"
    assert recs[0].text == "w0 w1 w2 " and recs[0].output_tokens == 3
    sid = state.deleted[-1]
    assert [m["content"] for m in state.session_messages[sid]] == ["hello", "again", "FAIL"]
    assert state.session_messages[sid][0]["max_tokens"] == 3


async def test_ws_mode_hello_messages_and_error_frames(server: tuple[str, FakeState]) -> None:
    url, state = server
    recs = await run_turns(ClientConfig(url=url, mode="ws", api_key="k", max_tokens=2, persona="pirate"),
                           ["hi", "FAIL", "more"])
    assert [r.error for r in recs] == [None, "server_internal", None]
    assert recs[2].text == "w0 w1 " and recs[2].output_tokens == 2
    assert state.ws_hellos[-1] == {"type": "hello", "persona": "pirate", "api_key": "k"}
    # The hello is sent with the first turn, so a refused key is that turn's error.
    bad = await run_turns(ClientConfig(url=url, mode="ws", api_key="bad"), ["x"])
    assert bad[0].error == "server_unauthorized"


async def test_without_usage_tokens_are_left_for_counting() -> None:
    with fake_server(FakeState(usage=False)) as (url, _):
        for mode in ("openai", "sse", "ws"):
            recs = await run_turns(ClientConfig(url=url, mode=mode, max_tokens=3), ["x"])
            assert recs[0].ok and recs[0].output_tokens is None and len(recs[0].delta_times) == 3


class _Chunks:
    """Stands in for an aiohttp response: ``content.iter_any()`` yields the given byte chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = self
        self._chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self._chunks:
            yield c


async def test_sse_events_split_anywhere_between_chunks() -> None:
    body = 'event: delta\r\ndata: {"text": "é"}\r\n\r\n: comment\r\ndata: a\r\ndata: b\r\n\r\ndata: [DONE]\n\n'.encode()
    whole = [ev async for ev in iter_sse(_Chunks([body]))]  # type: ignore[arg-type]
    assert whole == [("delta", '{"text": "é"}'), (None, "a\nb"), (None, "[DONE]")]
    for cut in range(1, len(body)):  # every split point, inside CRLF and inside the two-byte "é" too
        parts = [ev async for ev in iter_sse(_Chunks([body[:cut], body[cut:]]))]  # type: ignore[arg-type]
        assert parts == whole, cut
    one_by_one = [ev async for ev in iter_sse(_Chunks([bytes([b]) for b in body]))]  # type: ignore[arg-type]
    assert one_by_one == whole
    unterminated = [ev async for ev in iter_sse(_Chunks([b"data: x"]))]  # type: ignore[arg-type]
    assert unterminated == [(None, "x")]
