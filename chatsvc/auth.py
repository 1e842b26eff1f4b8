"""API keys, session ownership and WebSocket Origin checks.

A session belongs to the key that created it; the owner id stored in Redis is a hash of the key so
the keys themselves never reach the store. Without configured keys every caller is "anon".
"""

from __future__ import annotations

import hashlib
import hmac
from fnmatch import fnmatch
from urllib.parse import urlsplit

from starlette.datastructures import Headers, QueryParams

from chatsvc.errors import APIError

ANON = "anon"
# Browsers cannot set headers on a WebSocket; they can offer subprotocols, so a key may ride in one.
WS_KEY_PROTOCOL_PREFIX = "chatsvc.key."
WS_PROTOCOL = "chatsvc"


def owner_id(key: str) -> str:
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:24]


class Auth:
    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self.api_keys = tuple(api_keys)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def check_key(self, key: str | None) -> str:
        """Return the owner id for ``key``, or raise 401."""
        if not self.enabled:
            return ANON
        if not key:
            raise APIError(401, "missing API key (Authorization: Bearer <key>)", code="missing_api_key")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.api_keys):
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return owner_id(key)

    def from_http(self, headers: Headers, query: QueryParams | None = None) -> str:
        # EventSource (browser SSE) cannot send headers either, hence the query parameter fallback.
        return self.check_key(bearer(headers) or (query.get("api_key") if query is not None else None))


def bearer(headers: Headers) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def ws_key_from_protocols(headers: Headers) -> tuple[str | None, str | None]:
    """(key, subprotocol to accept) from Sec-WebSocket-Protocol."""
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = next((p[len(WS_KEY_PROTOCOL_PREFIX):] for p in offered if p.startswith(WS_KEY_PROTOCOL_PREFIX)), None)
    if WS_PROTOCOL in offered:
        return key, WS_PROTOCOL
    # The handshake must echo one offered protocol or the browser fails it.
    return key, offered[0] if offered else None


def origin_allowed(origin: str | None, host: str | None, patterns: tuple[str, ...]) -> bool:
    """Non-browser clients send no Origin and are allowed; browsers must come from an allowed page."""
    if not origin:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    if host and parts.netloc.lower() == host.lower():
        return True
    return any(fnmatch(origin.lower(), p.lower()) for p in patterns)
