"""The gateway's shared state (one per app) and request-parsing helpers used by every route module."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic
from starlette.requests import HTTPConnection, Request

from chatsvc.auth import Auth
from chatsvc.errors import APIError, from_validation_error
from chatsvc.metrics import Metrics
from chatsvc.personas import Personas
from chatsvc.settings import Settings
from chatsvc.store import Store
from engine.client import EngineClient

if TYPE_CHECKING:
    from chatsvc.turns import TurnRegistry

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass
class Gateway:
    engine: EngineClient
    store: Store
    settings: Settings
    auth: Auth
    metrics: Metrics
    personas: Personas
    turns: TurnRegistry
    engine_ready: bool = False

    def check_model(self, model: str | None) -> str:
        if model is None or model == self.engine.model_name:
            return self.engine.model_name
        raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def gateway(conn: HTTPConnection) -> Gateway:
    return conn.app.state.gateway  # type: ignore[no-any-return]


async def read_json(request: Request, max_bytes: int) -> Any:
    """The JSON body, read incrementally so an oversized body is refused without buffering it all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from exc


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from exc

