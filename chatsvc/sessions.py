"""HTTP routes for sessions; session replies stream as SSE events that carry ids (personas are in
:mod:`chatsvc.persona_routes`).

The session logic itself is in :mod:`chatsvc.session_ops`, shared with the WebSocket transport."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc import session_ops as ops
from chatsvc.context import Gateway, gateway, parse, read_json
from chatsvc.schemas import SessionCreate, SessionMessage, SessionUpdate
from chatsvc.wire import EventStream, sse_event


# -- sessions --------------------------------------------------------------------------------------
async def sessions(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    if request.method == "GET":
        metas = await gw.store.list_sessions(owner)
        return JSONResponse({"object": "list", "data": [m.public() for m in metas]})
    req = parse(SessionCreate, await read_json(request, gw.settings.max_body_bytes, optional=True))
    meta = await ops.create_session(gw, owner, req.persona, req.title, req)
    return JSONResponse(await ops.session_view(gw, meta), status_code=201)


async def session(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    sid = request.path_params["sid"]
    meta = await ops.load_session(gw, sid, owner)
    if request.method == "DELETE":
        await gw.turns.cancel(meta.id)
        if await gw.store.delete_session(sid, owner):
            await gw.quotas.session_gone(owner, sid)
        return JSONResponse({"id": sid, "deleted": True})
    if request.method == "PATCH":
        meta = await ops.update_session(gw, meta, parse(SessionUpdate, await read_json(request,
                                                                                    gw.settings.max_body_bytes)))
    else:
        ops.warm_session(gw, meta)
        return JSONResponse(await ops.session_view(gw, meta, request.query_params.get("limit")))
    return JSONResponse(await ops.session_view(gw, meta))


async def post_message(request: Request) -> Response:
    """POST: send a message (its reply streams back); GET: a page of older messages (``?limit=&before=``)."""
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await ops.load_session(gw, request.path_params["sid"], owner)
    if request.method == "GET":
        q = request.query_params
        return JSONResponse(await ops.history_page(gw, meta, q.get("limit"), q.get("before")))
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
    # A reader that stops reading (full TCP window) is detached after the send timeout, like one that left.
    return EventStream(events(), ping=10, background=BackgroundTask(reader.release),
                       send_timeout=gw.settings.sse_send_timeout_s)


async def cancel_reply(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    meta = await ops.load_session(gw, request.path_params["sid"], owner)
    return JSONResponse({"id": meta.id, "cancelled": await gw.turns.cancel(meta.id)})


routes = [
    Route("/v1/sessions", sessions, methods=["GET", "POST"]),
    Route("/v1/sessions/{sid}", session, methods=["GET", "PATCH", "DELETE"]),
    Route("/v1/sessions/{sid}/messages", post_message, methods=["GET", "POST"]),
    Route("/v1/sessions/{sid}/stream", stream_reply, methods=["GET"]),
    Route("/v1/sessions/{sid}/cancel", cancel_reply, methods=["POST"]),
]
