"""Real processes for the fault tests: a restartable redis-server that persists every write (so killing
it loses nothing, as a production Redis with AOF), and ``chatsvc serve`` on a given port and Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
from timing import scaled

REPO = Path(__file__).resolve().parent.parent


class PersistentRedis:
    """redis-server on a fixed port with ``appendfsync always``: ``kill()`` then ``start()`` keeps the data."""

    def __init__(self, port: int, data_dir: Path) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PersistentRedis:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.data_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not start")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, decode_responses=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class Serve:
    """``chatsvc serve`` (engine on a thread, one torch thread) as a child process."""

    def __init__(self, model: str, port: int, redis_url: str | None, *extra: str) -> None:
        """``redis_url`` None: Redis is named by ``extra`` (--redis-sentinel)."""
        redis = ["--redis-url", redis_url] if redis_url is not None else []
        self.args = [sys.executable, "-m", "chatsvc.cli", "serve", "--model", model, "--port", str(port), *redis,
                     "--engine", "thread", "--engine-threads", "1", "--log-level", "warning", *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: a pipe nobody reads would stall a server that logs more than its buffer.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure, closed with the object

    def start(self, timeout_s: float = 180) -> Serve:
        """Start and poll /ready until it answers 200, within ``timeout_s`` seconds of the reference machine."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(self.output())
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill9()
        raise AssertionError("chatsvc serve did not become ready:\n" + self.output())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-8000:]

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill9()


def sse_json(r: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in r.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            yield json.loads(line[5:])


class LongReply:
    """A long session reply (``max_tokens``, EOS ignored) read on a thread of its own, its events kept as they
    arrive: for faults injected while a reply streams."""

    def __init__(self, url: str, sid: str, max_tokens: int) -> None:
        self.events: list[dict[str, Any]] = []
        msg = {"content": "Write a long essay.", "max_tokens": max_tokens, "ignore_eos": True}

        def read() -> None:
            with httpx.stream("POST", f"{url}/v1/sessions/{sid}/messages", json=msg, timeout=180) as r:
                assert r.status_code == 200
                self.events.extend(sse_json(r))

        self.reader = threading.Thread(target=read)
        self.reader.start()

    def wait_streaming(self, timeout_s: float = 60) -> None:
        """Until the first deltas have arrived (the reply is under way, not yet ended)."""
        deadline = time.monotonic() + scaled(timeout_s)
        while len(self.events) < 3:
            assert time.monotonic() < deadline and self.reader.is_alive(), self.events
            time.sleep(0.01)

    def still_streaming(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] == "delta"

    def join(self, timeout_s: float, output: Callable[[], str] = str) -> None:
        """Until the reply ends; ``output`` (a server's log, say) is shown if it never does."""
        self.reader.join(scaled(timeout_s))
        assert not self.reader.is_alive(), "the reply never ended:\n" + output()


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages]


def assert_alternating(messages: list[dict[str, Any]]) -> None:
    """user, assistant, user, assistant...: never two user messages in a row."""
    assert roles(messages) == ["user", "assistant"] * (len(messages) // 2), roles(messages)
