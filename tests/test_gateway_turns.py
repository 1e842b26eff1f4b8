"""TurnRegistry.follow_json on a real Redis: replay from an event id, and an explicit end when a reply's
stream stops without its done/error event (e.g. the server restarted mid-reply); a turn's prompt, read
from its history's tail, against the real model; and the hand-off of a draining registry's running turn to
another registry (a fake engine whose requests outlive the registry that started them)."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from fake_engine import FakeEngine, Submitted, tiny_tokenizer
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import append_event, store  # noqa: F401

from chatsvc.metrics import Metrics
from chatsvc.schemas import SessionMessage
from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.store.keys import instance_key, messages_key, stream_key
from chatsvc.turns import HEARTBEAT_S, TurnRegistry, event_id
from engine.protocol import RequestDelta


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
    # A short context and short replies keep each turn cheap; the messages are sized to them so that, as with
    # a longer context, two earlier turns fit beside the new message and the tail reads go past the first.
    max_len, reply_tokens = 256, 4
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
            content = f"Question {turn}: " + " ".join(["tell me about the sea and the ships on it"] * (2 + turn % 4))
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


class WorkerLikeEngine(FakeEngine):
    """A FakeEngine whose requests outlive the registry that started them, as engine workers' do (``Adoptable``):
    another registry adopts one after the tokens its first registry passed on, and gets the same rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: list[str] = []
        self.adopted: list[tuple[str, int]] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def adopt(self, request_id: str, after_tokens: int) -> AsyncIterator[RequestDelta] | None:
        sub = self.submitted.get(request_id)
        if sub is None:
            return None
        self.adopted.append((request_id, after_tokens))
        return self._rest(sub, after_tokens)

    async def _rest(self, sub: Submitted, after: int) -> AsyncIterator[RequestDelta]:
        out = self.completion_ids(sub.params.ignore_eos, sub.max_tokens)
        reason = self.finish_reason(sub.params.ignore_eos, sub.max_tokens)
        for step in range(after, len(out)):
            await asyncio.sleep(self.step_s)
            last = step == len(out) - 1
            yield RequestDelta(request_id=sub.request_id, index=0, text=self.tokenizer.decode([out[step]]),
                               token_ids=[out[step]], finished=last, finish_reason=reason if last else None,
                               logprobs=None, prompt_tokens=len(sub.prompt_token_ids), completion_tokens=step + 1,
                               cached_tokens=0, request_finished=last)


async def _eventually(cond: Callable[[], bool | Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _value(cond()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _value(v: bool | Awaitable[bool]) -> bool:
    return await v if inspect.isawaitable(v) else v


async def _registries(engine: FakeEngine, redis_url: str, names: tuple[str, ...]) -> list[TurnRegistry]:  # noqa: F811
    regs = [TurnRegistry(engine, Store.from_url(redis_url, 60, 30, instance=n), Metrics(engine), Settings())
            for n in names]
    for reg in regs:
        await reg.open()
    return regs


async def _close(regs: list[TurnRegistry]) -> None:
    for reg in regs:
        await reg.shutdown()
        await reg.store.close()


async def test_a_drained_registry_hands_its_running_turn_to_another_that_finishes_it(
        redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    engine = WorkerLikeEngine(tiny_tokenizer(tmp_path), step_s=0.01)
    await engine.start()
    a, b = await _registries(engine, redis_url, ("gw-a", "gw-b"))
    try:
        meta = await a.store.create_session("owner", "tutor", "You are terse.")
        at = await a.start(meta, SessionMessage(content="hi", max_tokens=300, ignore_eos=True))
        await _eventually(lambda: len(at.log) >= 5, 10)
        assert await a.hand_off() == 1
        assert engine.released == [at.request_id] and not a.active  # let go, not aborted
        assert await a.store.r.get(instance_key("gw-a")) is None  # dead to B now, not a heartbeat's TTL later
        assert await a.store.readers(meta.id, at.turn) == 1  # its reader's place, while the client moves over
        events = [json.loads(f["e"]) for _, f in await a.store.r.xrange(stream_key(meta.id, at.turn))]
        relayed = sum(ev["tokens"] for ev in events)
        assert 0 < relayed < 300

        async def stored() -> bool:
            return bool(await b.store.r.llen(messages_key(meta.id)) == 2)

        await _eventually(stored, HEARTBEAT_S + 10)  # B's next keep-alive beat takes the turn over
        assert engine.adopted == [(at.request_id, relayed)]
        reply = json.loads(await b.store.r.lindex(messages_key(meta.id), 1))
        want = "".join(engine.tokenizer.decode([t]) for t in engine.completion_ids(True, 300))
        assert (reply["finish_reason"], reply["tokens"], reply["content"]) == ("length", 300, want)
        events = [json.loads(f["e"]) for _, f in await b.store.r.xrange(stream_key(meta.id, at.turn))]
        assert [ev["type"] for ev in events].count("done") == 1 and events[-1]["type"] == "done"
        assert sum(ev.get("tokens", 0) for ev in events[:-1]) == 300  # every token once across the hand-off
    finally:
        await _close([a, b])


async def test_nothing_is_handed_off_that_no_other_registry_could_take(redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    tok = tiny_tokenizer(tmp_path)
    for engine, names in ((FakeEngine(tok, 4096, step_s=0.01), ("gw-a", "gw-b")),  # its requests end with it
                          (WorkerLikeEngine(tok, 4096, step_s=0.01), ("gw-a",))):  # no other gateway alive
        await engine.start()
        regs = await _registries(engine, redis_url, names)
        try:
            meta = await regs[0].store.create_session("owner", "tutor", "You are terse.")
            at = await regs[0].start(meta, SessionMessage(content="hi", max_tokens=2000, ignore_eos=True))
            await _eventually(lambda at=at: len(at.log) >= 5, 10)
            assert await regs[0].hand_off() == 0
            assert regs[0].active == {meta.id: at} and not at.fenced
            assert await regs[0].store.r.get(instance_key("gw-a")) == regs[0].store.nonce
        finally:
            await _close(regs)
        reply = json.loads(redis.Redis.from_url(redis_url).lindex(messages_key(meta.id), 1))
        assert reply["finish_reason"] == "interrupted" and 0 < reply["tokens"] < 2000  # cut, as before
