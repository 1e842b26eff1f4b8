"""One key cannot fill the engine's waiting queue: its requests admitted and still waiting for a first token may
hold at most ``max_waiting_share`` of it; past that it gets 429 + Retry-After while other keys are still queued.
A real engine process (tiny model) that runs one sequence at a time, so requests really wait in its queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import LiveServer, redis_proc, wait_personas_pinned  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
KA, KB = "key-a", "key-b"
A, B = ({"Authorization": f"Bearer {k}"} for k in (KA, KB))
ENGINE_KW: dict[str, Any] = {"dtype": "float32", "attention_backend": "torch", "block_size": 16,
                             "num_kv_blocks": 4096, "max_num_seqs": 1, "max_waiting": 8, "swap_space_mb": 0}


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    import redis as sync_redis
    from tiny_model import make_tiny_model_dir

    from chatsvc.app import create_app
    from chatsvc.settings import Settings
    from chatsvc.store import Store
    from engine.engine_process import ProcessEngine

    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-share"), arch="llama", max_position_embeddings=65536)
    eng = ProcessEngine.from_args(str(tiny), engine_threads=1, **ENGINE_KW)
    settings = Settings(api_keys=(KA, KB), web_dir=Path("/nonexistent"), max_streams_per_key=10,
                        max_waiting_share=0.25)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), settings)
    with LiveServer(app) as live:
        # A pin still queued when the test's long reply starts would wait behind it (one sequence at a time)
        # and count as a third waiting request.
        wait_personas_pinned(app)
        live.gw = app.state.gateway  # type: ignore[attr-defined]
        yield live


def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def completion(server: LiveServer, headers: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                      json={"prompt": "Hello! How are you today?", "max_tokens": 4, **body})


def test_one_key_holds_at_most_its_share_of_the_waiting_queue(server: LiveServer) -> None:
    gw = server.gw  # type: ignore[attr-defined]
    assert gw.quotas.waiting_limit() == 2  # a quarter of the engine's 8 places
    results: dict[str, httpx.Response] = {}

    def queued(name: str, headers: dict[str, str]) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(name, completion(server, headers)))
        t.start()
        return t

    with ExitStack() as stack:
        # The one sequence the engine runs: a reply too long (60,000 tokens) to end while the test queues behind
        # it, even on a loaded machine (8,000 did once, and the request meant for a 429 was admitted).
        long = stack.enter_context(httpx.stream(
            "POST", server.url + "/v1/completions", headers=A, timeout=120,
            json={"prompt": "Hi", "max_tokens": 60000, "ignore_eos": True, "stream": True}))
        assert long.status_code == 200
        lines = long.iter_lines()
        next(lines)  # generating (the iterator is kept: dropping it would close the response)
        threads = [queued("a1", A), queued("a2", A)]
        wait_until(lambda: sum(gw.quotas.waiting.values()) == 2 and gw.engine.stats().requests_waiting == 2,
                   30, "key A's two requests to wait in the engine's queue")
        refused = completion(server, A)
        assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
        error = refused.json()["error"]
        assert error["code"] == "quota_exceeded" and "waiting for the engine" in error["message"]
        # A session turn of the same key is refused alike (and stores nothing).
        sid = httpx.post(server.url + "/v1/sessions", json={}, headers=A).json()["id"]
        turn = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": "hi"}, headers=A)
        assert turn.status_code == 429 and turn.json()["error"]["code"] == "quota_exceeded"
        assert httpx.get(f"{server.url}/v1/sessions/{sid}", headers=A).json()["messages"] == []
        # Another key still finds room in the queue.
        threads.append(queued("b1", B))
        wait_until(lambda: gw.engine.stats().requests_waiting == 3, 30, "key B's request to be queued")
        assert gw.engine.stats().requests_running == 1
    # The long reply's reader left: it is aborted, and every queued request is served.
    for t in threads:
        t.join(120)
    assert {name: r.status_code for name, r in results.items()} == {"a1": 200, "a2": 200, "b1": 200}
    assert not gw.quotas.waiting
    assert completion(server, A).status_code == 200  # its share is free again
    metrics = httpx.get(server.url + "/metrics").text
    assert 'chatsvc_quota_refused_total{quota="waiting"} 2.0' in metrics
