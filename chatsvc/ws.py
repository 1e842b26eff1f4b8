"""WebSocket /v1/ws: JSON frames for a chat session (hello, message, cancel, resume)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatsvc import session_ops as ops
from chatsvc.auth import bearer, host_allowed, origin_allowed, ws_key_from_protocols
from chatsvc.context import Gateway, decode_json, gateway, parse
from chatsvc.errors import APIError
from chatsvc.quotas import FrameBudget, Lease
from chatsvc.schemas import SessionCreate, SessionMessage
from chatsvc.store import SessionMeta
from chatsvc.wire import delta_frame
from engine.protocol import EngineDeadError

log = logging.getLogger("chatsvc.ws")
# Close codes that mean the client meant to leave: its generation is aborted at once. 1001 ("going
# away") is not one: a browser sends it on reload or navigation, and the page resumes the reply.
CLEAN_CLOSE = (1000,)


class Connection:
    def __init__(self, ws: WebSocket, gw: Gateway, owner: str | None) -> None:
        self.ws = ws
        self.gw = gw
        self.owner = owner
        self.meta: SessionMeta | None = None
        self.send_lock = asyncio.Lock()
        self.pump: asyncio.Task[None] | None = None
        self.reader: ops.ReplyReader | None = None
        self.socket_lease: Lease = Lease()  # this socket's place in its owner's socket quota

    async def send(self, frame: dict[str, Any]) -> None:
        await self.send_text(json.dumps(frame))

    async def send_text(self, text: str) -> None:
        """Send one frame; one that does not go out within ``ws_send_timeout_s`` (a client that stopped
        reading, its TCP window full) raises TimeoutError: the pump stops and the reply loses this reader
        (grace/abort rules) instead of being held in memory for it."""
        async with self.send_lock, asyncio.timeout(self.gw.settings.ws_send_timeout_s):
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
            req = parse(SessionMessage, {k: v for k, v in frame.items() if k != "type"})
            self.meta = await ops.load_session(self.gw, self.meta.id, self.owner)
            self._follow(await ops.send_message(self.gw, self.meta, req))
        elif kind == "cancel":
            await self.gw.turns.cancel(self.meta.id)
        elif kind == "resume":
            after = frame.get("after")
            if after is not None and not isinstance(after, str):
                raise APIError(400, "after must be an event id string", code="invalid_value", param="after")
            self.meta = await ops.load_session(self.gw, self.meta.id, self.owner)
            if self._following(self.meta):
                return  # already following this reply: a second reader would repeat what was sent
            self._follow(await ops.resume(self.gw, self.meta, after))

    async def hello(self, frame: dict[str, Any]) -> None:
        if self.owner is None:
            key = frame.get("api_key")
            owner = self.gw.auth.check_key(key if isinstance(key, str) else None)
            await self.claim_socket(owner)
            self.owner = owner
        sid, persona = frame.get("session_id"), frame.get("persona")
        if sid is not None and not isinstance(sid, str) or persona is not None and not isinstance(persona, str):
            raise APIError(400, "session_id and persona must be strings", code="invalid_value")
        # A new session takes its settings from the hello (``response_format``), as POST /v1/sessions does.
        settings = None if sid else parse(SessionCreate, {k: frame[k] for k in ("response_format",) if k in frame})
        limit = ops.page_limit(self.gw, frame.get("limit"))  # a bad limit creates nothing
        meta = await (ops.load_session(self.gw, sid, self.owner) if sid
                      else ops.create_session(self.gw, self.owner, persona, settings=settings))
        if sid:
            ops.warm_session(self.gw, meta)
        self._stop_pump(abort_now=False)
        self.meta = meta
        await self.send({"type": "session", **await ops.session_view(self.gw, meta, limit)})

    def _following(self, meta: SessionMeta) -> bool:
        """This socket's pump is reading the session's latest reply right now."""
        r = self.reader
        return self.streaming and r is not None and r.session_id == meta.id and r.turn == meta.turns

    async def claim_socket(self, owner: str) -> None:
        """Count this socket against its owner's quota (429 past it)."""
        self.socket_lease = await self.gw.quotas.open_socket(owner)

    @property
    def streaming(self) -> bool:
        return self.pump is not None and not self.pump.done()

    def _follow(self, reader: ops.ReplyReader) -> None:
        self._stop_pump(abort_now=False)
        self.reader = reader
        self.pump = asyncio.create_task(self._pump(reader))

    async def _pump(self, reader: ops.ReplyReader) -> None:
        try:
            async for eid, ev, _ in reader.events():
                try:
                    await self._forward(eid, ev)
                except Exception as exc:  # the socket went away under us
                    # Left to the receive loop, which sees the close and releases with its code: a clean
                    # close aborts at once. Released here, a send that lost that race started a grace.
                    log.debug("pump ended: %r", exc)
                    return
        except asyncio.CancelledError:
            raise  # whoever cancelled released the reader first
        except Exception as exc:  # reading the reply failed: the socket stays, the grace applies
            log.debug("pump ended: %r", exc)
        reader.release()

    async def _forward(self, eid: str, ev: dict[str, Any]) -> None:
        if ev["type"] == "delta":
            await self.send_text(delta_frame(ev["text"], eid))
        elif ev["type"] == "done":
            await self.send({"type": "done", "finish_reason": ev["finish_reason"], "usage": ev["usage"],
                             "id": eid, "message": ev.get("message"),
                             **({"truncated_turns": ev["truncated_turns"]} if "truncated_turns" in ev else {})})
        else:
            await self.send({"type": "error", "code": ev.get("code", "error"),
                             "message": ev.get("message", ""), "id": eid})

    def _stop_pump(self, abort_now: bool) -> None:
        # Released before the pump is cancelled, so a clean close's abort is not pre-empted by the pump's
        # own (grace-period) release; a pump cancelled before it ever ran releases nothing itself.
        if self.reader is not None:
            self.reader.release(abort_now=abort_now)
            self.reader = None
        if self.pump is not None:
            self.pump.cancel()
            self.pump = None

    async def close(self, code: int) -> None:
        pump = self.pump
        self._stop_pump(abort_now=code in CLEAN_CLOSE)
        if pump is not None:
            with contextlib.suppress(BaseException):
                await pump


async def ws_endpoint(websocket: WebSocket) -> None:
    gw = gateway(websocket)
    host = websocket.headers.get("host")
    if not host_allowed(host, gw.settings.allowed_hosts) or not origin_allowed(
            websocket.headers.get("origin"), host, gw.settings.allowed_origins):
        await websocket.close(code=1008, reason="host or origin not allowed")  # before accept: HTTP 403
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
    conn = Connection(websocket, gw, None)
    if owner is not None:
        try:
            await conn.claim_socket(owner)
        except APIError as exc:
            await conn.error(exc.code or "quota_exceeded", exc.message)
            await websocket.close(code=1008, reason="too many open WebSockets")
            return
        except RedisError as exc:  # the socket quota cannot be counted: refused like any Redis outage
            await conn.error("redis_unavailable", f"session store unavailable: {type(exc).__name__}")
            await websocket.close(code=1011, reason="session store unavailable")
            return
        conn.owner = owner
    gw.metrics.open_ws.inc()
    code = 1006
    budget = FrameBudget(gw.settings.ws_frames_per_second)
    opened = asyncio.get_running_loop().time()
    try:
        while True:
            msg = await _receive(conn, opened)
            if msg is None:  # not authenticated in time, or idle with nothing streaming
                code = 1008 if conn.owner is None else 1000
                await websocket.close(code=code, reason="authentication timeout" if code == 1008 else "idle")
                break
            if msg["type"] == "websocket.disconnect":
                code = int(msg.get("code") or 1000)
                break
            if not budget.take():
                await conn.error("rate_limited", "too many frames; slow down")
                continue
            await _dispatch(conn, msg)
    except WebSocketDisconnect as exc:
        code = exc.code
    finally:
        gw.metrics.open_ws.dec()
        try:
            await conn.close(code)
        finally:
            await conn.socket_lease.release()


async def _receive(conn: Connection, opened: float) -> Mapping[str, Any] | None:
    """The next message, or None once the socket has had its time: an unauthenticated one
    ``ws_auth_timeout_s`` after it opened, an idle one (no frame, no reply streaming) ``ws_idle_timeout_s``."""
    settings = conn.gw.settings
    loop = asyncio.get_running_loop()
    while True:
        timeout = (opened + settings.ws_auth_timeout_s - loop.time() if conn.owner is None
                   else settings.ws_idle_timeout_s)
        try:
            return await asyncio.wait_for(conn.ws.receive(), max(timeout, 0.0))
        except TimeoutError:
            if conn.owner is None or not conn.streaming:
                return None


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
        frame = decode_json(text)
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            raise APIError(400, "a frame is a JSON object with a string 'type'", code="invalid_frame")
        await conn.handle(frame)
    except APIError as exc:
        await conn.error(exc.code or str(exc.status), exc.message)
    except RedisError as exc:
        await conn.error("redis_unavailable", f"session store unavailable: {type(exc).__name__}")
    except EngineDeadError:  # restarting: the socket stays open, the client may send the message again
        await conn.error("engine_unavailable", "the engine is not running; retry shortly")
    except Exception:  # a bug must cost the client one frame, not its socket
        log.exception("error handling a WebSocket frame")
        await conn.error("internal_error", "internal server error")


routes = [WebSocketRoute("/v1/ws", ws_endpoint)]
