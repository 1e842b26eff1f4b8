from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis

from chatsvc.redis_server import EmbeddedRedis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def test_embedded_redis_persists_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "r"
    with EmbeddedRedis(data) as server:
        proc = server.proc
        assert proc is not None
        redis.Redis(unix_socket_path=str(server.socket_path)).set("k", "v")
    assert server.proc is None and proc.returncode is not None  # stopped, and waited for
    assert any(p.name.startswith("appendonly") for p in data.iterdir())
    with EmbeddedRedis(data) as server:
        assert redis.Redis(unix_socket_path=str(server.socket_path)).get("k") == b"v"


def test_embedded_redis_fails_clearly_without_binary(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="redis-server not found"):
        EmbeddedRedis(tmp_path, binary=os.path.join(str(tmp_path), "no-such-redis")).start()
