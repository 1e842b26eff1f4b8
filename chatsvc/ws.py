"""WebSocket /v1/ws: JSON frames for a chat session (hello, message, cancel, resume)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import pydantic
from redis.exceptions import RedisError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatsvc.auth import bearer, origin_allowed, ws_key_from_protocols
from chatsvc.context import Gateway, gateway
from chatsvc.errors import APIError, from_validation_error
from chatsvc.schemas import SessionMessage
from chatsvc.sessions import create_session, session_view
from chatsvc.store import SessionMeta
from chatsvc.turns import ActiveTurn, parse_event_id
from chatsvc.wire import delta_frame

log = logging.getLogger("chatsvc.ws")
# Close codes that mean the client meant to leave: its generation is aborted at once.
CLEAN_CLOSE = (1000, 1001)


class Connection:
    def __init__(self, ws: WebSocket, gw: Gateway, owner: str | None) -> None:
        self.ws = ws
        self.gw = gw
        self.owner = owner
        self.meta: SessionMeta | None = None
        self.send_lock = asyncio.Lock()
        self.pump: asyncio.Task[None] | None = None
        self.attached: ActiveTurn | None = None
        self.closing = False

    async def send(self, frame: dict[str, Any]) -> None:
        await self.send_text(json.dumps(frame))

    async def send_text(self, text: str) -> None:
        async with self.send_lock:
            await self.ws.send_text(text)

    async def error(self, code: str, message: str) -> None:
        await self.send({"type": "error", "code": code, "message": message})

    async def handle(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind not in ("hello", "message", "cancel", "resume"):
            raise APIError(400, f"unknown frame type {kind!r}", code="invalid_frame", param="type")
        if kind == "hello":
            await self.hello(frame)
            return
        if self.owner is None:
            raise APIError(401, "send a hello frame with api_key first", code="missing_api_key")
        if self.meta is None:
            raise APIError(400, "send a hello frame first", code="no_session")
        if kind == "message":
            body = {k: v for k, v in frame.items() if k != "type"}
            try:
                req = SessionMessage.model_validate(body)
            except pydantic.ValidationError as exc:
                raise from_validation_error(exc) from exc
            self.meta = await self._reload()
            at = await self.gw.turns.start(self.meta, req.content, req)
            self._follow(at, at.turn, "0")
        elif kind == "cancel":
            await self.gw.turns.cancel(self.meta.id)
        elif kind == "resume":
            after = frame.get("after")
            if after is not None and not isinstance(after, str):
                raise APIError(400, "after must be an event id string", code="invalid_value", param="after")
            self.meta = await self._reload()
            turn, stream_after = parse_event_id(after)
            turn = self.meta.turns if turn is None else turn
            resumed = self.gw.turns.attach(self.meta.id, turn)
            if resumed is None and not await self.gw.store.stream_exists(self.meta.id, turn):
                raise APIError(404, "no reply to resume", code="stream_not_found")
            self._follow(resumed, turn, stream_after)

    async def hello(self, frame: dict[str, Any]) -> None:
        if self.owner is None:
            key = frame.get("api_key")
            self.owner = self.gw.auth.check_key(key if isinstance(key, str) else None)
        sid, persona = frame.get("session_id"), frame.get("persona")
        if sid is not None and not isinstance(sid, str) or persona is not None and not isinstance(persona, str):
            raise APIError(400, "session_id and persona must be strings", code="invalid_value")
        if sid:
            meta = await self.gw.store.get_session(sid, self.owner)
            if meta is None:
                raise APIError(404, f"session {sid!r} not found", code="session_not_found")
        else:
            meta = await create_session(self.gw, self.owner, persona)
        self._stop_pump(abort_now=False)
        self.meta = meta
        await self.send({"type": "session", **await session_view(self.gw, meta)})

    async def _reload(self) -> SessionMeta:
        assert self.meta is not None and self.owner is not None
        meta = await self.gw.store.get_session(self.meta.id, self.owner)
        if meta is None:
            raise APIError(404, "session not found (deleted or expired)", code="session_not_found")
        return meta

    def _follow(self, at: ActiveTurn | None, turn: int, after: str) -> None:
        old = self.attached
        self.attached = at
        if self.pump is not None:
            self.pump.cancel()
        if old is not None:
            self.gw.turns.detach(old, abort_now=False)
        assert self.meta is not None
        self.pump = asyncio.create_task(self._pump(self.meta.id, turn, after, at))

    async def _pump(self, sid: str, turn: int, after: str, at: ActiveTurn | None) -> None:
        try:
            async for eid, ev, _ in self.gw.turns.follow_json(sid, turn, after):
                if ev["type"] == "delta":
                    await self.send_text(delta_frame(ev["text"], eid))
                elif ev["type"] == "done":
                    await self.send({"type": "done", "finish_reason": ev["finish_reason"], "usage": ev["usage"],
                                     "id": eid, "message": ev.get("message")})
                else:
                    await self.send({"type": "error", "code": ev.get("code", "error"),
                                     "message": ev.get("message", ""), "id": eid})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the socket went away under us; the receive loop cleans up
            log.debug("pump ended: %r", exc)
        finally:
            if self.attached is at and at is not None and not self.closing:
                self.attached = None
                self.gw.turns.detach(at, abort_now=False)

    def _stop_pump(self, abort_now: bool) -> None:
        if self.pump is not None:
            self.pump.cancel()
            self.pump = None
        if self.attached is not None:
            at, self.attached = self.attached, None
            self.gw.turns.detach(at, abort_now=abort_now)

    async def close(self, code: int) -> None:
        self.closing = True
        pump = self.pump
        self._stop_pump(abort_now=code in CLEAN_CLOSE)
        if pump is not None:
            with contextlib.suppress(BaseException):
                await pump


async def ws_endpoint(websocket: WebSocket) -> None:
    gw = gateway(websocket)
    if not origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host"),
                          gw.settings.allowed_origins):
        await websocket.close(code=1008, reason="origin not allowed")  # before accept: HTTP 403
        return
    key, subprotocol = ws_key_from_protocols(websocket.headers)
    key = key or bearer(websocket.headers)
    owner: str | None = None
    if key is not None or not gw.auth.enabled:
        try:
            owner = gw.auth.check_key(key)
        except APIError:
            await websocket.close(code=1008, reason="invalid API key")
            return
    await websocket.accept(subprotocol=subprotocol)
    conn = Connection(websocket, gw, owner)
    gw.metrics.open_ws.inc()
    code = 1006
    try:
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                code = int(msg.get("code") or 1000)
                break
            await _dispatch(conn, msg)
    except WebSocketDisconnect as exc:
        code = exc.code
    finally:
        gw.metrics.open_ws.dec()
        await conn.close(code)


async def _dispatch(conn: Connection, msg: Mapping[str, Any]) -> None:
    limit = conn.gw.settings.max_ws_frame_bytes
    if msg.get("bytes") is not None:
        await conn.error("binary_frame", "binary frames are not supported; send JSON text frames")
        return
    text = msg.get("text") or ""
    if len(text) > limit or len(text.encode()) > limit:
        await conn.error("frame_too_large", f"frames are limited to {limit} bytes")
        return
    try:
        frame = json.loads(text)
    except json.JSONDecodeError as exc:
        await conn.error("invalid_json", f"malformed JSON: {exc}")
        return
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        await conn.error("invalid_frame", "a frame is a JSON object with a string 'type'")
        return
    try:
        await conn.handle(frame)
    except APIError as exc:
        await conn.error(exc.code or str(exc.status), exc.message)
    except RedisError as exc:
        await conn.error("redis_unavailable", f"session store unavailable: {type(exc).__name__}")


routes = [WebSocketRoute("/v1/ws", ws_endpoint)]
