"""Persona and session routes (Redis-backed), with session replies streamed as SSE events that carry ids."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc.context import Gateway, gateway, parse, read_json
from chatsvc.errors import APIError
from chatsvc.personas import DEFAULT_PERSONA
from chatsvc.schemas import PersonaBody, SessionCreate, SessionMessage
from chatsvc.store import SessionMeta
from chatsvc.turns import ActiveTurn, parse_event_id
from chatsvc.wire import EventStream, sse_event

PERSONA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _session_404(sid: str) -> APIError:
    return APIError(404, f"session {sid!r} not found", code="session_not_found", param="session_id")


async def load_session(gw: Gateway, sid: str, owner: str) -> SessionMeta:
    meta = await gw.store.get_session(sid, owner)
    if meta is None:
        raise _session_404(sid)
    return meta


async def session_view(gw: Gateway, meta: SessionMeta) -> dict[str, Any]:
    return {**meta.public(), "busy": meta.id in gw.turns.active, "messages": await gw.store.messages(meta.id)}


async def create_session(gw: Gateway, owner: str, persona: str | None, title: str | None = None) -> SessionMeta:
    name = persona or DEFAULT_PERSONA
    body = await gw.store.get_persona(name)
    if body is None:
        raise APIError(404, f"persona {name!r} not found", code="persona_not_found", param="persona")
    # The prompt is copied so later edits of the persona do not rewrite existing conversations.
    return await gw.store.create_session(owner, name, body["system_prompt"], title or "")


# -- personas --------------------------------------------------------------------------------------
async def list_personas(request: Request) -> JSONResponse:
    gw = gateway(request)
    gw.auth.from_http(request.headers, request.query_params)
    personas = await gw.store.list_personas()
    data = [{"name": n, **b, "pinned_tokens": gw.personas.pinned.get(n, 0)} for n, b in personas.items()]
    return JSONResponse({"object": "list", "data": data})


async def persona(request: Request) -> Response:
    gw = gateway(request)
    gw.auth.from_http(request.headers, request.query_params)
    name = request.path_params["name"]
    if not PERSONA_NAME.match(name):
        raise APIError(400, "persona names are 1-64 characters of letters, digits, '_', '-', '.'",
                       code="invalid_value", param="name")
    if request.method == "GET":
        body = await gw.store.get_persona(name)
        if body is None:
            raise APIError(404, f"persona {name!r} not found", code="persona_not_found")
        return JSONResponse({"name": name, **body, "pinned_tokens": gw.personas.pinned.get(name, 0)})
    if request.method == "DELETE":
        if not await gw.store.delete_persona(name):
            raise APIError(404, f"persona {name!r} not found", code="persona_not_found")
        await gw.personas.unpin(name)
        return JSONResponse({"name": name, "deleted": True})
    req = parse(PersonaBody, await read_json(request, gw.settings.max_body_bytes))
    created = await gw.store.put_persona(name, req.model_dump())
    pinned = await gw.personas.pin(name, req.system_prompt)
    return JSONResponse({"name": name, **req.model_dump(), "pinned_tokens": pinned}, status_code=201 if created else 200)


# -- sessions --------------------------------------------------------------------------------------
async def sessions(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    if request.method == "GET":
        metas = await gw.store.list_sessions(owner)
        return JSONResponse({"object": "list", "data": [m.public() for m in metas]})
    raw = await read_json(request, gw.settings.max_body_bytes) if await _has_body(request) else {}
    req = parse(SessionCreate, raw)
    meta = await create_session(gw, owner, req.persona, req.title)
    return JSONResponse(await session_view(gw, meta), status_code=201)


async def _has_body(request: Request) -> bool:
    return request.headers.get("content-length", "0") != "0" or "chunked" in request.headers.get(
        "transfer-encoding", "")


async def session(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    sid = request.path_params["sid"]
    meta = await load_session(gw, sid, owner)
    if request.method == "DELETE":
        await gw.turns.cancel(sid)
        await gw.store.delete_session(sid, owner)
        return JSONResponse({"id": sid, "deleted": True})
    return JSONResponse(await session_view(gw, meta))


async def post_message(request: Request) -> Response:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await load_session(gw, request.path_params["sid"], owner)
    if request.headers.get("last-event-id"):
        # An SSE client reconnecting to the POST resumes the reply; it does not send a new message.
        return await _resume(gw, meta, request.headers["last-event-id"])
    req = parse(SessionMessage, await read_json(request, gw.settings.max_body_bytes))
    at = await gw.turns.start(meta, req.content, req)
    return _sse_response(gw, at, at.turn, "0", meta.id)


async def stream_reply(request: Request) -> Response:
    """GET: (re)attach to the session's current or last reply; ``Last-Event-ID`` or ``?after=`` resumes."""
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await load_session(gw, request.path_params["sid"], owner)
    return await _resume(gw, meta, request.headers.get("last-event-id") or request.query_params.get("after"))


async def _resume(gw: Gateway, meta: SessionMeta, last_event_id: str | None) -> Response:
    turn, after = parse_event_id(last_event_id)
    turn = meta.turns if turn is None else turn
    at = gw.turns.attach(meta.id, turn)
    if at is None and not await gw.store.stream_exists(meta.id, turn):
        raise APIError(404, "no reply to resume (finished and expired, or never started)", code="stream_not_found")
    return _sse_response(gw, at, turn, after, meta.id)


def _sse_response(gw: Gateway, at: ActiveTurn | None, turn: int, after: str, session_id: str) -> Response:
    released = False

    def release() -> None:
        # Idempotent: runs from the generator's cleanup and again as the response's background task,
        # which also covers a client gone before the generator ever started.
        nonlocal released
        if not released and at is not None:
            released = True
            gw.turns.detach(at, abort_now=False)

    async def events() -> AsyncIterator[bytes]:
        gw.metrics.open_sse.inc()
        try:
            async for eid, _, data in gw.turns.follow_json(session_id, turn, after):
                yield sse_event(data, eid)  # the stored JSON, framed once: no re-encoding per token
        finally:
            gw.metrics.open_sse.dec()
            release()

    return EventStream(events(), ping=10, background=BackgroundTask(release))


async def cancel_reply(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await load_session(gw, request.path_params["sid"], owner)
    return JSONResponse({"id": meta.id, "cancelled": await gw.turns.cancel(meta.id)})


routes = [
    Route("/v1/personas", list_personas, methods=["GET"]),
    Route("/v1/personas/{name}", persona, methods=["GET", "PUT", "DELETE"]),
    Route("/v1/sessions", sessions, methods=["GET", "POST"]),
    Route("/v1/sessions/{sid}", session, methods=["GET", "DELETE"]),
    Route("/v1/sessions/{sid}/messages", post_message, methods=["POST"]),
    Route("/v1/sessions/{sid}/stream", stream_reply, methods=["GET"]),
    Route("/v1/sessions/{sid}/cancel", cancel_reply, methods=["POST"]),
]
