"""End to end on the real model: ``chatsvc serve --engine redis`` (a gateway with no model) and one
``chatsvc worker`` process against one Redis; a two-turn session over HTTP routes its second turn back to the
worker (a prefix-cache hit), /metrics shows the routing and the worker, and the gateway never loads torch."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_fixtures import default_model_path, free_port, redis_proc, redis_url  # noqa: F401
from scaleout_workers import WorkerProc
from serve_process import Serve, sse_json
from timing import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def stack(redis_url: str) -> Iterator[tuple[Serve, WorkerProc]]:  # noqa: F811
    model = default_model_path()
    worker = WorkerProc(redis_url, model, "real", "--engine", "thread", "--engine-threads", "1", "--kv-cache-mb",
                        "64", "--max-model-len", "1024")
    gateway = Serve(model, free_port(), redis_url, "--engine", "redis")
    try:
        gateway.start()  # ready once the worker, loading meanwhile, has registered
        worker.wait_registered()
        yield gateway, worker
    finally:
        gateway.stop()
        worker.terminate()


def mapped_libraries(pid: int) -> set[str]:
    return {line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/" in line}


def test_a_session_through_a_gateway_without_a_model(stack: tuple[Serve, WorkerProc]) -> None:
    gateway, worker = stack
    base = gateway.url
    sid = httpx.post(base + "/v1/sessions", json={}, timeout=10).json()["id"]
    done = []
    for content in ("Name one planet.", "And one more?"):
        with httpx.stream("POST", f"{base}/v1/sessions/{sid}/messages", timeout=120,
                          json={"content": content, "max_tokens": 8, "temperature": 0}) as r:
            assert r.status_code == 200, r.read()
            events = list(sse_json(r))
        assert events[-1]["type"] == "done", events[-1]
        assert "".join(e.get("text", "") for e in events if e["type"] == "delta") == events[-1]["message"]["content"]
        done.append(events[-1])
    assert all(d["message"]["content"] for d in done)
    # The second turn's prompt starts with the whole first turn, computed on this worker: full blocks hit.
    first_len = done[0]["usage"]["prompt_tokens"] + done[0]["usage"]["completion_tokens"]
    assert done[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= (first_len - 1) // 16 * 16 - 16 > 0
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert re.search(r'chatsvc_route_decisions_total\{reason="session"\} 1\.0', metrics), metrics
    assert f'chatsvc_worker_kv_blocks_free{{worker="{worker.id}"}}' in metrics
    hops = re.search(r"^chatsvc_worker_hop_entries_total (\S+)$", metrics, re.M)
    assert hops and float(hops.group(1)) >= 2  # every output entry's Redis hop is measured
    ready = httpx.get(base + "/ready", timeout=10)
    assert ready.status_code == 200
    # The model-less gateway speaks the engine protocol only: after serving both turns, /metrics and /ready,
    # no torch library is mapped into its process (the worker's has it).
    assert not {lib for lib in mapped_libraries(gateway.proc.pid) if "torch" in lib}
    assert {lib for lib in mapped_libraries(worker.proc.pid) if "libtorch" in lib}
    assert worker.terminate() == 0  # SIGTERM: drains (nothing running) and leaves
    deadline = time.monotonic() + scaled(5)  # the gateway notices the missing heartbeat
    while (ready := httpx.get(base + "/ready", timeout=10)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.status_code == 503 and ready.headers["Retry-After"]
