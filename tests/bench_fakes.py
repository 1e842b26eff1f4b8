"""A fake chat server speaking the three protocols ``chatsvc bench`` drives (OpenAI SSE, session SSE,
WebSocket), run by uvicorn in a thread on a free loopback port. It replies with ``max_tokens`` words
("w0 w1 ...") a few milliseconds apart and remembers what it was sent, so tests can check the
client's counts and bodies without the real gateway or a model.

A user message containing "FAIL" gets an HTTP 500 (or an error frame on the WebSocket).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect


@dataclass
class FakeState:
    gap_s: float = 0.002
    usage: bool = True  # report usage (else the client must count tokens itself)
    api_key: str | None = None
    chat_bodies: list[dict[str, Any]] = field(default_factory=list)
    session_messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    personas: dict[str, str] = field(default_factory=dict)
    ws_hellos: list[dict[str, Any]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    ids: Iterator[int] = field(default_factory=itertools.count)


def _words(n: int) -> list[str]:
    return [f"w{i} " for i in range(n)]


def build_app(state: FakeState) -> Starlette:
    def authorized(headers: Any) -> bool:
        return state.api_key is None or headers.get("authorization") == f"Bearer {state.api_key}"

    def unauthorized() -> JSONResponse:
        return JSONResponse({"error": {"message": "bad key", "type": "auth", "code": "unauthorized"}}, 401)

    async def models(request: Request) -> Response:
        if not authorized(request.headers):
            return unauthorized()
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(request: Request) -> Response:
        if not authorized(request.headers):
            return unauthorized()
        body = await request.json()
        state.chat_bodies.append(body)
        if "FAIL" in body["messages"][-1]["content"]:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "code": 500}}, 500)
        n = body["max_tokens"]
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])

        async def gen() -> AsyncIterator[str]:
            for i, w in enumerate(_words(n)):
                await asyncio.sleep(state.gap_s)
                fin = "length" if i == n - 1 else None
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w},
                                                          "finish_reason": fin}]}) + "\n\n"
            if state.usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def create_session(request: Request) -> Response:
        if not authorized(request.headers):
            return unauthorized()
        body = await request.json()
        sid = f"s{next(state.ids)}"
        state.session_messages[sid] = []
        return JSONResponse({"id": sid, "persona": body.get("persona")}, 201)

    async def session_message(request: Request) -> Response:
        sid = request.path_params["sid"]
        body = await request.json()
        state.session_messages[sid].append(body)
        if "FAIL" in body["content"]:
            return JSONResponse({"error": {"message": "boom", "code": "internal"}}, 500)
        n = body["max_tokens"]

        async def gen() -> AsyncIterator[str]:
            for i, w in enumerate(_words(n)):
                await asyncio.sleep(state.gap_s)
                yield f"id: {i}\nevent: delta\ndata: " + json.dumps({"type": "delta", "text": w}) + "\n\n"
            done: dict[str, Any] = {"type": "done", "finish_reason": "length"}
            if state.usage:
                done["usage"] = {"prompt_tokens": 5, "completion_tokens": n}
            yield f"id: {n}\nevent: done\ndata: " + json.dumps(done) + "\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def delete_session(request: Request) -> Response:
        state.deleted.append(request.path_params["sid"])
        return Response(status_code=204)

    async def put_persona(request: Request) -> Response:
        state.personas[request.path_params["name"]] = (await request.json())["system_prompt"]
        return JSONResponse({"name": request.path_params["name"]})

    async def ws_endpoint(ws: WebSocket) -> None:
        await ws.accept()
        try:
            hello = json.loads(await ws.receive_text())
            state.ws_hellos.append(hello)
            if state.api_key is not None and hello.get("api_key") != state.api_key:
                await ws.send_text(json.dumps({"type": "error", "code": "unauthorized", "message": "bad key"}))
                await ws.close()
                return
            sid = f"s{next(state.ids)}"
            state.session_messages[sid] = []
            await ws.send_text(json.dumps({"type": "session", "id": sid, "persona": hello.get("persona")}))
            while True:
                msg = json.loads(await ws.receive_text())
                state.session_messages[sid].append(msg)
                if "FAIL" in msg["content"]:
                    await ws.send_text(json.dumps({"type": "error", "code": "internal", "message": "boom"}))
                    continue
                n = msg["max_tokens"]
                for w in _words(n):
                    await asyncio.sleep(state.gap_s)
                    await ws.send_text(json.dumps({"type": "delta", "text": w}))
                done: dict[str, Any] = {"type": "done", "finish_reason": "length"}
                if state.usage:
                    done["usage"] = {"prompt_tokens": 5, "completion_tokens": n}
                await ws.send_text(json.dumps(done))
        except WebSocketDisconnect:
            return

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/sessions", create_session, methods=["POST"]),
        Route("/v1/sessions/{sid}/messages", session_message, methods=["POST"]),
        Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
        Route("/v1/personas/{name}", put_persona, methods=["PUT"]),
        WebSocketRoute("/v1/ws", ws_endpoint),
    ])


@contextmanager
def fake_server(state: FakeState | None = None) -> Iterator[tuple[str, FakeState]]:
    """Yields (base URL, state) while the server runs; stops it on exit."""
    state = state or FakeState()
    # IPPROTO_TCP explicitly: asyncio turns on TCP_NODELAY only for sockets whose proto says TCP, and
    # without it Nagle + delayed ACKs bunch the streamed deltas ~40 ms apart.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", ws="websockets-sansio",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
