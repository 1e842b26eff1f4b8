from __future__ import annotations

import pytest
from starlette.datastructures import Headers, QueryParams

from chatsvc.auth import ANON, Auth, origin_allowed, owner_id, ws_key_from_protocols
from chatsvc.errors import APIError
from chatsvc.settings import Settings

PATTERNS = Settings().allowed_origins


def test_no_keys_means_everyone_is_anonymous() -> None:
    assert Auth(()).from_http(Headers({})) == ANON


def test_keys_are_checked_and_owners_differ() -> None:
    auth = Auth(("k1", "k2"))
    assert auth.from_http(Headers({"authorization": "Bearer k1"})) == owner_id("k1")
    assert owner_id("k1") != owner_id("k2")
    assert auth.from_http(Headers({}), QueryParams("api_key=k2")) == owner_id("k2")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}):
        with pytest.raises(APIError) as e:
            auth.from_http(Headers(headers))
        assert e.value.status == 401


def test_ws_protocol_key() -> None:
    key, proto = ws_key_from_protocols(Headers({"sec-websocket-protocol": "chatsvc, chatsvc.key.abc"}))
    assert (key, proto) == ("abc", "chatsvc")
    assert ws_key_from_protocols(Headers({})) == (None, None)


@pytest.mark.parametrize(
    ("origin", "host", "ok"),
    [
        (None, "h:8000", True),
        ("http://localhost:5173", "h:8000", True),
        ("http://127.0.0.1:9", "h:8000", True),
        ("https://chat.example.com", "chat.example.com", True),
        ("https://evil.example", "chat.example.com", False),
        ("http://localhost.evil.example:80", "h:8000", False),
        ("null", "h:8000", False),
    ],
)
def test_origin(origin: str | None, host: str, ok: bool) -> None:
    assert origin_allowed(origin, host, PATTERNS) is ok
