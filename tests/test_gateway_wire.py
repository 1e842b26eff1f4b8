"""The per-token renderings in chatsvc.wire are byte-for-byte what the generic encoders produce."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from sse_starlette import ServerSentEvent
from sse_starlette.sse import EventSourceResponse, ensure_bytes

from chatsvc.wire import ChunkTemplate, delta_event, delta_frame, sse_event

TEXTS = ["", " the", "Hello", 'quote " and \\ backslash', "new\nline", "cr\rlf\r\n", "tab\t", "\x00\x1f\x7f",
         "é ü ß", "日本語", "emoji 🦜", "\u2028\u2029", "\ud800 lone surrogate", "</script>", "{\"a\": 1}"]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pools = [range(0, 0x80), range(0x80, 0x800), range(0x800, 0xD800), range(0xE000, 0x10000),
             range(0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        out.append("".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(0, 12))))
    return out


ALL_TEXTS = TEXTS + random_texts(300)


def old_chat_chunk(rid: str, created: int, model: str, index: int, text: str, first: bool,
                   reason: str | None, include_usage: bool) -> str:
    """How the chat route built a chunk before the template (the dict and json.dumps)."""
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return json.dumps(chunk)


def old_completion_chunk(rid: str, created: int, model: str, index: int, text: str, reason: str | None,
                         include_usage: bool) -> str:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return json.dumps(chunk)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", 'odd "model" \\ é'])
def test_chat_and_completion_chunks_match_json_dumps(include_usage: bool, model: str) -> None:
    rid, created = "chatcmpl-0123456789abcdef01234567", 1764528000
    chat = ChunkTemplate(rid, "chat.completion.chunk", created, model, include_usage)
    cmpl = ChunkTemplate(rid, "text_completion", created, model, include_usage)
    for i, text in enumerate(ALL_TEXTS):
        for reason in (None, "stop", "length", "abort"):
            index, first = i % 3, i % 2 == 0
            assert chat.chat(index, text, first, reason) == old_chat_chunk(rid, created, model, index, text, first,
                                                                           reason, include_usage)
            assert cmpl.completion(index, text, reason) == old_completion_chunk(rid, created, model, index, text,
                                                                                reason, include_usage)


def outcome(fn: Callable[..., bytes], *args: str) -> bytes | type[BaseException]:
    try:
        return fn(*args)
    except UnicodeEncodeError as exc:
        return type(exc)


def test_sse_event_matches_sse_starlette() -> None:
    sep = EventSourceResponse.DEFAULT_SEPARATOR
    for text in ALL_TEXTS:
        data = json.dumps({"text": text})
        assert sse_event(data) == ensure_bytes({"data": data}, sep)
        assert sse_event(data, "3:1764528000000-7") == ensure_bytes({"id": "3:1764528000000-7", "data": data}, sep)
        # Raw (not JSON-escaped) text, ids with line breaks: the library's splitting and cleaning rules
        # (and the same error for what UTF-8 cannot encode).
        assert outcome(sse_event, text) == outcome(lambda t: ServerSentEvent(t).encode(), text)
        assert outcome(sse_event, text, f"1:{text}") == outcome(
            lambda t, i: ServerSentEvent(t, id=i).encode(), text, f"1:{text}")
    assert sse_event("[DONE]") == ensure_bytes({"data": "[DONE]"}, sep)


def test_session_delta_event_and_ws_frame_match_json_dumps() -> None:
    for i, text in enumerate(ALL_TEXTS):
        assert delta_event(text, i % 4) == json.dumps({"type": "delta", "text": text, "tokens": i % 4})
        eid = f"{i}:1764528000000-{i}"
        assert delta_frame(text, eid) == json.dumps({"type": "delta", "text": text, "id": eid})


async def test_event_stream_sends_the_same_bytes_as_event_source_response() -> None:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route

    from chatsvc.wire import EventStream

    # The override must replace a method the library has (a renamed one would silently do nothing).
    assert "_send_with_timeout" in vars(EventSourceResponse)
    texts = ALL_TEXTS[:40]

    async def rendered() -> Any:
        for i, text in enumerate(texts):
            yield sse_event(json.dumps({"text": text}), f"1:{i}-0")
        yield {"data": "[DONE]"}

    async def generic() -> Any:
        for i, text in enumerate(texts):
            yield {"id": f"1:{i}-0", "data": json.dumps({"text": text})}
        yield {"data": "[DONE]"}

    async def fast(request: Request) -> EventStream:
        return EventStream(rendered(), ping=10)

    async def reference(request: Request) -> EventSourceResponse:
        return EventSourceResponse(generic(), ping=10)

    app = Starlette(routes=[Route("/fast", fast), Route("/ref", reference)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        a, b = await client.get("/fast"), await client.get("/ref")
    assert a.status_code == b.status_code == 200 and a.headers == b.headers
    assert a.content == b.content and a.content.endswith(b"data: [DONE]\r\n\r\n")
