"""The three ways to talk to a chat server: our WebSocket, our session SSE API, and any OpenAI server.

A ``Client`` holds what a run shares (one HTTP connection pool); ``open_session`` gives a
``ChatSession`` that sends one user turn at a time and fills a ``RequestRecord`` as deltas arrive.
Server-side history (ws, sse) means a turn sends only the new message; in openai mode the session
keeps the history and resends it, as any OpenAI client must.

HTTP is aiohttp's (its parser is C), and the streams are read as raw chunks split into lines here: the
load generator shares the machine with the server it measures, and every streamed token costs it CPU.
A line-splitting iterator (httpx's ``aiter_lines``) costs a few times the client CPU per token that this
path does, and uvloop (which ``chatsvc bench`` runs on where it is installed) cuts the loop's share further.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import websockets

from chatsvc.bench.metrics import RequestRecord

MODES = ("ws", "sse", "openai")


class BenchError(Exception):
    """A failed request; ``kind`` is what the report groups errors by."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


def classify_error(exc: BaseException) -> tuple[str, str]:
    """(kind, detail) for the report's error counts."""
    if isinstance(exc, BenchError):
        return exc.kind, exc.detail
    if isinstance(exc, TimeoutError):
        return "timeout", str(exc)
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connect", str(exc)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientConnectionError
                  | ConnectionResetError):
        return "disconnected", str(exc)
    if isinstance(exc, websockets.InvalidStatus):
        return f"http_{exc.response.status_code}", str(exc)
    if isinstance(exc, websockets.ConnectionClosed):
        return "ws_closed", str(exc)
    if isinstance(exc, OSError):
        return "connect", str(exc)
    if isinstance(exc, json.JSONDecodeError | ValueError | KeyError | TypeError):
        return "protocol", f"{type(exc).__name__}: {exc}"
    return type(exc).__name__, str(exc)


@dataclass(frozen=True)
class ClientConfig:
    url: str
    mode: str = "openai"
    api_key: str | None = None
    model: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    persona: str | None = None
    system_prompt: str | None = None
    connect_timeout_s: float = 30.0
    # OpenAI's response_format, sent with every message (every mode takes it): structured-output load.
    response_format: dict[str, Any] | None = None


def base_url(url: str) -> str:
    """Accept ``http://host:port``, ``.../v1`` or ``.../v1/``; return the origin without ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def ws_url(url: str) -> str:
    return re.sub("^http", "ws", base_url(url)) + "/v1/ws"  # http: -> ws:, https: -> wss:


class ChatSession(Protocol):
    async def send(self, content: str, rec: RequestRecord) -> None: ...
    async def close(self) -> None: ...


def _apply_usage(rec: RequestRecord, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
        rec.token_source = "usage"
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cached_tokens")
    if isinstance(cached, int):
        rec.cached_tokens = cached


def handle_event(rec: RequestRecord, obj: Any, event: str | None = None, now: float | None = None) -> bool:
    """Fold one server message (an SSE ``data`` JSON or a WS frame) into ``rec``. Understands OpenAI chunks,
    ``{"type": "delta"|"done"|"error"}`` frames and the same with the type in the SSE ``event`` name.
    Returns True when the message ends the reply."""
    if not isinstance(obj, dict):
        raise BenchError("protocol", f"unexpected message {obj!r:.200}")
    now = time.perf_counter() if now is None else now
    kind = obj.get("type") or event
    err = obj.get("error")
    if kind == "error" or err:
        e = err if isinstance(err, dict) else obj
        code = e.get("code") or e.get("type") or "error"
        raise BenchError(f"server_{code}", str(e.get("message", ""))[:300])
    text = ""
    if isinstance(obj.get("choices"), list):
        for choice in obj["choices"]:
            delta = choice.get("delta") or {}
            piece = delta.get("content") if isinstance(delta, dict) else None
            if piece is None:
                piece = choice.get("text")  # /v1/completions chunks
            text += piece or ""
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
    elif kind in ("delta", "token", "message.delta"):
        piece = obj.get("text", obj.get("delta", obj.get("content")))
        text = piece if isinstance(piece, str) else ""
    done = kind in ("done", "end", "message.done", "finish")
    if done:
        rec.finish_reason = obj.get("finish_reason", rec.finish_reason)
    _apply_usage(rec, obj.get("usage"))
    if text:
        rec.delta_times.append(now)
        rec.text += text
    return done


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive, without their LF or CRLF; a line is decoded only once whole, so a
    character split between two chunks stays intact."""
    tail = b""
    async for chunk in response.content.iter_any():
        *whole, tail = (tail + chunk).split(b"\n") if tail else chunk.split(b"\n")
        for raw in whole:
            yield raw.removesuffix(b"\r").decode()
    if tail:
        yield tail.removesuffix(b"\r").decode()


async def iter_sse(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, str]]:
    """Yield (event name, data string) for each SSE event; comments and ids are skipped."""
    event: str | None = None
    data: list[str] = []
    async for line in _lines(response):
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
    if data:
        yield event, "\n".join(data)


async def _consume_sse(response: aiohttp.ClientResponse, rec: RequestRecord) -> None:
    if response.status != 200:
        body = (await response.read()).decode(errors="replace")[:300]
        raise BenchError(f"http_{response.status}", body)
    ended = False
    async for event, data in iter_sse(response):
        if data.strip() == "[DONE]":
            ended = True
            break
        if handle_event(rec, json.loads(data), event):
            ended = True
    if not ended and rec.finish_reason is None:
        raise BenchError("truncated", "stream ended without a final event")


class Client:
    """Shared state of one run against one server."""

    def __init__(self, cfg: ClientConfig, max_connections: int | None = None) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.cfg = cfg
        self.base = base_url(cfg.url)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # Made on the running loop (aiohttp binds a session to it); no overall timeout: the load's own
        # per-request timeout applies.
        self.http = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=max_connections or 0),
        )
        self.model = cfg.model

    def url(self, path: str) -> str:
        return self.base + path

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        """A plain request's body text; a status of 300 or more raises ``BenchError("http_<status>")``."""
        async with self.http.request(method, self.url(path), json=body) as r:
            text = await r.text()
        if r.status >= 300:
            raise BenchError(f"http_{r.status}", f"{method} {path}: {text[:200]}")
        return text

    async def prepare(self) -> None:
        """openai mode: the model name (first of /v1/models) unless given."""
        if self.cfg.mode == "openai" and not self.model:
            self.model = json.loads(await self.call("GET", "/v1/models"))["data"][0]["id"]

    def sampling(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.seed is not None:
            body["seed"] = self.cfg.seed
        if self.cfg.response_format is not None:
            body["response_format"] = self.cfg.response_format
        return body

    async def open_session(self) -> ChatSession:
        kinds: dict[str, Callable[[Client], ChatSession]]
        kinds = {"openai": OpenAISession, "sse": SseSession, "ws": WsSession}
        return kinds[self.cfg.mode](self)

    async def aclose(self) -> None:
        await self.http.close()


class OpenAISession:
    def __init__(self, client: Client) -> None:
        self.client = client
        sp = client.cfg.system_prompt
        self.messages: list[dict[str, str]] = [{"role": "system", "content": sp}] if sp else []

    async def send(self, content: str, rec: RequestRecord) -> None:
        self.messages.append({"role": "user", "content": content})
        body = {"model": self.client.model, "messages": self.messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.client.sampling()}
        async with self.client.http.post(self.client.url("/v1/chat/completions"), json=body) as response:
            await _consume_sse(response, rec)
        rec.end = time.perf_counter()
        self.messages.append({"role": "assistant", "content": rec.text})

    async def close(self) -> None:
        return None


class SseSession:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.id: str | None = None

    async def send(self, content: str, rec: RequestRecord) -> None:
        if self.id is None:
            # Session creation is part of the first turn's latency, as a person would experience it.
            persona = {"persona": self.client.cfg.persona} if self.client.cfg.persona else {}
            self.id = str(json.loads(await self.client.call("POST", "/v1/sessions", persona))["id"])
        body = {"content": content, "stream": True, **self.client.sampling()}
        async with self.client.http.post(
            self.client.url(f"/v1/sessions/{self.id}/messages"), json=body, headers={"Accept": "text/event-stream"}
        ) as response:
            await _consume_sse(response, rec)
        rec.end = time.perf_counter()

    async def close(self) -> None:
        if self.id is not None:
            # Best effort: keep the server's store from filling up with benchmark sessions.
            with contextlib.suppress(aiohttp.ClientError, OSError, BenchError):
                await self.client.call("DELETE", f"/v1/sessions/{self.id}")


class WsSession:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.ws: Any = None
        self.id: str | None = None

    async def _connect(self) -> None:
        cfg = self.client.cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self.ws = await websockets.connect(
            ws_url(cfg.url), additional_headers=headers, open_timeout=cfg.connect_timeout_s, max_size=None
        )
        hello = {"type": "hello", "persona": cfg.persona, "api_key": cfg.api_key}
        await self.ws.send(json.dumps({k: v for k, v in hello.items() if v}))
        while True:
            frame = json.loads(await self.ws.recv())
            if frame.get("type") == "error":
                raise BenchError(f"server_{frame.get('code', 'error')}", str(frame.get("message", ""))[:300])
            if frame.get("type") == "session":
                self.id = frame.get("id") or frame.get("session_id")
                return

    async def send(self, content: str, rec: RequestRecord) -> None:
        if self.ws is None:
            await self._connect()
        await self.ws.send(json.dumps({"type": "message", "content": content, **self.client.sampling()}))
        while True:
            frame = json.loads(await self.ws.recv())
            if frame.get("type") in ("session", "ack", "ping", "pong", "user", "message.start", "start"):
                continue
            if handle_event(rec, frame):
                break
        rec.end = time.perf_counter()

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(self.ws.close(), 5)
            if self.id:
                with contextlib.suppress(aiohttp.ClientError, OSError, BenchError):
                    await self.client.call("DELETE", f"/v1/sessions/{self.id}")
