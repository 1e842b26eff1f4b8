"""``chatsvc serve`` as a real process with its embedded Redis: sessions survive a restart, no orphans."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import httpx
import pytest
from gateway_fixtures import free_port

from chatsvc.cli import main

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]


def redis_pids(data_dir: Path) -> list[int]:
    """redis-server processes serving this data dir (matched by the socket path on their command line)."""
    sock = str(data_dir / "redis" / "redis.sock")
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "redis-server" in cmd and sock in cmd:
                pids.append(int(proc.name))
    return pids


def start(model: Path, data_dir: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatsvc.cli", "serve", "--model", str(model), "--port", str(port),
         "--data-dir", str(data_dir), "--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "warning", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become ready")


def loaded_extensions(pid: int) -> set[str]:
    """Which of uvloop's and httptools' compiled modules the process has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name for name in ("uvloop", "httptools") if f"/{name}/" in maps}


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    proc.send_signal(sig)
    assert proc.wait(30) == 0


@pytest.mark.long
def test_restart_keeps_sessions_and_leaves_no_redis(tmp_path: Path) -> None:
    from tiny_model import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path)
    data = tmp_path / "data"
    port = free_port()
    proc = start(model, data, port)
    try:
        base = f"http://127.0.0.1:{port}"
        sid = httpx.post(base + "/v1/sessions", json={"persona": "tutor"}).json()["id"]
        with httpx.stream("POST", f"{base}/v1/sessions/{sid}/messages", json={"content": "hello", "max_tokens": 4},
                          timeout=30) as r:
            assert r.status_code == 200
            assert any('"done"' in line for line in r.iter_lines())
        before = httpx.get(f"{base}/v1/sessions/{sid}").json()
        assert len(redis_pids(data)) == 1
        assert loaded_extensions(proc.pid) == {"uvloop", "httptools"}  # the defaults where installed
    finally:
        stop(proc, signal.SIGTERM)
    assert redis_pids(data) == []
    proc = start(model, data, port, "--loop", "asyncio", "--http", "h11")
    try:
        assert loaded_extensions(proc.pid) == set()
        after = httpx.get(f"http://127.0.0.1:{port}/v1/sessions/{sid}").json()
        assert after["messages"] == before["messages"] and len(after["messages"]) == 2
    finally:
        stop(proc, signal.SIGINT)  # Ctrl-C
    assert redis_pids(data) == []


def test_cli_help_lists_the_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--model", "--redis-url", "--block-size", "--kv-cache-mb", "--num-kv-blocks",
                 "--swap-space-mb", "--max-num-seqs", "--max-num-batched-tokens", "--preemption", "--api-key",
                 "--device", "--dtype", "--max-model-len", "--allowed-origins", "--session-ttl", "--max-waiting",
                 "--engine", "--engine-threads"):
        assert flag in out


def _serve_parser() -> argparse.ArgumentParser:
    from chatsvc.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def test_engine_config_follows_the_flags() -> None:
    from chatsvc.cli import engine_config

    parser = _serve_parser()
    config = engine_config(parser.parse_args(["--no-prefix-caching", "--dtype", "bfloat16", "--preemption",
                                              "recompute", "--num-kv-blocks", "64", "--engine-threads", "3"]))
    assert config.enable_prefix_caching is False
    assert (config.dtype, config.preemption_mode, config.num_kv_blocks) == ("bfloat16", "recompute", 64)
    assert config.engine_threads == 3
    default = engine_config(parser.parse_args([]))
    assert default.enable_prefix_caching is True
    assert default.max_waiting == 256  # the server's own bound, not the offline engine's
    with pytest.raises(SystemExit):  # one KV size or the other
        parser.parse_args(["--num-kv-blocks", "64", "--kv-cache-mb", "100"])
    assert default.kv_host_bytes == 0 and default.kv_disk_bytes == 0 and default.kv_disk_dir is None  # tiers off
    tiered = engine_config(parser.parse_args(["--kv-host-bytes", "1000", "--kv-disk-bytes", "2000", "--data-dir",
                                              "/srv/chat"]))
    assert tiered.kv_disk_dir == "/srv/chat/kv"  # the disk tier defaults to the data directory


def test_every_engine_setting_has_a_flag_that_reaches_the_config() -> None:
    """A setting added to EngineConfig needs no CLI edit: its flag exists and sets it."""
    from typing import get_type_hints

    from chatsvc.cli import engine_config
    from engine.config import EngineConfig, literal_choices

    parser = _serve_parser()
    hints = get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        choices = literal_choices(hints[f.name])
        if f.default is True:
            argv, want = [f"--no-{flag[2:]}"], False
        elif bool in typing.get_args(hints[f.name]):  # bool | None: both spellings, unset stays None
            assert getattr(engine_config(parser.parse_args([])), f.name) is None, f.name
            argv, want = [f"--no-{flag[2:]}"], False
            assert getattr(engine_config(parser.parse_args([flag])), f.name) is True, f.name
        elif choices:
            want = next(c for c in choices if c != f.default)
            argv = [flag, str(want)]
        elif f.name in ("model", "kv_disk_dir"):
            argv, want = [flag, "/some/path"], "/some/path"
        elif f.name == "kv_disk_bytes":  # the disk tier loads through the host tier
            argv, want = [flag, "7", "--kv-host-bytes", "7"], 7
        else:
            argv, want = [flag, "7"], 7
        assert getattr(engine_config(parser.parse_args(argv)), f.name) == want, f.name


def test_every_gateway_setting_with_a_flag_defaults_to_settings_and_reaches_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A gateway default is written once, in Settings: the flag's default is the field's, and a value given on
    the command line reaches the field."""
    from chatsvc.cli import settings_from_args
    from chatsvc.settings import Settings, flag_fields

    for env in ("CHATSVC_API_KEYS", "CHATSVC_ADMIN_KEYS", "CHATSVC_METRICS_KEY"):
        monkeypatch.delenv(env, raising=False)

    parser = _serve_parser()
    fields = flag_fields()
    assert {f.metadata["flag"] for f in fields} >= {"--session-ttl", "--abort-grace", "--max-waiting-share"}
    assert settings_from_args(parser.parse_args([])) == Settings()
    path = tmp_path / "secret"  # the one optional path (--secret-file): read as the settings are built
    path.write_text("s" * 32)
    for f in fields:
        if isinstance(f.default, bool):  # --flag / --no-flag
            value = not f.default
            argv = [f.metadata["flag"] if value else "--no-" + f.metadata["flag"].removeprefix("--")]
        else:
            value = path if f.default is None else f.default * 2 + 1
            argv = [f.metadata["flag"], str(value)]
        got = settings_from_args(parser.parse_args(argv))
        assert getattr(got, f.name) == value, f.name
        assert type(getattr(got, f.name)) is type(value), f.name


def test_worker_flags_default_to_the_workers_own() -> None:
    from chatsvc.cli import add_worker_arguments
    from chatsvc.worker import DEFAULT_TTL_S, DRAIN_TIMEOUT_S

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(["--redis-url", "redis://localhost:1"])
    assert (args.heartbeat_ttl, args.drain_timeout) == (DEFAULT_TTL_S, DRAIN_TIMEOUT_S)


def test_a_secret_is_checked_at_start_and_its_absence_warned(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from chatsvc.cli import settings_from_args

    for env in ("CHATSVC_API_KEYS", "CHATSVC_ADMIN_KEYS", "CHATSVC_SECRET", "CHATSVC_SECRET_PREVIOUS"):
        monkeypatch.delenv(env, raising=False)
    parser = _serve_parser()
    with caplog.at_level("WARNING"):
        settings_from_args(parser.parse_args([]))  # no keys: the secret keys nothing, no warning
        assert "NO SERVER SECRET" not in caplog.text
        settings_from_args(parser.parse_args(["--api-key", "k"]))
        assert "NO SERVER SECRET" in caplog.text
        caplog.clear()
        monkeypatch.setenv("CHATSVC_SECRET", "s" * 32)
        settings_from_args(parser.parse_args(["--api-key", "k"]))
        assert "NO SERVER SECRET" not in caplog.text
    with pytest.raises(SystemExit, match="shorter than 32"):
        monkeypatch.setenv("CHATSVC_SECRET", "guessable")
        settings_from_args(parser.parse_args(["--api-key", "k"]))
    with pytest.raises(SystemExit, match="cannot read the secret file"):
        settings_from_args(parser.parse_args(["--api-key", "k", "--secret-file", str(tmp_path / "missing")]))


def test_sighup_rereads_the_secret_file(tmp_path: Path) -> None:
    """A rotation needs no restart: SIGHUP re-reads --secret-file at once (the periodic re-read is a minute
    away here), and the process goes on serving."""
    import redis
    from tiny_model import make_tiny_model_dir

    from chatsvc.keyring import IDENTITY_KEY

    old, new = "o" * 40, "n" * 40
    path = tmp_path / "secret"
    path.write_text(f"{old}\n")
    port = free_port()
    proc = start(make_tiny_model_dir(tmp_path), tmp_path / "data", port, "--api-key", "k", "--secret-file", str(path))
    base = f"http://127.0.0.1:{port}"
    try:
        token = httpx.post(base + "/v1/auth/token", headers={"Authorization": "Bearer k"}).json()["token"]
        bearer = {"Authorization": f"Bearer {token}"}
        assert httpx.get(base + "/v1/sessions", headers=bearer).status_code == 200
        # First the new secret beside the old (it wraps its copy of the identity key), then alone.
        path.write_text(f"{new}\n{old}\n")
        proc.send_signal(signal.SIGHUP)
        store = redis.Redis(unix_socket_path=str(tmp_path / "data" / "redis" / "redis.sock"), decode_responses=True)
        deadline = time.monotonic() + 15
        while len(store.hkeys(IDENTITY_KEY)) != 2:
            assert time.monotonic() < deadline and proc.poll() is None, "not re-wrapped for the new secret"
            time.sleep(0.1)
        path.write_text(f"{new}\n")
        proc.send_signal(signal.SIGHUP)
        while httpx.get(base + "/v1/sessions", headers=bearer).status_code != 401:
            assert time.monotonic() < deadline and proc.poll() is None, "the old secret's token still accepted"
            time.sleep(0.1)
        assert httpx.get(base + "/v1/sessions", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        stop(proc, signal.SIGTERM)
