"""/v1/kv and /v1/kv/stream: the engine's block-pool picture (for the web UI's KV view), optionally
with one session's blocks picked out.

A tenant sees its own requests and pins by name and everyone else's only as opaque labels; the operators'
detail (the workers by name with their pin lists and routing, the kernel runtime) only the operators see:
an admin key, the metrics key, or the one owner of a server without keys."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc.auth import ANON, bearer
from chatsvc.context import Gateway, gateway
from chatsvc.personas import pin_key
from chatsvc.session_ops import load_session
from engine.protocol import KVSnapshot


def _visible(gw: Gateway, snap: KVSnapshot, owner: str) -> KVSnapshot:
    """The block picture as ``owner`` may see it: their own requests and pins by name, everyone else's
    blocks still drawn but under opaque labels (request ids and owners' persona names are private)."""
    own = {at.request_id for at in gw.turns.active.values() if at.owner == owner}
    requests = {rid if rid in own else f"other-{i}": blocks
                for i, (rid, blocks) in enumerate(snap.requests.items())}
    # A shared persona's pin key is "persona:<name>"; an owner's, "persona:<owner>:<name>".
    pins = {key if key.count(":") == 1 or key.startswith(pin_key("", owner)) else f"persona:other-{i}": blocks
            for i, (key, blocks) in enumerate(snap.pins.items())}
    return dataclasses.replace(snap, requests=requests, pins=pins)


OPERATOR_DETAIL = ("workers", "route_decisions", "runtime")


def _tenant_view(payload: dict[str, Any]) -> dict[str, Any]:
    """The picture without the operators' detail: worker names (hosts, pids) become their pool's place."""
    view = {k: v for k, v in payload.items() if k not in OPERATOR_DETAIL}
    view["pools"] = [{**pool, "worker": f"worker-{i}"} for i, pool in enumerate(payload.get("pools", []))]
    return view


async def _kv_payload(gw: Gateway, owner: str, session: dict[str, Any] | None,
                      operator: bool = False) -> dict[str, Any]:
    snap = gw.engine.kv_snapshot()
    stats = gw.engine.stats().to_json()
    payload = ({**snap.to_json(), **stats} if operator
               else _tenant_view({**_visible(gw, snap, owner).to_json(), **stats}))
    if session is not None:
        at = gw.turns.active.get(session["id"])
        rid = at.request_id if at else None
        payload["session"] = {
            **session,
            "request_id": rid,
            "blocks": list(snap.requests.get(rid, [])) if rid else [],
            "persona_blocks": list(snap.pins.get(gw.personas.session_pin_key(owner, session["persona"]), [])),
        }
    return payload


async def _session_for_kv(gw: Gateway, request: Request, owner: str) -> dict[str, Any] | None:
    sid = request.query_params.get("session_id")
    if not sid:
        return None
    try:
        meta = await load_session(gw, sid, owner)
    except RedisError:
        return None  # the KV picture does not need Redis: show it without the session
    return {"id": meta.id, "persona": meta.persona}


def _caller(gw: Gateway, request: Request) -> tuple[str, bool]:
    """(owner, whether an operator asks): the metrics key is an operator's, not a tenant's."""
    want, got = gw.settings.metrics_key, bearer(request.headers)
    if want is not None and got is not None and secrets.compare_digest(got.encode(), want.encode()):
        return ANON, True
    owner = gw.auth.from_http(request.headers, request.query_params)
    return owner, gw.auth.is_admin(owner)


async def kv(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner, operator = _caller(gw, request)
    return JSONResponse(await _kv_payload(gw, owner, await _session_for_kv(gw, request, owner), operator))


async def kv_stream(request: Request) -> Response:
    gw = gateway(request)
    owner, operator = _caller(gw, request)
    session = await _session_for_kv(gw, request, owner)
    # Each connection holds a send loop that renders the picture every interval: counted per key, and a
    # reader that stops reading is dropped after the send timeout.
    lease = await gw.quotas.open_kv_stream(owner)

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            while True:
                yield {"event": "kv", "data": json.dumps(await _kv_payload(gw, owner, session, operator))}
                await asyncio.sleep(gw.settings.kv_stream_interval_s)
        finally:
            await lease.release()

    # The background release also covers a client gone before the generator ever started.
    return EventSourceResponse(events(), ping=15, send_timeout=gw.settings.sse_send_timeout_s,
                               background=BackgroundTask(lease.release))


routes = [
    Route("/v1/kv", kv, methods=["GET"]),
    Route("/v1/kv/stream", kv_stream, methods=["GET"]),
]
