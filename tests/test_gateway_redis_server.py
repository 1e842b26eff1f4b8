from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis

from chatsvc.redis_server import EmbeddedRedis, pid_alive

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def test_embedded_redis_persists_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "r"
    with EmbeddedRedis(data) as server:
        assert server.proc is not None
        pid = server.proc.pid
        redis.Redis(unix_socket_path=str(server.socket_path)).set("k", "v")
    assert not pid_alive(pid) or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert any(p.name.startswith("appendonly") for p in data.iterdir())
    with EmbeddedRedis(data) as server:
        assert redis.Redis(unix_socket_path=str(server.socket_path)).get("k") == b"v"


def test_embedded_redis_fails_clearly_without_binary(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="redis-server not found"):
        EmbeddedRedis(tmp_path, binary=os.path.join(str(tmp_path), "no-such-redis")).start()
