"""``chatsvc worker`` as real child processes for the scale-out tests, and the tiny model they serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from timing import scaled

from engine.streams import Beat, Keys

REPO = Path(__file__).resolve().parent.parent
# float32 and the torch kernels: greedy replies are then the same whichever worker (or recompute) makes them.
TINY_FLAGS = ("--engine", "thread", "--engine-threads", "1", "--dtype", "float32", "--attention-backend", "torch",
              "--num-kv-blocks", "96", "--max-model-len", "512", "--block-size", "16")


class WorkerProc:
    def __init__(self, redis_url: str, model: str, name: str, *flags: str, ttl_s: float = 2.0) -> None:
        self.url = redis_url
        self.name = name
        args = [sys.executable, "-m", "chatsvc.cli", "worker", "--redis-url", redis_url, "--model", model,
                "--name", name, "--heartbeat-ttl", str(ttl_s), "--log-level", "warning", *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        # A file, not a pipe: a pipe nobody reads would stall a worker that logs more than its buffer.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by kill9/terminate
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.id = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_registered(self, timeout_s: float = 120) -> WorkerProc:
        client = redis.Redis.from_url(self.url, decode_responses=True)
        prefix = f"{self.name}-{self.proc.pid}-"
        deadline = time.monotonic() + scaled(timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(self.output())
            ids = [w for w in client.zrange(Keys().workers, 0, -1) if w.startswith(prefix)]
            if ids:
                self.id = ids[0]
                return self
            time.sleep(0.1)
        self.kill9()
        raise AssertionError(f"worker {self.name} did not register:\n{self.output()}")

    def beat(self) -> Beat | None:
        raw = redis.Redis.from_url(self.url, decode_responses=True).get(Keys().beat(self.id))
        return Beat.from_json(raw) if raw else None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def terminate(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.log.close()
        return int(self.proc.returncode)


def worker_output_written(url: str, allowed: bool) -> None:
    """Let the workers write their output streams (``chatsvc:out:*``), or not, every other key staying
    writable: Redis refusing a worker's writes (memory pressure, a failover) for longer than its writer
    retries. Through ACL write-key patterns of the default user, which every connection uses."""
    conn = redis.Redis.from_url(url)
    if allowed:
        conn.execute_command("ACL", "SETUSER", "default", "resetkeys", "~*")
    else:
        # Read everywhere; read and write (a script's keys need both in one pattern) all but chatsvc:out*.
        conn.execute_command("ACL", "SETUSER", "default", "resetkeys", "%R~*", "~[^c]*", "~c[^h]*",
                             "~chatsvc:[^o]*", "~chatsvc:o[^u]*", "~chatsvc:ou[^t]*")
