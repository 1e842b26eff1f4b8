"""Tenancy and admin rights: shared personas need an admin key, every key has its own personas, pins are
capped (a key's own LRU past its share, 413 for one alone over it, nothing stored when refused), a bad stored persona
does not stop the others at start-up, and /v1/kv names only the caller's own requests."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
from fake_engine import FakeEngine, tiny_tokenizer
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

from chatsvc.app import create_app
from chatsvc.personas import pin_key
from chatsvc.settings import Settings
from chatsvc.store import Store, session_key
from chatsvc.store.keys import prompt_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ADMIN, KA, KB = "admin-key", "key-a", "key-b"
H = {k: {"Authorization": f"Bearer {k}"} for k in (ADMIN, KA, KB)}
BLOCK = 16
NUM_BLOCKS = 64  # the default cap (25%) is 16 blocks = 256 tokens


def tiny_engine(tmp: Path) -> Any:
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_args(model=str(make_tiny_model_dir(tmp)), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                                 max_model_len=512)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


def settings(**kw: Any) -> Settings:
    return Settings(api_keys=(KA, KB), admin_keys=(ADMIN,), **kw)


def wait_synced(app: Any) -> None:
    deadline = time.monotonic() + 30
    while not app.state.gateway.personas.pinned and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(redis_proc, tiny_dir: Path) -> Iterator[LiveServer]:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    engine = tiny_engine(tiny_dir)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), settings(max_personas_per_key=3))
    with LiveServer(app) as live:
        wait_synced(app)
        live.redis = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)  # type: ignore[attr-defined]
        live.engine = engine  # type: ignore[attr-defined]
        live.gw = app.state.gateway  # type: ignore[attr-defined]
        yield live


def prompt(tokens: int, tok: Any, word: str = "sun") -> str:
    """A system prompt whose pinned prefix is about ``tokens`` long with this tokenizer."""
    text = word
    while len(tok.encode(text)) < tokens:
        text += f" {word}"
    return text


def put(server: LiveServer, key: str, name: str, system_prompt: str) -> httpx.Response:
    return httpx.put(f"{server.url}/v1/personas/{name}", json={"system_prompt": system_prompt}, headers=H[key],
                     timeout=60)


def names(server: LiveServer, key: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(server.url + "/v1/personas", headers=H[key]).json()["data"]
    return {p["name"]: p for p in data}


def test_shared_personas_need_an_admin_key(server: LiveServer) -> None:
    shared_before = server.redis.hget("chatsvc:personas", "tutor")  # type: ignore[attr-defined]
    r = httpx.delete(server.url + "/v1/personas/tutor", headers=H[KA])
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    # An ordinary key's PUT of a shared name makes its own persona: the shared one is untouched for everyone.
    assert put(server, KA, "tutor", "You are KA's private tutor.").status_code == 201
    assert server.redis.hget("chatsvc:personas", "tutor") == shared_before  # type: ignore[attr-defined]
    assert names(server, KA)["tutor"]["scope"] == "own"
    assert names(server, KB)["tutor"]["scope"] == "shared"
    assert "private" not in names(server, KB)["tutor"]["system_prompt"]
    # The admin writes the shared one, which every key then sees.
    r = put(server, ADMIN, "house", "You are the house style.")
    assert r.status_code == 201 and r.json()["scope"] == "shared"
    assert names(server, KB)["house"]["scope"] == "shared"
    assert httpx.delete(server.url + "/v1/personas/house", headers=H[ADMIN]).status_code == 200
    assert "house" not in names(server, KB)
    assert httpx.delete(server.url + "/v1/personas/tutor", headers=H[KA]).status_code == 200  # KA's own
    assert names(server, KA)["tutor"]["scope"] == "shared"


def test_owner_personas_do_not_collide(server: LiveServer) -> None:
    assert put(server, KA, "mine", "You are A's helper.").status_code == 201
    assert put(server, KB, "mine", "You are B's helper.").status_code == 201
    for key, who in ((KA, "A's"), (KB, "B's")):
        assert who in httpx.get(f"{server.url}/v1/personas/mine", headers=H[key]).json()["system_prompt"]
        sid = httpx.post(server.url + "/v1/sessions", json={"persona": "mine"}, headers=H[key]).json()["id"]
        sha = server.redis.hget(session_key(sid), "prompt_sha")  # type: ignore[attr-defined]
        assert who in server.redis.get(prompt_key(sha))  # type: ignore[attr-defined]
    for key in (KA, KB):
        assert httpx.delete(f"{server.url}/v1/personas/mine", headers=H[key]).status_code == 200


def test_personas_per_key_are_capped(server: LiveServer) -> None:
    for i in range(3):
        assert put(server, KB, f"p{i}", f"Persona {i}.").status_code == 201
    r = put(server, KB, "p3", "One too many.")
    assert r.status_code == 403 and r.json()["error"]["code"] == "persona_limit_reached"
    assert put(server, KB, "p0", "Replacing is fine.").status_code == 200
    assert put(server, KA, "p3", "Another key has its own allowance.").status_code == 201
    for i in range(3):
        httpx.delete(f"{server.url}/v1/personas/p{i}", headers=H[KB])
    httpx.delete(f"{server.url}/v1/personas/p3", headers=H[KA])


def test_refused_personas_store_nothing(server: LiveServer) -> None:
    tok = server.engine.tokenizer  # type: ignore[attr-defined]
    before = server.redis.dbsize()  # type: ignore[attr-defined]
    keys_before = server.redis.keys("*")  # type: ignore[attr-defined]
    pinned_before = dict(server.gw.personas.pinned)  # type: ignore[attr-defined]
    too_long = prompt(600, tok)
    assert len(too_long) < 16_000
    r = put(server, KA, "huge", too_long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = put(server, ADMIN, "big", prompt(300, tok))  # fits the context, but alone exceeds 16 blocks
    assert r.status_code == 413 and r.json()["error"]["code"] == "persona_too_large"
    assert server.redis.dbsize() == before and server.redis.keys("*") == keys_before  # type: ignore[attr-defined]
    assert dict(server.gw.personas.pinned) == pinned_before  # type: ignore[attr-defined]


def _pinned_blocks(server: LiveServer) -> int:
    return sum(len(b) for b in server.engine.kv_snapshot().pins.values())  # type: ignore[attr-defined]


def test_pins_stay_under_the_cap_least_recently_used_first(server: LiveServer) -> None:
    """A key's own pins hold at most half the pin budget (8 blocks here): past it its least recently used pin
    goes, and another key's pins never make it go."""
    tok = server.engine.tokenizer  # type: ignore[attr-defined]
    cap = NUM_BLOCKS // 4
    pins = server.gw.personas.pinned  # type: ignore[attr-defined]
    for name, word in (("p-a", "alpha"), ("p-b", "beta")):
        r = put(server, KA, name, prompt(2 * BLOCK, tok, word))
        assert r.status_code == 201 and r.json()["pinned"] and r.json()["pinned_tokens"] >= 2 * BLOCK
    owner = server.gw.auth.check_key(KA)  # type: ignore[attr-defined]
    assert list(pins)[-2:] == [pin_key("p-a", owner), pin_key("p-b", owner)]
    # Using p-a makes p-b the least recently used of the two.
    assert httpx.post(server.url + "/v1/sessions", json={"persona": "p-a"}, headers=H[KA]).status_code == 201
    r = put(server, KA, "p-c", prompt(3 * BLOCK, tok, "gamma"))
    assert r.status_code == 201 and r.json()["pinned"]
    assert pin_key("p-b", owner) not in pins and pin_key("p-a", owner) in pins
    # Another key's pin finds room among its own pins or none: key A's stay.
    put(server, KB, "p-d", prompt(3 * BLOCK, tok, "delta"))
    assert pin_key("p-a", owner) in pins and pin_key("p-c", owner) in pins
    time.sleep(0.5)  # unpins reach the engine thread asynchronously
    assert sum(-(-n // BLOCK) for n in pins.values()) <= cap
    assert _pinned_blocks(server) <= cap
    # An unpinned persona still works.
    sid = httpx.post(server.url + "/v1/sessions", json={"persona": "p-b"}, headers=H[KA]).json()["id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", json={"content": "hi", "max_tokens": 2},
                   headers=H[KA], timeout=60)
    assert r.status_code == 200 and '"done"' in r.text


def test_a_bad_stored_persona_does_not_stop_the_others(redis_proc, tiny_dir: Path,  # noqa: F811
                                                       caplog: pytest.LogCaptureFixture) -> None:
    r = sync_redis.Redis.from_url(redis_proc.url, decode_responses=True)
    r.flushdb()
    r.hset("chatsvc:personas", ":seeded", "1")  # the defaults count as seeded: only these are stored
    r.hset("chatsvc:personas", mapping={"aaa-broken": json.dumps({"description": "no prompt"}),
                                        "aab-too-long": json.dumps({"system_prompt": "word " * 2000}),
                                        "zzz-fine": json.dumps({"system_prompt": "You are fine."})})
    engine = tiny_engine(tiny_dir)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), settings())
    with caplog.at_level(logging.ERROR, logger="chatsvc.personas"), LiveServer(app):
        wait_synced(app)
        assert list(app.state.gateway.personas.pinned) == [pin_key("zzz-fine")]
    assert "aaa-broken" in caplog.text and "aab-too-long" in caplog.text


def test_kv_shows_only_the_callers_requests(redis_proc, tmp_path: Path) -> None:  # noqa: F811
    sync_redis.Redis.from_url(redis_proc.url).flushdb()
    engine = FakeEngine(tiny_tokenizer(tmp_path), step_s=0.05)
    app = create_app(engine, Store.from_url(redis_proc.url, 3600, 60), settings(max_pinned_fraction=1.0))
    with LiveServer(app) as live:
        wait_synced(app)
        sid = httpx.post(live.url + "/v1/sessions", json={"persona": "pirate"}, headers=H[KA]).json()["id"]
        started = threading.Event()

        def talk() -> None:
            with httpx.stream("POST", f"{live.url}/v1/sessions/{sid}/messages", headers=H[KA], timeout=60,
                              json={"content": "hi", "max_tokens": 60, "ignore_eos": True}) as resp:
                for _ in resp.iter_lines():
                    started.set()

        t = threading.Thread(target=talk)
        t.start()
        try:
            assert started.wait(30)
            rid = f"{sid}-1"
            mine = httpx.get(live.url + "/v1/kv", headers=H[KA]).json()
            theirs = httpx.get(live.url + "/v1/kv", headers=H[KB]).json()
            assert rid in mine["requests"]
            assert rid not in json.dumps(theirs) and sid not in json.dumps(theirs)
            assert len(theirs["requests"]) == len(mine["requests"]) >= 1  # still drawn, under opaque labels
            # A session of another key cannot be picked out either.
            picked = httpx.get(f"{live.url}/v1/kv?session_id={sid}", headers=H[KB])
            assert picked.status_code == 404
        finally:
            t.join(30)
