"""chatsvc.context: the JSON body reader and parser every route uses, and the Gateway's model check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_engine import FakeEngine, tiny_tokenizer
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from chatsvc.app import create_app
from chatsvc.context import gateway, parse, read_json
from chatsvc.errors import APIError, api_error_handler
from chatsvc.settings import Settings
from chatsvc.store import Store

LIMIT = 64


class Body(BaseModel):
    name: str = Field(min_length=1)
    count: int = 1


async def echo(request: Request) -> JSONResponse:
    return JSONResponse(parse(Body, await read_json(request, LIMIT)).model_dump())


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])], exception_handlers={APIError: api_error_handler})
    with TestClient(app, headers={"content-type": "application/json"}) as c:
        yield c


def error(resp: object) -> tuple[int, str | None, str | None]:
    body = resp.json()["error"]  # type: ignore[attr-defined]
    return resp.status_code, body["code"], body["param"]  # type: ignore[attr-defined]


def test_a_valid_body_is_parsed(client: TestClient) -> None:
    r = client.post("/echo", json={"name": "x", "count": 3, "ignored": True})
    assert r.status_code == 200 and r.json() == {"name": "x", "count": 3}


def test_a_declared_oversized_body_is_refused_before_reading(client: TestClient) -> None:
    r = client.post("/echo", content=b"{}", headers={"content-length": str(LIMIT + 1)})
    assert error(r) == (413, "body_too_large", None)


def test_a_streamed_oversized_body_is_refused(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit is counted while reading
        yield b'{"name": "'
        yield b"x" * LIMIT
        yield b'"}'

    assert error(client.post("/echo", content=chunks()))[:2] == (413, "body_too_large")


@pytest.mark.parametrize("raw", [b"", b"   ", b"{not json", b"\xff\xfe"])
def test_empty_or_malformed_json_is_a_400(client: TestClient, raw: bytes) -> None:
    assert error(client.post("/echo", content=raw))[:2] == (400, "invalid_json")


@pytest.mark.parametrize("body", ["[1, 2]", '"text"', "3"])
def test_a_body_that_is_not_an_object_is_a_400(client: TestClient, body: str) -> None:
    assert error(client.post("/echo", content=body))[:2] == (400, "invalid_json")


def test_a_validation_error_names_the_field(client: TestClient) -> None:
    assert error(client.post("/echo", json={"name": ""})) == (400, "invalid_value", "name")
    assert error(client.post("/echo", json={"name": "x", "count": "many"})) == (400, "invalid_value", "count")


@pytest.fixture(scope="module")
def fake_app(tmp_path_factory: pytest.TempPathFactory) -> Starlette:
    engine = FakeEngine(tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    # The store is never reached here: Redis clients connect on first use.
    return create_app(engine, Store.from_url("redis://127.0.0.1:1/0"), Settings(web_dir=Path("/nonexistent")))


def test_gateway_is_the_apps_shared_state(fake_app: Starlette) -> None:
    class Conn:
        app = fake_app

    gw = gateway(Conn())  # type: ignore[arg-type]
    assert gw is fake_app.state.gateway and gw.engine.model_name == "fake-model"


def test_check_model_accepts_the_served_model_or_none(fake_app: Starlette) -> None:
    gw = fake_app.state.gateway
    assert gw.check_model(None) == "fake-model"
    assert gw.check_model("fake-model") == "fake-model"
    with pytest.raises(APIError) as err:
        gw.check_model("gpt-4")
    assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
