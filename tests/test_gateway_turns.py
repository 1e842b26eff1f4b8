"""TurnRegistry.follow_json on a real Redis: replay from an event id, and an explicit end when a reply's
stream stops without its done/error event (e.g. the server restarted mid-reply); and a turn's prompt, read
from its history's tail, against the real model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.turns import TurnRegistry, event_id


def _registry(store: Store) -> TurnRegistry:  # noqa: F811
    # No engine or metrics: follow_json() only reads the stream and the registry of active turns.
    return TurnRegistry(None, store, None, Settings())  # type: ignore[arg-type]


async def test_follow_replays_after_an_event_id_and_stops_at_done(store: Store) -> None:  # noqa: F811
    sid = "s-follow"
    first = await append_event(store, sid, 1, {"type": "delta", "text": "Hel"})
    await append_event(store, sid, 1, {"type": "delta", "text": "lo"})
    await append_event(store, sid, 1, {"type": "done", "finish_reason": "stop", "usage": {}})
    await append_event(store, sid, 1, {"type": "delta", "text": "never read"})
    events = [ev async for _, ev, _ in _registry(store).follow_json(sid, 1, first)]
    assert [e["type"] for e in events] == ["delta", "done"]
    assert events[0]["text"] == "lo"


async def test_follow_reports_a_stream_that_ended_without_done(store: Store) -> None:  # noqa: F811
    sid = "s-orphan"
    last = await append_event(store, sid, 2, {"type": "delta", "text": "partial"})
    got = [(eid, ev) async for eid, ev, _ in _registry(store).follow_json(sid, 2, "0")]
    assert [ev["type"] for _, ev in got] == ["delta", "error"]
    assert got[-1][1]["code"] == "stream_ended"
    assert got[-1][0] == event_id(2, last)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_long_conversation_gets_the_reply_the_whole_history_would_give(redis_proc, monkeypatch) -> None:  # noqa: F811
    """The real model, a conversation several times its context, tails read from the shortest (two
    messages) and retention trimming the oldest turns: every turn's prompt is the one fitting the whole
    history gives (what the gateway built before it read tails), and so is its greedy reply."""
    import asyncio

    import httpx
    import redis as sync_redis
    import torch
    from gateway_fixtures import LiveServer, default_model_path, wait_personas_pinned

    from chatsvc import history
    from chatsvc.app import create_app
    from chatsvc.history import fit_conversation
    from engine.async_engine import AsyncEngine

    torch.set_num_threads(1)
    monkeypatch.setattr(history, "FIRST_TAIL", 2)
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    max_len, reply_tokens = 512, 16
    engine = AsyncEngine.from_args(model=default_model_path(), dtype="float32", num_kv_blocks=256, max_model_len=max_len)
    app = create_app(engine, Store.from_url(redis_proc.url), Settings(history_max_messages=6))
    with LiveServer(app) as live:
        wait_personas_pinned(app)
        sid = httpx.post(live.url + "/v1/sessions", json={"persona": "tutor"}).json()["id"]
        meta = asyncio.run(Store.from_url(redis_proc.url).meta_of(sid))  # the prompt as the session holds it
        assert meta is not None
        whole: list[dict[str, Any]] = []
        dropped_seen = 0
        for turn in range(1, 15):
            content = f"Question {turn}: " + " ".join(["tell me about the sea and the ships on it"] * (10 + turn % 4))
            want, dropped = fit_conversation(engine.tokenizer, meta.system_prompt, whole, content, max_len, reply_tokens)
            with httpx.stream("POST", f"{live.url}/v1/sessions/{sid}/messages", timeout=120,
                              json={"content": content, "max_tokens": reply_tokens, "temperature": 0}) as r:
                done = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")][-1]
            assert done["type"] == "done", done
            assert done["usage"]["prompt_tokens"] == len(want), turn
            assert done.get("truncated_turns", 0) == dropped, turn
            greedy = httpx.post(live.url + "/v1/completions", timeout=120, json={
                "prompt": want, "max_tokens": reply_tokens, "temperature": 0}).json()
            assert done["message"]["content"] == greedy["choices"][0]["text"], turn
            whole += [{"role": "user", "content": content}, {"role": "assistant", "content": done["message"]["content"]}]
            dropped_seen = dropped
        view = httpx.get(f"{live.url}/v1/sessions/{sid}").json()
    assert dropped_seen >= 8  # far past the context
    assert view["trimmed_messages"] > 0 and view["message_count"] == len(whole)  # and retention trimmed
