"""create_app(engine, store, settings): the Starlette application of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

import chatsvc
from chatsvc import auth_routes, kv_routes, openai_routes, persona_routes, sessions, ws
from chatsvc.auth import Auth, bearer
from chatsvc.cache_isolation import CacheIsolation
from chatsvc.context import Gateway, gateway
from chatsvc.errors import APIError, api_error_handler, not_found_handler
from chatsvc.guard import RequestGuard
from chatsvc.keyring import SecretError, open_keys, read_secrets
from chatsvc.metrics import Metrics
from chatsvc.offload import Offload
from chatsvc.personas import Personas
from chatsvc.quotas import Quotas
from chatsvc.rates import Rates
from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.store.turns import Retention
from chatsvc.turns import TurnRegistry
from engine.client import EngineClient
from engine.protocol import EngineDeadError

log = logging.getLogger("chatsvc.app")

STUCK_AFTER_S = 30.0  # no engine step for this long while requests run: not ready
ENGINE_RETRY_AFTER_S = 5  # what a 503 for an unavailable engine tells clients to wait


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "draining" if gateway(request).draining else "ok"})


def engine_problem(gw: Gateway) -> str | None:
    """Why the engine cannot serve now (not started, restarting, failed, stuck in a step), else None."""
    stats = gw.engine.stats()
    if not (gw.engine_ready and gw.engine.is_running):
        return f"engine {stats.engine_state}"
    age = stats.last_step_age_s
    if stats.requests_running > 0 and age > STUCK_AFTER_S:
        return f"engine stuck: no step for {age:.0f}s with {stats.requests_running} requests running"
    return None


async def ready(request: Request) -> JSONResponse:
    gw = gateway(request)
    redis_ok = await gw.store.ping()
    problem = engine_problem(gw)
    ok = problem is None and redis_ok and not gw.draining
    body: dict[str, Any] = {"ready": ok, "engine": problem is None, "redis": redis_ok}
    reasons = [r for r in (problem, None if redis_ok else "redis unreachable", "draining" if gw.draining else None)
               if r]
    if reasons:
        body["reason"] = "; ".join(reasons)
    headers = {} if ok else {"Retry-After": str(ENGINE_RETRY_AFTER_S)}
    return JSONResponse(body, status_code=200 if ok else 503, headers=headers)


async def metrics(request: Request) -> Response:
    gw = gateway(request)
    want = gw.settings.metrics_key
    if want is not None:
        got = bearer(request.headers) or ""
        if not secrets.compare_digest(got.encode(), want.encode()):
            raise APIError(401, "metrics need the metrics key (Authorization: Bearer <key>)",
                           code="invalid_api_key")
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def redis_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return APIError(503, f"session store unavailable: {type(exc).__name__}", code="redis_unavailable").response()


async def engine_dead_handler(request: Request, exc: Exception) -> JSONResponse:
    # A dead engine process is being replaced (engine.engine_process); retrying soon may succeed.
    return APIError(503, "the engine is not running", code="engine_unavailable",
                    headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)}).response()


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, "internal server error", code="internal_error").response()


async def load_secret(gw: Gateway) -> None:
    """Read the server secrets (the file or the environment the settings name; without either, the generated
    one in Redis), open the identity key in Redis with them and give Auth the derived keys."""
    secrets_given = read_secrets(gw.settings.secret_file, os.environ)
    gw.auth.set_keys(await open_keys(gw.store.r, secrets_given))


async def _reload_secret(gw: Gateway, now: asyncio.Event) -> None:
    """Re-read the secrets every --secret-reload-interval seconds when they come from a file, and whenever
    ``now`` is set (SIGHUP): a rotation needs no restart. A failed re-read keeps the keys in use."""
    interval = gw.settings.secret_reload_interval_s if gw.settings.secret_file is not None else None
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(now.wait(), interval)
        asked = now.is_set()
        now.clear()
        try:
            await load_secret(gw)
            if asked:  # the operator's SIGHUP: confirm it took
                log.info("server secrets re-read on SIGHUP")
        except (SecretError, RedisError) as exc:
            log.error("server secrets not reloaded; the keys in use stay: %s", exc)


async def _sync_personas(gw: Gateway) -> None:
    """Read the server secret and pin the personas once Redis answers (it may come up after the gateway)."""
    while True:
        try:
            if not gw.auth.ready:
                try:
                    await load_secret(gw)
                except SecretError as exc:  # keyed requests get 503 until a reload brings a secret that works
                    log.error("%s", exc)
            await gw.personas.sync()
            return
        except RedisError as exc:
            log.warning("Redis not reachable for personas (%s); retrying", exc)
            await asyncio.sleep(2.0)


def create_app(engine: EngineClient, store: Store, settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    m = Metrics(engine)
    offload = Offload(engine)
    auth = Auth(settings.api_keys, settings.admin_keys)
    isolation = CacheIsolation(auth)
    rates = Rates(settings, store.r, m)
    turns = TurnRegistry(engine, store, m, settings, offload, isolation)
    turns.rates = rates
    store.retention_source = lambda: Retention.for_context(settings.history_max_messages, settings.history_max_bytes,
                                                          engine.max_model_len)
    gw = Gateway(engine=engine, store=store, settings=settings, auth=auth, metrics=m,
                 personas=Personas(engine, store, settings, offload, isolation, rates),
                 turns=turns, offload=offload,
                 quotas=Quotas(settings, store, m, engine), isolation=isolation, rates=rates)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        await asyncio.to_thread(gw.grammars.prepare, engine.tokenizer)  # see Grammars: not on a live loop
        await gw.offload.warm()
        # Everything loaded so far (torch, transformers, the tokenizer) lives as long as the process: frozen
        # out of the cyclic GC, a full collection walks only request objects, not a pause of tenths of a
        # second (holding the GIL) whenever a large request allocates enough to trigger one.
        gc.freeze()
        gw.engine_ready = True
        reload_now = asyncio.Event()
        reload: asyncio.Task[None] | None = None
        reloads_on_hup = False
        if gw.auth.enabled:
            # Keyed requests wait for the secret (503 meanwhile); Redis is usually up, so try once first.
            with contextlib.suppress(RedisError, OSError, SecretError):
                await asyncio.wait_for(load_secret(gw), 5.0)
            reload = asyncio.create_task(_reload_secret(gw, reload_now))
            if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_now.set)
                reloads_on_hup = True
        await gw.turns.open()  # heartbeat, lock refresh, recovery of turns a crashed instance left
        await gw.quotas.open()  # renews this gateway's quota places
        sync = asyncio.create_task(_sync_personas(gw))
        try:
            yield
        finally:
            gw.engine_ready = False
            sync.cancel()
            if reload is not None:
                reload.cancel()
            if reloads_on_hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await gw.turns.shutdown()
            await gw.quotas.close()
            await engine.stop()
            await store.close()
            gw.offload.close()

    routes: list[BaseRoute] = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *auth_routes.routes,
        *kv_routes.routes,
        *openai_routes.routes,
        *persona_routes.routes,
        *sessions.routes,
        *ws.routes,
    ]
    web = settings.web_dir or Path(chatsvc.__file__).resolve().parent.parent / "web"
    if web.is_dir() and any(web.iterdir()):
        routes.append(Mount("/", StaticFiles(directory=web, html=True), name="web"))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(RequestGuard, allowed_hosts=settings.allowed_hosts,
                               allowed_origins=settings.allowed_origins)],
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: not_found_handler,
            RedisError: redis_error_handler,
            EngineDeadError: engine_dead_handler,
            Exception: internal_error_handler,
        },
    )
    app.state.gateway = gw
    return app
