"""``chatsvc`` command line: ``serve`` (the gateway, its engine in a child process or a thread, or engine workers
over Redis), ``worker`` (one engine serving gateways over Redis) and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import typing
from pathlib import Path
from typing import Any

from chatsvc import bench, redis_client
from chatsvc.keyring import SecretError, read_secrets
from chatsvc.settings import Settings, api_keys_from_env, default_data_dir, flag_fields, split_csv
from chatsvc.worker import DEFAULT_TTL_S, DRAIN_TIMEOUT_S
from engine.client import EngineClient
from engine.config import EngineConfig, literal_choices
from engine.kv_disk import kv_home

log = logging.getLogger("chatsvc")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="Redis URL (default: $REDIS_URL, else an embedded redis-server); rediss:// for TLS")
    redis_client.add_arguments(p)
    p.add_argument("--data-dir", type=Path, default=None, help="embedded Redis data dir (default: user data dir)")
    add_engine_arguments(p)
    p.add_argument("--engine", choices=["process", "thread", "redis"], default="process",
                   help="run the engine loop in a child process (its own GIL and cores), on a thread of the "
                        "gateway's process, or in `chatsvc worker` processes reached through --redis-url (redis: "
                        "this gateway loads only the tokenizer of --model)")
    p.add_argument("--route-policy", choices=["affinity", "random"], default="affinity",
                   help="with --engine redis: place a session's turns and a persona's sessions where their blocks "
                        "are cached (affinity), or anywhere (random: a benchmark baseline)")
    p.add_argument("--progress-timeout", type=float, default=120.0,
                   help="with --engine redis: seconds a request's worker may send nothing (beyond its measured "
                        "prefill time) before the request is moved to another worker, or fails with 503")
    p.add_argument("--api-key", action="append", default=None, dest="api_keys",
                   help="accepted API key (repeatable; also $CHATSVC_API_KEYS, comma-separated)")
    p.add_argument("--admin-key", action="append", default=None, dest="admin_keys",
                   help="key that may also write the shared personas (repeatable; also $CHATSVC_ADMIN_KEYS)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow listening on a non-loopback address without API keys (anyone can use it)")
    p.add_argument("--metrics-key", default=os.environ.get("CHATSVC_METRICS_KEY"),
                   help="bearer token /metrics requires (default: $CHATSVC_METRICS_KEY; unset: public)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser Origin patterns (fnmatch) allowed besides the server's own "
                        "origin; replaces the (empty) default")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names (fnmatch, '*' for any) the server answers to; default: "
                        "localhost, 127.0.0.1, [::1] and --host")
    hints = typing.get_type_hints(Settings)
    for f in flag_fields():  # the settings that name a flag (Settings holds its default, type and help)
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        if kind is bool:  # --flag and --no-flag: bool("false") would be True
            p.add_argument(f.metadata["flag"], dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])
            continue
        p.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=f.default, help=f.metadata["help"])
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="the gateway's event loop (auto: uvloop where installed)")
    p.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="HTTP/1.1 parser (auto: httptools where installed)")
    p.add_argument("--log-level", default="info")


# Engine flags are generated from EngineConfig's fields: --field-name (a bool that defaults to True becomes
# --no-field-name, a bool | None both --field-name and --no-field-name), Literal fields get their values as choices, the field's help is the flag's. Only what the
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
        if bool in typing.get_args(hint):  # bool | None: None lets the engine decide
            target.add_argument(flag, dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                                help=help_text)
            continue
        choices = literal_choices(hint)
        kind: type[int] | type[str] = int if int in typing.get_args(hint) or hint is int else str
        target.add_argument(flag, *_FLAG_ALIASES.get(f.name, ()), dest=f.name, default=default,
                            choices=[c for c in choices if c is not None] or None, type=kind, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if settings["kv_disk_bytes"] and not settings["kv_disk_dir"]:  # the disk tier lives with the other data
        data_dir = getattr(args, "data_dir", None) or default_data_dir()
        settings["kv_disk_dir"] = str(data_dir / "kv")
    return EngineConfig(**settings)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The gateway's settings; raises SystemExit for a configuration that would expose it unprotected."""
    keys = tuple(args.api_keys or ()) + api_keys_from_env()
    admins = tuple(args.admin_keys or ()) + api_keys_from_env("CHATSVC_ADMIN_KEYS")
    host = args.host
    if not (keys or admins) and not is_loopback(host):
        if not args.insecure_no_auth:
            raise SystemExit(f"refusing to listen on {host} without API keys: anyone who can reach it could use "
                             "it. Set --api-key/CHATSVC_API_KEYS, or pass --insecure-no-auth.")
        log.warning("INSECURE: listening on %s WITHOUT API KEYS (--insecure-no-auth): anyone who can reach this "
                    "address can use the service and read every session", host)
    hosts = Settings().allowed_hosts
    if host not in ("0.0.0.0", "::", "") and host not in hosts:
        hosts = (*hosts, f"[{host}]" if ":" in host else host)
    if args.allowed_hosts:
        hosts = split_csv(args.allowed_hosts)
    origins = split_csv(args.allowed_origins) if args.allowed_origins else Settings().allowed_origins
    settings = Settings(api_keys=keys, allowed_origins=origins, allowed_hosts=hosts, admin_keys=admins,
                        metrics_key=args.metrics_key or None,
                        **{f.name: getattr(args, f.name) for f in flag_fields()})
    try:  # a bad secret file stops the start here, with its reason, rather than 503 on every keyed request
        given = read_secrets(settings.secret_file, os.environ)
    except SecretError as exc:
        raise SystemExit(str(exc)) from None
    if given is None and (keys or admins):
        log.warning("NO SERVER SECRET (--secret-file or $CHATSVC_SECRET): a generated one is kept in Redis in "
                    "plaintext, so whoever can read Redis can forge access tokens; set one in production")
    return settings


def remote_engine(args: argparse.Namespace, redis: redis_client.RedisTarget) -> EngineClient:
    """The client of engine workers: tokenizer of --model here, models in `chatsvc worker` processes."""
    from chatsvc.remote_engine import RemoteEngine
    from chatsvc.router import Router

    kwargs: dict[str, Any] = {"router": Router(policy=args.route_policy), "session_ttl_s": args.session_ttl_s,
                              "progress_timeout_s": args.progress_timeout}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    return RemoteEngine.from_url(redis, args.model, **kwargs)


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
    from chatsvc.drain import DrainingServer
    from chatsvc.http_timeouts import read_deadline_protocol
    from chatsvc.redis_server import EmbeddedRedis
    from chatsvc.store import Store

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tensor_parallel_size > 1:
        from engine.distributed import launched_rank, serve_launched_rank

        if launched_rank():  # torchrun started this process as a rank other than 0: no gateway, only a shard
            serve_launched_rank(engine_config(args))
            return 0
    embedded: EmbeddedRedis | None = None
    # uvicorn handles the signals while it serves and re-raises them once it has shut down gracefully;
    # they then land here instead of killing the process before the embedded Redis is stopped.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stop)
    try:
        settings = settings_from_args(args)  # refuses an unprotected public listen before starting anything
        target = redis_client.from_args(args)  # exits at once on wrong credentials
        if target is not None:
            desc = f"external Redis: {target.describe()}"
        else:
            embedded = EmbeddedRedis((args.data_dir or default_data_dir()) / "redis")
            target = redis_client.RedisTarget(url=embedded.start())
            desc = f"embedded Redis (pid {embedded.proc.pid if embedded.proc else '?'}) at {target.url}, append-only"
        engine = remote_engine(args, target) if args.engine == "redis" else build_engine(engine_config(args), args.engine)
        stats = engine.stats()
        log.info("model %s, max_model_len %d, %d KV blocks of %d tokens (%d CPU swap blocks)", engine.model_name,
                 engine.max_model_len, stats.kv_blocks_total, args.block_size, stats.cpu_blocks_total)
        log.info("sessions in %s", desc)
        if settings.api_keys or settings.admin_keys:
            log.info("API keys required (%d configured, %d admin)", len(settings.api_keys), len(settings.admin_keys))
        # Named by host and port: a restart on the same port recovers its predecessor's turns at once.
        store = Store.from_url(target, settings.session_ttl_s, settings.stream_ttl_s,
                               instance=f"{socket.gethostname()}:{args.port}")
        app = create_app(engine, store, settings)
        log.info("listening on http://%s:%d", args.host, args.port)
        # uvloop and httptools: every streamed token passes the loop and the HTTP writer once, and the
        # gateway's CPU time is taken from the engine's cores (see README, "Where serving loses to offline").
        http = read_deadline_protocol(args.http, settings.header_timeout_s, settings.body_timeout_s)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                loop=args.loop, http=http,
                                ws_max_size=4 * settings.max_ws_frame_bytes, timeout_graceful_shutdown=5)
        DrainingServer(config, app.state.gateway, settings.drain_timeout_s).run()  # on the loop config.loop names
        return 0
    except _Stop:
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="the Redis the gateways use (default: $REDIS_URL; or --redis-sentinel)")
    redis_client.add_arguments(p)
    p.add_argument("--name", default=None, help="worker name (default: the host name); the id adds pid and a nonce")
    p.add_argument("--heartbeat-ttl", type=float, default=DEFAULT_TTL_S,
                   help="seconds without a heartbeat after which gateways take the worker for dead and move its "
                        "requests (it beats every quarter of this)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM, how long running requests may take to finish before the worker exits")
    add_engine_arguments(p)
    p.add_argument("--engine", choices=["process", "thread"], default="process",
                   help="run the engine loop in a child process or on a thread of the worker")
    p.add_argument("--log-level", default="info")


def worker(args: argparse.Namespace) -> int:
    from chatsvc.worker import Worker, worker_id

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target = redis_client.from_args(args)  # exits at once on wrong credentials
    if target is None:
        raise SystemExit("chatsvc worker: give --redis-url (REDIS_URL) or --redis-sentinel (REDIS_SENTINEL)")
    config = engine_config(args)
    engine = build_engine(config, args.engine)
    # Sessions whose blocks this worker's disk tier holds come back to whichever process serves that directory.
    home = kv_home(config.kv_disk_dir) if config.kv_disk_bytes and config.kv_disk_dir else ""

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)  # drain, then exit
        client = redis_client.connect(target)
        try:
            return await Worker(engine, client, worker_id(args.name), ttl_s=args.heartbeat_ttl,
                                drain_timeout_s=args.drain_timeout, kv_home=home).run(stop)
        finally:
            await client.aclose()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatsvc", description="streaming chat service on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the gateway and the engine"))
    add_worker_arguments(sub.add_parser("worker", help="run one engine serving gateways (serve --engine redis) "
                                                       "through Redis"))
    bench.add_arguments(sub.add_parser("bench", help="load-test a running server"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "worker":
        return worker(args)
    return int(bench.run(args))


if __name__ == "__main__":
    sys.exit(main())
