"""``POST /v1/auth/token``: an API key traded for a short-lived access token, so a browser page can keep the
token (which expires) instead of the key (which does not). Only a key may ask; a token cannot renew itself."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatsvc.auth import bearer
from chatsvc.context import gateway, parse, read_json
from chatsvc.errors import APIError


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_s: int | None = Field(default=None, ge=10)


async def issue_token(request: Request) -> JSONResponse:
    gw = gateway(request)
    if not gw.auth.enabled:
        raise APIError(400, "this server has no API keys: there is nothing to trade for a token",
                       code="auth_not_enabled")
    owner = gw.auth.check_key(bearer(request.headers), tokens=False)
    # The body is optional: a bare POST asks for the longest lifetime allowed.
    req = parse(TokenRequest, await read_json(request, 4096, optional=True))
    longest = gw.settings.access_token_ttl_s
    ttl = longest if req.ttl_s is None else req.ttl_s
    if ttl > longest:
        raise APIError(400, f"ttl_s must be <= {longest}", code="invalid_value", param="ttl_s")
    token, expires = gw.auth.issue_token(owner, ttl)
    return JSONResponse({"token": token, "token_type": "bearer", "expires_at": expires, "expires_in": ttl},
                        headers={"Cache-Control": "no-store"})


routes = [Route("/v1/auth/token", issue_token, methods=["POST"])]
