"""chatsvc/guard.py: the Host allow-list and the Origin check, as ASGI middleware around a bare app."""

from __future__ import annotations

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
