"""ASGI middleware for browser-borne attacks on every HTTP route: a Host allow-list (DNS rebinding) and an
Origin check on state-changing methods when a browser sends one (cross-site requests). On every route,
WebSocket included, an API key in the URL (``?api_key=``) is refused: a URL lands in access logs, proxies
and browser history."""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from chatsvc.auth import host_allowed, origin_allowed
from chatsvc.errors import APIError

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Probes and scrapers address the server by IP (a kubelet sends Host: <pod IP>); these routes reveal nothing
# a rebinding page could use, so they answer whatever the Host.
ANY_HOST = frozenset({"/health", "/ready", "/metrics"})


class RequestGuard:
    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and _key_in_url(scope):
            if scope["type"] == "websocket":  # refused in the handshake (HTTP 403), before anything runs
                await receive()
                await send({"type": "websocket.close", "code": 1008, "reason": "API keys are not accepted in URLs"})
                return
            await KEY_IN_URL.response()(scope, receive, send)
            return
        # WebSockets are checked in their endpoint, where a refusal is a handshake close.
        if scope["type"] == "http" and scope["path"] not in ANY_HOST:
            error = self.refusal(Headers(scope=scope), scope["method"])
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, method: str) -> APIError | None:
        host = headers.get("host")
        if not host_allowed(host, self.allowed_hosts):
            return APIError(400, "Host not allowed (see --allowed-hosts)", code="host_not_allowed")
        if method in STATE_CHANGING and not origin_allowed(headers.get("origin"), host, self.allowed_origins):
            return APIError(403, "Origin not allowed (see --allowed-origins)", code="origin_not_allowed")
        return None


KEY_IN_URL = APIError(400, "API keys are not accepted in URLs; send Authorization: Bearer <key>",
                      code="api_key_in_url", param="api_key")


def _key_in_url(scope: Scope) -> bool:
    query = scope.get("query_string", b"").decode("latin-1")
    return "api_key" in query and any(name == "api_key" for name, _ in parse_qsl(query, keep_blank_values=True))
