"""chatsvc/rates.py: prefill tokens a minute per key, on a real Redis and through two live gateways sharing
it: one budget per key on every gateway, 429 with the seconds until the window has room, 413 for a prompt
larger than the whole budget, and every kind of prefill (OpenAI request, session turn over HTTP or a
WebSocket, persona write) charged before anything runs or is stored."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_engine import fake_gateways
from gateway_fixtures import LiveServer, redis_proc, redis_url  # noqa: F401
from store_fixtures import store  # noqa: F401
from websockets.sync.client import connect

from chatsvc.auth import ANON
from chatsvc.errors import APIError
from chatsvc.rates import Rates, seconds_until_room
from chatsvc.settings import Settings
from chatsvc.store import Store

KA, KB, KC = "key-a", "key-b", "key-c"
A, B, C = ({"Authorization": f"Bearer {k}"} for k in (KA, KB, KC))
LIMIT = 300


def test_seconds_until_room_follows_the_weighted_window() -> None:
    # Room already (a race lost between the charge and the look): no wait.
    assert seconds_until_room((0, 0.0, 100, 110.0), 50, LIMIT, 60) == 0
    # The previous minute's 240 weigh 240 x 30/60 = 120 now; 50 more fit once they weigh 100, in 5 s.
    assert seconds_until_room((240, 30.0, 150, 90.0), 50, LIMIT, 60) == pytest.approx(5.0)
    # This window alone has no room for 200 more: it ends in 60 s, then its 200 must decay to 100 (30 s).
    assert seconds_until_room((0, 0.0, 200, 120.0), 200, LIMIT, 60) == pytest.approx(90.0)


@pytest.mark.integration
async def test_tokens_are_charged_per_key_within_the_minute(store: Store) -> None:  # noqa: F811
    rates = Rates(dataclasses.replace(Settings(), max_prefill_tokens_per_minute=LIMIT), store.r)
    await rates.charge("k1", 200)
    with pytest.raises(APIError) as exc:
        await rates.charge("k1", 101)
    assert exc.value.status == 429 and exc.value.code == "rate_limit_exceeded"
    assert 60 < int(exc.value.headers["Retry-After"]) <= 81  # 60 s, then 200 decaying to 199
    await rates.charge("k1", 100)  # the refused charge took nothing: the rest of the budget is still there
    await rates.charge("k2", LIMIT)  # another key has its own
    with pytest.raises(APIError) as exc:
        await rates.charge("k2", LIMIT + 1, "prompt")
    assert exc.value.status == 413 and exc.value.code == "prompt_too_large" and exc.value.param == "prompt"
    for _ in range(3):
        await rates.charge(ANON, LIMIT)  # without keys there is no per-key budget
    assert await store.r.keys("chatsvc:rate:*") and not [k for k in await store.r.keys("*") if ANON in k]


SETTINGS = Settings(api_keys=(KA, KB, KC), web_dir=Path("/nonexistent"), max_pinned_fraction=1.0,
                    max_prefill_tokens_per_minute=LIMIT)


@pytest.fixture(scope="module")
def gateways(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:  # noqa: F811
    """Two gateways, each with its own engine, on one Redis database."""
    with fake_gateways(redis_proc.url.rsplit("/", 1)[0] + "/5", tmp_path_factory.mktemp("tok-rates"),
                       SETTINGS) as lives:
        yield lives


def _complete(g: LiveServer, headers: dict[str, str], tokens: int) -> httpx.Response:
    """A completion whose prompt is exactly ``tokens`` token ids."""
    return httpx.post(g.url + "/v1/completions", headers=headers, timeout=30,
                      json={"prompt": [5] * tokens, "max_tokens": 2})


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_gateways_share_one_token_budget_per_key(gateways: list[LiveServer]) -> None:
    g0, g1 = gateways
    assert _complete(g0, A, 200).status_code == 200
    submitted = len(g1.engine.submitted)  # type: ignore[attr-defined]
    r = _complete(g1, A, 200)  # the other gateway: the same key's budget, 100 left of it
    assert r.status_code == 429 and 85 <= int(r.headers["retry-after"]) <= 91
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "rate_limit_error", "param": None,
                                 "code": "rate_limit_exceeded"}
    assert len(g1.engine.submitted) == submitted  # type: ignore[attr-defined]  # the engine never saw it
    # A session turn pays its prompt (the persona's and the message's tokens): refused, nothing stored.
    sid = httpx.post(g1.url + "/v1/sessions", json={}, headers=A).json()["id"]
    r = httpx.post(f"{g1.url}/v1/sessions/{sid}/messages", json={"content": "hi"}, headers=A, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    session = httpx.get(f"{g1.url}/v1/sessions/{sid}", headers=A).json()
    assert session["messages"] == [] and not session["busy"]
    # So does a persona write's prefill: refused, not stored.
    r = httpx.put(g0.url + "/v1/personas/wordy", headers=A, json={"system_prompt": "You are wordy. " * 12})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.get(g0.url + "/v1/personas/wordy", headers=A).status_code == 404
    assert not [k for k in g0.engine.pins if k.endswith(":wordy")]  # type: ignore[attr-defined]
    assert _complete(g1, B, 200).status_code == 200  # key B has a budget of its own
    # Larger than the whole budget: it could never pass, so no Retry-After.
    r = _complete(g0, B, LIMIT + 1)
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_large" and "retry-after" not in r.headers
    assert _complete(g0, B, 100).status_code == 200


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_websocket_turn_pays_from_the_same_budget(gateways: list[LiveServer]) -> None:
    g0, g1 = gateways
    assert _complete(g0, C, LIMIT - 10).status_code == 200  # key C's minute is nearly spent, on the other gateway
    with connect(g1.ws_url + "/v1/ws", additional_headers=C) as ws:
        ws.send(json.dumps({"type": "hello"}))
        sid = json.loads(ws.recv(timeout=10))["id"]
        submitted = len(g1.engine.submitted)  # type: ignore[attr-defined]
        ws.send(json.dumps({"type": "message", "content": "Tell me a long story about the sea, please."}))
        frame = json.loads(ws.recv(timeout=10))
        assert frame["type"] == "error" and frame["code"] == "rate_limit_exceeded", frame
        ws.send(json.dumps({"type": "hello", "session_id": sid}))  # the socket stays open and usable
        view = json.loads(ws.recv(timeout=10))
    assert view["messages"] == [] and view["busy"] is False  # refused before anything was stored
    assert len(g1.engine.submitted) == submitted  # type: ignore[attr-defined]  # nor did the engine see it
