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
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated WebSocket Origin patterns (fnmatch) besides the server's own host")
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


def settings_from_args(args: argparse.Namespace) -> Settings:
    keys = tuple(args.api_keys or ()) + api_keys_from_env()
    base = Settings()
    origins = base.allowed_origins
    if args.allowed_origins:
        origins = origins + tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return Settings(api_keys=keys, allowed_origins=origins, session_ttl_s=args.session_ttl,
                    abort_grace_s=args.abort_grace)


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
        if args.redis_url:
            url, desc = args.redis_url, f"external Redis at {args.redis_url}"
        else:
            embedded = EmbeddedRedis((args.data_dir or default_data_dir()) / "redis")
            url = embedded.start()
            desc = f"embedded Redis (pid {embedded.proc.pid if embedded.proc else '?'}) at {url}, append-only"
        settings = settings_from_args(args)
        engine = build_engine(args.model, engine_kwargs(args), args.engine, args.engine_threads)
        stats = engine.stats()
        log.info("model %s, max_model_len %d, %d KV blocks of %d tokens (%d CPU swap blocks)", engine.model_name,
                 engine.max_model_len, stats.get("kv_blocks_total", 0), args.block_size,
                 stats.get("cpu_blocks_total", 0))
        log.info("sessions in %s", desc)
        if settings.api_keys:
            log.info("API keys required (%d configured)", len(settings.api_keys))
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
