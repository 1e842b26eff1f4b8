"""``chatsvc bench`` against a real ``chatsvc serve`` (default model, embedded Redis, an API key): a few
sessions in each mode give a valid JSON report whose counts match what was sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from timing import scaled

from chatsvc.cli import main as chatsvc_main

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "bench-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("bench-serve")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)  # the server runs the CPU path; the interpreter only slows it
    log = tmp / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatsvc.cli", "serve", "--port", str(port), "--data-dir", str(tmp / "data"),
             "--api-key", API_KEY, "--num-kv-blocks", "256", "--dtype", "bfloat16", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + scaled(180)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"chatsvc serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"chatsvc serve not ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", ["ws", "sse", "openai"])
def test_bench_counts_match_against_real_server(server_url: str, mode: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    sessions, turns, max_tokens = 2, 2, 4
    rc = chatsvc_main(["bench", "--url", server_url, "--mode", mode, "--api-key", API_KEY,
                       "--sessions", str(sessions), "--turns", str(turns), "--max-tokens", str(max_tokens),
                       "--ignore-eos", "--max-prompt-chars", "200", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    n = sessions * turns
    assert (r["requests"], r["completed"], r["errors"], r["cancelled"]) == (n, n, {}, 0)
    # ignore_eos + max_tokens fixes every reply's length; the server's usage reports it.
    assert r["total_output_tokens"] == n * max_tokens
    assert r["token_count_source"] == {"usage": n}
    assert r["output_tok_s"] == pytest.approx(n * max_tokens / r["duration_s"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert r[k]["p50"] > 0 and r[k]["p50"] <= r[k]["p99"]
    assert r["ttft_ms"]["p50"] < r["e2e_ms"]["p50"]
    assert r["total_prompt_tokens"] > 0


def test_wrong_key_is_counted_as_errors(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    rc = chatsvc_main(["bench", "--url", server_url, "--mode", "sse", "--api-key", "wrong", "--sessions", "2",
                       "--turns", "2", "--json", str(out), "--no-progress"])
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["requests"] == 2 and r["completed"] == 0 and r["errors"] == {"http_401": 2}
