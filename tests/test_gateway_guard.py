"""chatsvc/guard.py: the Host allow-list and the Origin check, as ASGI middleware around a bare app."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from chatsvc.guard import RequestGuard


async def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def client() -> TestClient:
    app = Starlette(
        routes=[Route("/x", ok, methods=["GET", "POST"]), Route("/health", ok)],
        middleware=[Middleware(RequestGuard, allowed_hosts=("localhost", "127.0.0.1"), allowed_origins=())],
    )
    return TestClient(app, base_url="http://localhost")


def test_an_unlisted_host_is_refused_except_on_probes() -> None:
    c = client()
    assert c.get("/x").status_code == 200
    r = c.get("/x", headers={"Host": "evil.example"})  # a DNS-rebinding page names its own host
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    assert c.get("/health", headers={"Host": "10.0.0.7"}).status_code == 200


def test_state_changing_requests_from_another_origin_are_refused() -> None:
    c = client()
    assert c.post("/x").status_code == 200  # no Origin: not a browser's cross-site request
    assert c.post("/x", headers={"Origin": "http://localhost"}).status_code == 200  # the server's own
    r = c.post("/x", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert c.get("/x", headers={"Origin": "https://evil.example"}).status_code == 200  # reads change nothing


def test_a_key_in_the_url_is_refused_on_every_route() -> None:
    c = client()
    for path in ("/x?api_key=k", "/x?a=1&api_key=", "/health?api_key=k", "/nowhere?api_key=k"):
        r = c.get(path)
        assert r.status_code == 400 and r.json()["error"]["code"] == "api_key_in_url", path
    assert c.get("/x?not_api_key=1&q=api_key").status_code == 200  # only the parameter itself


def test_a_key_in_a_websocket_url_is_refused_in_the_handshake() -> None:
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        await ws.close()

    app = Starlette(routes=[WebSocketRoute("/ws", echo)],
                    middleware=[Middleware(RequestGuard, allowed_hosts=("*",), allowed_origins=())])
    with pytest.raises(WebSocketDisconnect) as exc, TestClient(app).websocket_connect("/ws?api_key=k"):
        pass
    assert exc.value.code == 1008
