"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a matching status."""

from __future__ import annotations

from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-after"))
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", code="invalid_value",
                    param=param or None)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def not_found_handler(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 404)
    detail = getattr(exc, "detail", "not found")
    return APIError(status, str(detail), code="not_found" if status == 404 else None).response()
