"""An embedded Redis: a private ``redis-server`` child on a Unix socket with append-only persistence.

Used by ``chatsvc serve`` when no Redis URL is given. The child dies with us: it is stopped on
exit and, on Linux, also receives SIGTERM if this process is killed outright (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

log = logging.getLogger("chatsvc.redis")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.binary = binary or shutil.which("redis-server") or "redis-server"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout_s: float = 10.0) -> str:
        if shutil.which(self.binary) is None:
            raise RuntimeError("redis-server not found on PATH; install Redis or pass --redis-url")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if len(str(self.socket_path)) > 100:
            raise RuntimeError(f"data dir path too long for a Unix socket: {self.data_dir}")
        self.socket_path.unlink(missing_ok=True)
        args = [
            self.binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     # Own process group: a Ctrl-C reaches only us, and Redis stays up
                                     # until the gateway has stored the replies it aborts on the way out.
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                client = redis.Redis(unix_socket_path=str(self.socket_path), socket_connect_timeout=0.5)
                if client.ping():
                    client.close()
                    log.info("embedded Redis (pid %d) at %s, data in %s", self.proc.pid, self.url, self.data_dir)
                    return self.url
            except (redis.ConnectionError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # SIGTERM makes Redis flush the AOF and exit cleanly.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.info("embedded Redis stopped")

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
