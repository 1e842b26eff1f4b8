"""Work kept off the event loop: while a worst-case allowed request runs (a long prompt, a non-streamed
reply with every logprob the cap allows) and while an oversized one is refused, /health keeps answering
within 200 ms. The real SmolLM2 tokenizer (49k vocabulary) with the fake engine, so the test measures the
gateway, not the model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from gateway_fixtures import LiveServer, default_model_path, redis_proc  # noqa: F401
from timing import scaled

from chatsvc.app import create_app
from chatsvc.offload import TokenTexts, dumps_in_pieces
from chatsvc.settings import Settings
from chatsvc.store import Store, session_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
HEALTH_BUDGET_S = 0.2
# The test machine's cores are shared, so a probe thread is sometimes not scheduled for a while: most probes
# must answer within the budget (scaled to this machine's speed and load, tests/timing.py) and none may take
# a stall's worth (a blocked loop fails both).
STALL_S = 1.0


def assert_responsive(latencies: list[float]) -> None:
    within = sum(t < scaled(HEALTH_BUDGET_S) for t in latencies) / len(latencies)
    assert within >= 0.9 and max(latencies) < STALL_S, sorted(latencies)[-5:]


@pytest.fixture(scope="module")
def server(redis_proc) -> Iterator[LiveServer]:  # noqa: F811
    from engine.tokenizer import Tokenizer

    engine = FakeEngine(Tokenizer.from_gguf(default_model_path()), max_model_len=8192)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60),
                     Settings(web_dir=Path("/nonexistent"), max_pinned_fraction=1.0))
    with LiveServer(app) as live:
        live.engine = engine  # type: ignore[attr-defined]
        yield live


def _health_while(server: LiveServer, request: dict[str, object] | Callable[[], httpx.Response]
                  ) -> tuple[httpx.Response, list[float]]:
    """Run ``request`` (a chat completion's body, or a call) while another client polls /health; (its
    response, every /health latency)."""
    result: list[httpx.Response] = []

    def heavy() -> None:
        if callable(request):
            result.append(request())
        else:
            result.append(httpx.post(server.url + "/v1/chat/completions", json=request, timeout=120))

    t = threading.Thread(target=heavy)
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        probe.get("/health")  # the connection is open before the clock starts
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    t.join()
    return result[0], latencies


def test_health_answers_while_a_huge_prompt_is_refused(server: LiveServer) -> None:
    content = "hello world, how are you? " * 40_000  # ~1 MB: tokenizing it would take seconds
    r, lat = _health_while(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert_responsive(lat)


def test_health_answers_while_a_long_prompt_is_tokenized(server: LiveServer) -> None:
    content = "hello world, how are you? " * 24_000  # 624k characters: about as long as the pre-check lets through
    r, lat = _health_while(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # counted, then refused
    assert "the prompt has" in r.json()["error"]["message"]
    assert_responsive(lat)


def test_health_answers_while_the_largest_logprobs_reply_is_built(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 1190, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20}
    # The fake engine yields to the loop between steps, as a real engine's deltas arrive from its thread.
    server.engine.step_s = 0.0005  # type: ignore[attr-defined]
    try:
        r, lat = _health_while(server, body)
    finally:
        server.engine.reset()  # type: ignore[attr-defined]
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 8 and all(len(c["logprobs"]["content"]) == 1190 for c in choices)
    assert len(choices[0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    assert_responsive(lat)


def test_health_answers_while_a_session_turn_fits_a_huge_history(server: LiveServer, redis_proc) -> None:  # noqa: F811
    import redis as sync_redis

    from engine.tokenizer import Tokenizer

    # A session with 300 turns of 8k-character messages (5 MB: seconds to tokenize whole), as the server
    # stores them (each with its token count), then one more message: its turn drops the oldest turns.
    sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
    text = ("hello world, how are you? " * 400)[:8_000]
    tokens = len(Tokenizer.from_gguf(default_model_path()).encode(text))
    history = [json.dumps({"role": role, "content": text, "created": 0.0, "tokens": tokens})
               for _ in range(300) for role in ("user", "assistant")]
    r = sync_redis.Redis.from_url(redis_proc.url)
    r.rpush(session_key(sid) + ":messages", *history)
    r.hset(session_key(sid), "user_messages", 300)  # the count the store keeps beside the list

    def heavy() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": text, "max_tokens": 8},
                          timeout=120)

    r, lat = _health_while(server, heavy)
    assert r.status_code == 200, r.text
    done = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")][-1]
    assert done["type"] == "done" and done["truncated_turns"] > 290
    assert_responsive(lat)


def test_logprob_volume_is_capped_for_non_streamed_requests(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 4000, "logprobs": True,
            "top_logprobs": 20}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "stream it" in r.json()["error"]["message"]
    assert server.engine.running == set()  # type: ignore[attr-defined]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "n": 8, "max_tokens": 4000, "logprobs": 20},
                   timeout=60)
    assert r.status_code == 400


def test_dumps_in_pieces_is_json_dumps() -> None:
    obj = {"a": [{"t": i, "b": list(range(i % 5)), "s": "é\n"} for i in range(300)], "u": None, "n": [{"x": [1]}],
           "f": 0.5, "k": {"5": 1.0}}
    assert dumps_in_pieces(obj) == json.dumps(obj)


def test_each_token_is_decoded_once() -> None:
    calls: list[list[int]] = []

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(ids)
            return f"<{ids[0]}>"

    texts = TokenTexts(Tok())
    assert [texts(t) for t in (5, 6, 5, 5, 6)] == ["<5>", "<6>", "<5>", "<5>", "<6>"]
    assert calls == [[5], [6]]


def test_raw_parts_are_inserted_as_they_are() -> None:
    from chatsvc.offload import Raw

    entry = {"token": "a", "top": [1, 2]}
    obj = {"choices": [{"logprobs": {"content": [Raw(json.dumps(entry))] * 3}}]}
    assert json.loads(dumps_in_pieces(obj)) == {"choices": [{"logprobs": {"content": [entry] * 3}}]}


def test_a_persona_prompt_is_tokenized_off_the_event_loop(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.engine.tokenizer  # type: ignore[attr-defined]
    real = tokenizer.apply_chat_template
    seen: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    r = httpx.put(server.url + "/v1/personas/loop-check", json={"system_prompt": "You answer tersely. " * 20})
    assert r.status_code in (200, 201), r.text
    assert seen and all(name.startswith("chatsvc-cpu") for name in seen), seen
