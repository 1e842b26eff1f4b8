"""``chatsvc`` command line: ``serve`` (the gateway, its engine in a child process or a thread) and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from chatsvc.settings import Settings, api_keys_from_env, default_data_dir
from engine.client import EngineClient
from engine.config import EngineConfig, literal_choices

log = logging.getLogger("chatsvc")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="Redis URL (default: $REDIS_URL, else an embedded redis-server)")
    p.add_argument("--data-dir", type=Path, default=None, help="embedded Redis data dir (default: user data dir)")
    add_engine_arguments(p)
    p.add_argument("--engine", choices=["process", "thread"], default="process",
                   help="run the engine loop in a child process (its own GIL and cores) or on a thread of the "
                        "gateway's process")
    p.add_argument("--api-key", action="append", default=None, dest="api_keys",
                   help="accepted API key (repeatable; also $CHATSVC_API_KEYS, comma-separated)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated WebSocket Origin patterns (fnmatch) besides the server's own host")
    p.add_argument("--session-ttl", type=int, default=7 * 24 * 3600, help="idle session TTL in seconds")
    p.add_argument("--abort-grace", type=float, default=3.0,
                   help="seconds a session reply keeps generating without readers before it is aborted")
    p.add_argument("--log-level", default="info")


# Engine flags are generated from EngineConfig's fields: --field-name (a bool that defaults to True becomes
# --no-field-name), Literal fields get their values as choices, the field's help is the flag's. Only what the
# server does differently from the engine's defaults, and older flag spellings, are listed here.
_SERVE_DEFAULTS: dict[str, Any] = {"max_waiting": 256}  # a server answers 429 early instead of queueing long
_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"preemption_mode": ("--preemption",),
                                             "enable_prefix_caching": ("--no-prefix-caching",)}
_EXCLUSIVE: tuple[str, ...] = ("num_kv_blocks", "kv_cache_mb")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    exclusive = p.add_mutually_exclusive_group()
    for f in dataclasses.fields(EngineConfig):
        default = _SERVE_DEFAULTS.get(f.name, f.default)
        target = exclusive if f.name in _EXCLUSIVE else p
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help")
        if default is True:
            target.add_argument(f"--no-{flag[2:]}", *_FLAG_ALIASES.get(f.name, ()), dest=f.name,
                                action="store_false", help=help_text)
            continue
        hint = hints[f.name]
        choices = literal_choices(hint)
        kind: type[int] | type[str] = int if int in typing.get_args(hint) or hint is int else str
        target.add_argument(flag, *_FLAG_ALIASES.get(f.name, ()), dest=f.name, default=default,
                            choices=list(choices) or None, type=kind, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def settings_from_args(args: argparse.Namespace) -> Settings:
    keys = tuple(args.api_keys or ()) + api_keys_from_env()
    base = Settings()
    origins = base.allowed_origins
    if args.allowed_origins:
        origins = origins + tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return Settings(api_keys=keys, allowed_origins=origins, session_ttl_s=args.session_ttl,
                    abort_grace_s=args.abort_grace)


def build_engine(config: EngineConfig, kind: str = "process") -> EngineClient:
    """The engine the gateway serves from; "process" blocks until the child has loaded the model."""
    if kind == "process":
        from engine.engine_process import ProcessEngine

        return ProcessEngine(config)
    if kind != "thread":
        raise ValueError(f"engine must be 'process' or 'thread', got {kind!r}")
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(config)


class _Stop(Exception):
    """Raised by our SIGINT/SIGTERM handler: unwinds to serve()'s cleanup (embedded Redis) and exits 0."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chatsvc.app import create_app
    from chatsvc.redis_server import EmbeddedRedis
    from chatsvc.store import Store

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    embedded: EmbeddedRedis | None = None
    # uvicorn handles the signals while it serves and re-raises them once it has shut down gracefully;
    # they then land here instead of killing the process before the embedded Redis is stopped.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stop)
    try:
        if args.redis_url:
            url, desc = args.redis_url, f"external Redis at {args.redis_url}"
        else:
            embedded = EmbeddedRedis((args.data_dir or default_data_dir()) / "redis")
            url = embedded.start()
            desc = f"embedded Redis (pid {embedded.proc.pid if embedded.proc else '?'}) at {url}, append-only"
        settings = settings_from_args(args)
        engine = build_engine(engine_config(args), args.engine)
        stats = engine.stats()
        log.info("model %s, max_model_len %d, %d KV blocks of %d tokens (%d CPU swap blocks)", engine.model_name,
                 engine.max_model_len, stats.get("kv_blocks_total", 0), args.block_size,
                 stats.get("cpu_blocks_total", 0))
        log.info("sessions in %s", desc)
        if settings.api_keys:
            log.info("API keys required (%d configured)", len(settings.api_keys))
        app = create_app(engine, Store.from_url(url, settings.session_ttl_s, settings.stream_ttl_s), settings)
        log.info("listening on http://%s:%d", args.host, args.port)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                ws_max_size=4 * settings.max_ws_frame_bytes, timeout_graceful_shutdown=5)
        asyncio.run(uvicorn.Server(config).serve())
        return 0
    except _Stop:
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatsvc", description="streaming chat service on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the gateway and the engine"))
    bench_parser = sub.add_parser("bench", help="load-test a running server")
    from chatsvc import bench

    bench.add_arguments(bench_parser)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return int(bench.run(args))


if __name__ == "__main__":
    sys.exit(main())
