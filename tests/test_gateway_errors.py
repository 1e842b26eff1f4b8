"""chatsvc/errors.py: every refusal has the OpenAI error shape and a matching status."""

from __future__ import annotations

import json

import pydantic
import pytest

from chatsvc.errors import APIError, from_validation_error


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (429, "rate_limit_error"),
                                              (503, "service_unavailable_error"), (500, "api_error")])
def test_api_error_body_and_response(status: int, kind: str) -> None:
    err = APIError(status, "nope", code="c", param="p", headers={"Retry-After": "2"})
    assert err.body() == {"error": {"message": "nope", "type": kind, "param": "p", "code": "c"}}
    resp = err.response()
    assert resp.status_code == status and resp.headers["retry-after"] == "2"
    assert json.loads(bytes(resp.body)) == err.body()


class Body(pydantic.BaseModel):
    temperature: float = pydantic.Field(ge=0)


def test_a_validation_error_names_the_field() -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        Body(temperature=-1)
    err = from_validation_error(exc.value)
    assert err.status == 400 and err.code == "invalid_value" and err.param == "temperature"
    assert err.message.startswith("temperature: ")
