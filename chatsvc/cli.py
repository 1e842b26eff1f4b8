"""``chatsvc`` command line: ``serve`` (the gateway, its engine in a child process or a thread) and ``bench``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from chatsvc.settings import Settings, api_keys_from_env, default_data_dir
from engine.client import EngineClient

log = logging.getLogger("chatsvc")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="Redis URL (default: $REDIS_URL, else an embedded redis-server)")
    p.add_argument("--data-dir", type=Path, default=None, help="embedded Redis data dir (default: user data dir)")
    p.add_argument("--block-size", type=int, default=16)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-mb", type=int, default=None)
    kv.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--swap-space-mb", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=256, help="waiting-queue bound; beyond it requests get 429")
    p.add_argument("--preemption", choices=["swap", "recompute"], default="swap")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 where the CPU (AVX512-BF16/AMX) or GPU multiplies it natively, else float32")
    p.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "triton"], default="auto")
    p.add_argument("--linear-backend", choices=["auto", "onednn", "torch"], default="auto",
                   help="onednn: weights packed once for oneDNN (auto, where it runs the dtype natively)")
    p.add_argument("--engine", choices=["process", "thread"], default="process",
                   help="run the engine loop in a child process (its own GIL and cores) or on a thread of the "
                        "gateway's process")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the engine (default: all cores)")
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
    p.add_argument("--max-personas-per-key", type=int, default=16)
    p.add_argument("--max-streams-per-key", type=int, default=8, help="concurrent generations per API key")
    p.add_argument("--max-sessions-per-minute", type=int, default=30, help="new sessions per API key a minute")
    p.add_argument("--max-sockets-per-key", type=int, default=16, help="open WebSockets per API key")
    p.add_argument("--max-pinned-fraction", type=float, default=0.25,
                   help="share of the KV pool persona pins may hold; least recently used are unpinned past it")
    p.add_argument("--session-ttl", type=int, default=7 * 24 * 3600, help="idle session TTL in seconds")
    p.add_argument("--abort-grace", type=float, default=3.0,
                   help="seconds a session reply keeps generating without readers before it is aborted")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn the prefix cache off (for measuring what it buys; personas then pin nothing)")
    p.add_argument("--log-level", default="info")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks, "kv_cache_mb": args.kv_cache_mb, "swap_space_mb": args.swap_space_mb,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "preemption_mode": args.preemption,
        "attention_backend": args.attention_backend, "max_waiting": args.max_waiting,
        "linear_backend": args.linear_backend,
        "enable_prefix_caching": args.prefix_caching,
    }


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def is_loopback(host: str) -> bool:
    import ipaddress

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
        hosts = _csv(args.allowed_hosts)
    origins = _csv(args.allowed_origins) if args.allowed_origins else Settings().allowed_origins
    return Settings(api_keys=keys, allowed_origins=origins, session_ttl_s=args.session_ttl,
                    abort_grace_s=args.abort_grace, allowed_hosts=hosts, admin_keys=admins,
                    max_personas_per_key=args.max_personas_per_key,
                    max_pinned_fraction=args.max_pinned_fraction,
                    metrics_key=args.metrics_key or None, max_streams_per_key=args.max_streams_per_key,
                    max_sessions_per_minute=args.max_sessions_per_minute,
                    max_sockets_per_key=args.max_sockets_per_key)


def build_engine(model: str | None, kwargs: dict[str, Any], kind: str = "process",
                 threads: int | None = None) -> EngineClient:
    """The engine the gateway serves from; "process" blocks until the child has loaded the model."""
    if kind == "process":
        from engine.engine_process import ProcessEngine

        return ProcessEngine.from_args(model=model, engine_threads=threads, **kwargs)
    if kind != "thread":
        raise ValueError(f"engine must be 'process' or 'thread', got {kind!r}")
    from engine.async_engine import AsyncEngine

    if threads:
        import torch

        torch.set_num_threads(threads)
    return AsyncEngine.from_args(model=model, **kwargs)


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
        settings = settings_from_args(args)  # refuses an unprotected public listen before starting anything
        if args.redis_url:
            url, desc = args.redis_url, f"external Redis at {args.redis_url}"
        else:
            embedded = EmbeddedRedis((args.data_dir or default_data_dir()) / "redis")
            url = embedded.start()
            desc = f"embedded Redis (pid {embedded.proc.pid if embedded.proc else '?'}) at {url}, append-only"
        engine = build_engine(args.model, engine_kwargs(args), args.engine, args.engine_threads)
        stats = engine.stats()
        log.info("model %s, max_model_len %d, %d KV blocks of %d tokens (%d CPU swap blocks)", engine.model_name,
                 engine.max_model_len, stats.get("kv_blocks_total", 0), args.block_size,
                 stats.get("cpu_blocks_total", 0))
        log.info("sessions in %s", desc)
        if settings.api_keys or settings.admin_keys:
            log.info("API keys required (%d configured, %d admin)", len(settings.api_keys), len(settings.admin_keys))
        # Named by host and port: a restart on the same port recovers its predecessor's turns at once.
        store = Store.from_url(url, settings.session_ttl_s, settings.stream_ttl_s,
                               instance=f"{socket.gethostname()}:{args.port}")
        app = create_app(engine, store, settings)
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
