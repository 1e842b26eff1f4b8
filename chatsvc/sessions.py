"""HTTP routes for personas and sessions; session replies stream as SSE events that carry ids.

The session logic itself is in :mod:`chatsvc.session_ops`, shared with the WebSocket transport."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc import session_ops as ops
from chatsvc.context import Gateway, gateway, parse, read_json
from chatsvc.errors import APIError
from chatsvc.schemas import PersonaBody, SessionCreate, SessionMessage
from chatsvc.wire import EventStream, sse_event

PERSONA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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
    meta = await ops.create_session(gw, owner, req.persona, req.title)
    return JSONResponse(await ops.session_view(gw, meta), status_code=201)


async def _has_body(request: Request) -> bool:
    return request.headers.get("content-length", "0") != "0" or "chunked" in request.headers.get(
        "transfer-encoding", "")


async def session(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    sid = request.path_params["sid"]
    meta = await ops.load_session(gw, sid, owner)
    if request.method == "DELETE":
        await ops.cancel(gw, meta)
        await gw.store.delete_session(sid, owner)
        return JSONResponse({"id": sid, "deleted": True})
    return JSONResponse(await ops.session_view(gw, meta))


async def post_message(request: Request) -> Response:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await ops.load_session(gw, request.path_params["sid"], owner)
    if request.headers.get("last-event-id"):
        # An SSE client reconnecting to the POST resumes the reply; it does not send a new message.
        return _sse_response(gw, await ops.resume(gw, meta, request.headers["last-event-id"]))
    req = parse(SessionMessage, await read_json(request, gw.settings.max_body_bytes))
    return _sse_response(gw, await ops.send_message(gw, meta, req))


async def stream_reply(request: Request) -> Response:
    """GET: (re)attach to the session's current or last reply; ``Last-Event-ID`` or ``?after=`` resumes."""
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await ops.load_session(gw, request.path_params["sid"], owner)
    last = request.headers.get("last-event-id") or request.query_params.get("after")
    return _sse_response(gw, await ops.resume(gw, meta, last))


def _sse_response(gw: Gateway, reader: ops.ReplyReader) -> Response:
    async def events() -> AsyncIterator[bytes]:
        gw.metrics.open_sse.inc()
        try:
            async for eid, _, data in reader.events():
                yield sse_event(data, eid)  # the stored JSON, framed once: no re-encoding per token
        finally:
            gw.metrics.open_sse.dec()
            reader.release()

    # The background release also covers a client gone before the generator ever started.
    return EventStream(events(), ping=10, background=BackgroundTask(reader.release))


async def cancel_reply(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await ops.load_session(gw, request.path_params["sid"], owner)
    return JSONResponse({"id": meta.id, "cancelled": await ops.cancel(gw, meta)})


routes = [
    Route("/v1/personas", list_personas, methods=["GET"]),
    Route("/v1/personas/{name}", persona, methods=["GET", "PUT", "DELETE"]),
    Route("/v1/sessions", sessions, methods=["GET", "POST"]),
    Route("/v1/sessions/{sid}", session, methods=["GET", "DELETE"]),
    Route("/v1/sessions/{sid}/messages", post_message, methods=["POST"]),
    Route("/v1/sessions/{sid}/stream", stream_reply, methods=["GET"]),
    Route("/v1/sessions/{sid}/cancel", cancel_reply, methods=["POST"]),
]
