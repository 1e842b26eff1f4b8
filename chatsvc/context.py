"""The gateway's shared state (one per app) and request-parsing helpers used by every route module."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic
from starlette.requests import HTTPConnection, Request

from chatsvc.auth import Auth
from chatsvc.cache_isolation import CacheIsolation
from chatsvc.errors import APIError, from_validation_error
from chatsvc.metrics import Metrics
from chatsvc.offload import Offload
from chatsvc.personas import Personas
from chatsvc.quotas import Quotas
from chatsvc.rates import Rates
from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.structured import Grammars
from engine.client import EngineClient

if TYPE_CHECKING:
    from chatsvc.turns import TurnRegistry

M = TypeVar("M", bound=pydantic.BaseModel)
DRAIN_RETRY_AFTER_S = 1  # a draining gateway's 503: another instance (or this one's successor) serves it now


@dataclass
class Gateway:
    engine: EngineClient
    store: Store
    settings: Settings
    auth: Auth
    metrics: Metrics
    personas: Personas
    turns: TurnRegistry
    offload: Offload
    quotas: Quotas
    isolation: CacheIsolation
    rates: Rates
    engine_ready: bool = False
    # SIGTERM received (chatsvc.drain): in-flight turns finish, new ones are refused with 503.
    draining: bool = False
    grammars: Grammars = field(default_factory=Grammars)

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "this server is shutting down; retry on another instance", code="draining",
                           headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})

    @property
    def idle(self) -> bool:
        """No turn and no other engine request in flight here: a draining gateway may exit."""
        return not self.turns.active and self.metrics.generations_in_flight == 0

    def check_model(self, model: str | None) -> str:
        if model is None or model == self.engine.model_name:
            return self.engine.model_name
        raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def gateway(conn: HTTPConnection) -> Gateway:
    return conn.app.state.gateway  # type: ignore[no-any-return]


async def read_json(request: Request, max_bytes: int, optional: bool = False) -> Any:
    """The JSON body, read incrementally so an oversized body is refused without buffering it all;
    ``optional``: a request without a body reads as ``{}``."""
    headers = request.headers
    if optional and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
        return {}
    # A browser may send a cross-site "simple" POST (text/plain, form types) without a preflight; JSON
    # routes that insist on application/json cannot be reached that way.
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, "send the body as Content-Type: application/json", code="unsupported_media_type")
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    if not body.strip():
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return decode_json(bytes(body))


MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 20  # every integer field fits in 64 bits; longer ones are refused before int() runs
_SURROGATE = re.compile("[\ud800-\udfff]")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:32]}")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer too large ({len(text)} digits)")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes | str) -> Any:
    """Strict JSON for every request body and WebSocket frame: no NaN/Infinity or overflowing floats, no
    integer beyond 64 bits, no nesting deeper than MAX_JSON_DEPTH, no lone surrogate in any string (it
    would fail later, in Redis or the tokenizer, as a 500). Any of those is a 400."""
    try:
        data = json.loads(raw, parse_float=_finite, parse_int=_bounded_int, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(400, "JSON nested too deeply", code="invalid_json") from exc
    except ValueError as exc:
        raise APIError(400, f"invalid JSON value: {exc}", code="invalid_value") from exc
    _check_values(data)
    return data


def _check_values(data: Any) -> None:
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise APIError(400, "strings must be valid Unicode (lone surrogate escape)", code="invalid_value")
        elif isinstance(value, dict):
            stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from exc

