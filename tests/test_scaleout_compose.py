"""compose.yaml's split form: a gateway without a model and replicated engine workers on the one Redis, behind
a profile so that a plain ``docker compose up`` still runs the single-process service alone."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def test_split_form_wires_gateway_and_workers_to_one_redis() -> None:
    spec = yaml.safe_load((REPO / "compose.yaml").read_text())
    services = spec["services"]
    single, gateway, engine = services["chatsvc"], services["gateway"], services["engine"]
    assert "profiles" not in single and "serve" in single["command"] and "--engine" not in single["command"]
    assert gateway["profiles"] == engine["profiles"] == ["split"]
    cmd = gateway["command"]
    assert cmd[:2] == ["chatsvc", "serve"] and cmd[cmd.index("--engine") + 1] == "redis"
    assert engine["command"][:2] == ["chatsvc", "worker"] and engine["deploy"]["replicas"] >= 2
    for svc in (gateway, engine):
        assert svc["environment"]["REDIS_URL"] == single["environment"]["REDIS_URL"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["healthcheck"]["test"] and "/ready" in " ".join(gateway["healthcheck"]["test"])
    published = {p.rsplit(":", 1)[0] for svc in (single, gateway) for p in svc["ports"]}
    assert len(published) == 2 and all(p.startswith("127.0.0.1:") for p in published)
    assert engine["stop_grace_period"]  # SIGTERM drains running replies before the worker exits
