"""HTTP routes for personas: shared ones (written by admin keys) and each key's own."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc.context import gateway, parse, read_json
from chatsvc.errors import APIError
from chatsvc.personas import SHARED, pin_key
from chatsvc.schemas import PersonaBody

PERSONA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


async def list_personas(request: Request) -> JSONResponse:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    return JSONResponse({"object": "list", "data": await gw.personas.visible(owner)})


async def persona(request: Request) -> Response:
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    admin = gw.auth.is_admin(owner)
    name = request.path_params["name"]
    if not PERSONA_NAME.match(name):
        raise APIError(400, "persona names are 1-64 characters of letters, digits, '_', '-', '.'",
                       code="invalid_value", param="name")
    if request.method == "GET":
        found = await gw.personas.get(owner, name)
        if found is None:
            raise APIError(404, f"persona {name!r} not found", code="persona_not_found")
        scope, body = found
        key = pin_key(name) if scope == SHARED else pin_key(name, owner)
        return JSONResponse({"name": name, **body, "scope": SHARED if scope == SHARED else "own",
                             "pinned": key in gw.personas.pinned, "pinned_tokens": gw.personas.pinned.get(key, 0)})
    if request.method == "DELETE":
        if not await gw.personas.delete(owner, admin, name):
            raise APIError(404, f"persona {name!r} not found", code="persona_not_found")
        return JSONResponse({"name": name, "deleted": True})
    req = parse(PersonaBody, await read_json(request, gw.settings.max_body_bytes))
    gw.refuse_if_draining()
    # Its prefill is a generation like any other: it counts against the key's quota while it runs.
    lease = await gw.quotas.reserve_generation(owner)
    try:
        created, pinned = await gw.personas.put(owner, admin, name, req.model_dump())
    finally:
        await lease.release()
    # A persona that found no room among its key's pins is stored all the same, unpinned.
    key = pin_key(name) if admin else pin_key(name, owner)
    return JSONResponse({"name": name, **req.model_dump(), "scope": "shared" if admin else "own",
                         "pinned": key in gw.personas.pinned, "pinned_tokens": pinned},
                        status_code=201 if created else 200)


routes = [
    Route("/v1/personas", list_personas, methods=["GET"]),
    Route("/v1/personas/{name}", persona, methods=["GET", "PUT", "DELETE"]),
]
