"""The per-token wire formats, rendered without a dict, a JSON encoder or an SSE event object per token,
and the SSE response that sends them.

Every function here returns exactly what the generic path returns (``json.dumps`` of the same dict,
sse-starlette's ``ServerSentEvent(...).encode()``); tests/test_gateway_wire.py compares them.
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring_ascii
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.types import Message, Send

# What json.dumps writes for a str (ensure_ascii=True, the default).
json_str = encode_basestring_ascii

# sse-starlette's line separator and its rule for what breaks a line.
SSE_SEP = "\r\n"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def sse_event(data: str, event_id: str | None = None) -> bytes:
    """One SSE event, as ``ServerSentEvent(data, id=event_id).encode()`` renders it."""
    if _LINE_BREAK.search(data):
        lines = "".join(f"data: {chunk}{SSE_SEP}" for chunk in _LINE_BREAK.split(data))
    else:
        lines = "data: " + data + SSE_SEP
    if event_id is not None:
        lines = "id: " + _LINE_BREAK.sub("", event_id) + SSE_SEP + lines
    return (lines + SSE_SEP).encode()


def delta_event(text: str, tokens: int) -> str:
    """``json.dumps({"type": "delta", "text": text, "tokens": tokens})``: a session reply's delta event."""
    return '{"type": "delta", "text": ' + json_str(text) + ', "tokens": ' + str(tokens) + "}"


def delta_frame(text: str, event_id: str) -> str:
    """``json.dumps({"type": "delta", "text": text, "id": event_id})``: the WebSocket delta frame."""
    return '{"type": "delta", "text": ' + json_str(text) + ', "id": ' + json_str(event_id) + "}"


class ChunkTemplate:
    """An OpenAI streaming chunk with one choice, as ``json.dumps`` renders the dict the routes build:
    the parts fixed for a request (id, object, created, model, usage) are encoded once."""

    def __init__(self, request_id: str, obj: str, created: int, model: str, include_usage: bool) -> None:
        self.fields: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model}
        self.include_usage = include_usage
        self.head = (f'{{"id": {json_str(request_id)}, "object": {json_str(obj)}, "created": {created}, '
                     f'"model": {json_str(model)}, "choices": [{{"index": ')
        self.tail = '}], "usage": null}' if include_usage else "}]}"

    def encode(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        """A chunk built the generic way: one with logprobs, or the final usage chunk."""
        chunk = {**self.fields, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return json.dumps(chunk)

    @staticmethod
    def _reason(finish_reason: str | None) -> str:
        return "null" if finish_reason is None else json_str(finish_reason)

    def chat(self, index: int, content: str, first: bool, finish_reason: str | None) -> str:
        """``{"index", "delta": {["role": "assistant",] "content"}, "logprobs": null, "finish_reason"}``."""
        delta = ', "delta": {"role": "assistant", "content": ' if first else ', "delta": {"content": '
        return (self.head + str(index) + delta + json_str(content) + '}, "logprobs": null, "finish_reason": '
                + self._reason(finish_reason) + self.tail)

    def completion(self, index: int, text: str, finish_reason: str | None) -> str:
        """``{"index", "text", "logprobs": null, "finish_reason"}``."""
        return (self.head + str(index) + ', "text": ' + json_str(text) + ', "logprobs": null, "finish_reason": '
                + self._reason(finish_reason) + self.tail)


class EventStream(EventSourceResponse):
    """sse-starlette's response without a cancel scope per sent event when no send timeout is set:
    ``anyio.move_on_after(None)`` never fires, but entering and leaving it cost more per token than
    rendering the event. The gateway's routes do set one (``Settings.sse_send_timeout_s``, so a reader
    that stops reading is detached), and pay that scope per event."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)
