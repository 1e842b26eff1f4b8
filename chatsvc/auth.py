"""API keys, admin keys, owner ids, and the browser-facing checks (Origin, Host).

A session belongs to the key that created it. The owner id stored in Redis is an HMAC of the key under the
identity key (chatsvc.keyring: random, kept in Redis only wrapped under the server secret, the same across
secret rotations), so neither the keys nor an offline-guessable hash of them reach the store. Without
configured keys every caller is "anon".

A page need not keep the long-lived key: ``POST /v1/auth/token`` trades it for a short-lived access token
(``cst1.<owner>.<expiry>.<HMAC>``, signed with a key derived from the current server secret, so every
instance given that secret accepts it; a previous secret still accepted verifies too), usable wherever a
key is (Bearer header, WebSocket hello or subprotocol). It names only the owner id, expires, and stops
working when its key is removed from the configuration or its secret is no longer accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from fnmatch import fnmatch
from urllib.parse import urlsplit

from starlette.datastructures import Headers, QueryParams

from chatsvc.errors import APIError
from chatsvc.keyring import Keys

ANON = "anon"
# Browsers cannot set headers on a WebSocket; they can offer subprotocols, so a key may ride in one. The
# server only ever selects WS_PROTOCOL, so the key is never echoed back in the handshake response.
WS_KEY_PROTOCOL_PREFIX = "chatsvc.key."
WS_PROTOCOL = "chatsvc"
SECRET_RETRY_AFTER_S = 2
TOKEN_PREFIX = "cst1."
MAX_EXPIRY_DIGITS = 12  # a Unix time in seconds for the next thirty thousand years


def owner_id(key: str, identity: bytes) -> str:
    return "k" + hmac.new(identity, key.encode(), hashlib.sha256).hexdigest()[:32]


def _sign(token_key: bytes, owner: str, expires: str) -> str:
    return hmac.new(token_key, f"{TOKEN_PREFIX}{owner}.{expires}".encode(), hashlib.sha256).hexdigest()


class Auth:
    def __init__(self, api_keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> None:
        # An admin key is also an API key.
        self.api_keys = tuple(dict.fromkeys((*api_keys, *admin_keys)))
        self.admin_keys = tuple(admin_keys)
        self._owners: dict[str, str] | None = None  # key -> owner id, once the server secret is known
        self._admins: frozenset[str] = frozenset()
        self._token_keys: tuple[bytes, ...] = ()  # the first signs access tokens, every one verifies
        self._salt_key = b""  # keys the owners' prefix-cache salts; derived from the identity key

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def ready(self) -> bool:
        return not self.enabled or self._owners is not None

    def set_keys(self, keys: Keys) -> None:
        """Install the keys (again after the secrets were re-read: owner ids stay, token keys may change)."""
        owners = {k: owner_id(k, keys.identity) for k in self.api_keys}
        self._admins = frozenset(owners[k] for k in self.admin_keys)
        self._token_keys = keys.token_keys
        self._salt_key = keys.salt_key
        self._owners = owners

    def set_secret(self, secret: bytes) -> None:
        """Keys from one secret that is its own identity key: for a process without Redis (tests, tools)."""
        self.set_keys(Keys.derive(secret, (secret,)))

    def cache_salt(self, owner: str) -> str:
        """The prefix-cache salt of ``owner`` (chatsvc.cache_isolation): keyed by a key derived from the
        identity key, so nobody can compute another owner's salt from its owner id, and a secret rotation
        keeps every salt (and the blocks cached under it). Without keys (one owner) the keys may be unread,
        and an unkeyed salt is as good as any."""
        return hmac.new(self._salt_key, owner.encode(), hashlib.sha256).hexdigest()[:32]

    def is_admin(self, owner: str) -> bool:
        """Without keys the one anonymous owner runs the server, so it administers it too."""
        return owner == ANON if not self.enabled else owner in self._admins

    def _secret_known(self) -> dict[str, str]:
        if self._owners is None:
            raise APIError(503, "starting: the session store has not been reached yet", code="redis_unavailable",
                           headers={"Retry-After": str(SECRET_RETRY_AFTER_S)})
        return self._owners

    def check_key(self, key: str | None, tokens: bool = True) -> str:
        """Return the owner id for ``key`` (an API key, or an access token unless ``tokens`` is False), or
        raise 401 (503 until the server secret has been read)."""
        if not self.enabled:
            return ANON
        if not key:
            raise APIError(401, "missing API key (Authorization: Bearer <key>)", code="missing_api_key")
        if tokens and key.startswith(TOKEN_PREFIX):
            return self.check_token(key)
        match = next((k for k in self.api_keys if hmac.compare_digest(key.encode(), k.encode())), None)
        if match is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return self._secret_known()[match]

    def issue_token(self, owner: str, ttl_s: int, now: float | None = None) -> tuple[str, int]:
        """(an access token for ``owner`` valid for ``ttl_s`` seconds, its expiry as a Unix time)."""
        self._secret_known()
        expires = int(time.time() if now is None else now) + ttl_s
        return f"{TOKEN_PREFIX}{owner}.{expires}.{_sign(self._token_keys[0], owner, str(expires))}", expires

    def check_token(self, token: str, now: float | None = None) -> str:
        """The owner id an access token names, or 401 if it is malformed, forged, expired or of a key no
        longer configured."""
        owners = self._secret_known()
        owner, _, rest = token[len(TOKEN_PREFIX):].partition(".")
        expiry, _, signature = rest.partition(".")
        # The signature over the text as sent is checked before anything parses it: a crafted expiry (a
        # non-ASCII digit, thousands of digits) is just a bad signature, never a parse error. Any accepted
        # secret's key will do: tokens signed before a rotation stay valid until their secret is dropped.
        signed = any([hmac.compare_digest(signature.encode(), _sign(k, owner, expiry).encode())
                      for k in self._token_keys])
        if not signed or not (expiry.isascii() and expiry.isdigit() and len(expiry) <= MAX_EXPIRY_DIGITS):
            raise APIError(401, "invalid access token", code="invalid_api_key")
        if int(expiry) <= (time.time() if now is None else now):
            raise APIError(401, "access token expired; get a new one from POST /v1/auth/token",
                           code="token_expired")
        if owner not in owners.values():
            raise APIError(401, "access token of a key no longer accepted", code="invalid_api_key")
        return owner

    def from_http(self, headers: Headers, query: QueryParams | None = None) -> str:
        # A key in a URL lands in access logs, proxies and browser history: refused, not just ignored, so
        # a client still sending one learns why it is unauthenticated.
        if query is not None and "api_key" in query:
            raise APIError(400, "API keys are not accepted in URLs; send Authorization: Bearer <key>",
                           code="api_key_in_url", param="api_key")
        return self.check_key(bearer(headers))


def bearer(headers: Headers) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def ws_key_from_protocols(headers: Headers) -> tuple[str | None, str | None]:
    """(key, subprotocol to accept) from Sec-WebSocket-Protocol: only ``chatsvc`` is ever accepted."""
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = next((p[len(WS_KEY_PROTOCOL_PREFIX):] for p in offered if p.startswith(WS_KEY_PROTOCOL_PREFIX)), None)
    return key, WS_PROTOCOL if WS_PROTOCOL in offered else None


def origin_allowed(origin: str | None, host: str | None, patterns: tuple[str, ...]) -> bool:
    """Non-browser clients send no Origin and are allowed; browsers must come from the server's own origin
    (same host and port) or one matching ``patterns``."""
    if not origin:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    if host and parts.netloc.lower() == host.lower():
        return True
    return any(fnmatch(origin.lower(), p.lower()) for p in patterns)


def host_allowed(host: str | None, patterns: tuple[str, ...]) -> bool:
    """The Host header's name (port dropped) against fnmatch ``patterns``: a page on an attacker's domain
    that resolves to this server (DNS rebinding) sends its own name and is refused."""
    if "*" in patterns:
        return True
    if not host:
        return False
    name = host.lower()
    name = name[:name.find("]") + 1] if name.startswith("[") else name.rsplit(":", 1)[0]
    # Compared literally first: fnmatch would read "[::1]" as a character class.
    return any(name == p.lower() or fnmatch(name, p.lower()) for p in patterns)
