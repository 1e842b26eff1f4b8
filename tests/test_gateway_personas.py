from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as sync_redis
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

from chatsvc.app import create_app
from chatsvc.personas import DEFAULT_PERSONA, DEFAULT_PERSONAS, pin_key, system_prefix_ids
from chatsvc.settings import Settings
from chatsvc.store import Store
from chatsvc.turns import event_id, parse_event_id


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from tiny_model import make_tiny_tokenizer

    from engine.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


def test_system_prefix_is_a_prefix_of_every_conversation(tokenizer) -> None:
    prompt = DEFAULT_PERSONAS["pirate"]["system_prompt"]
    prefix = system_prefix_ids(tokenizer, prompt)
    assert len(prefix) > 10
    for turns in ([{"role": "user", "content": "hi"}],
                  [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}]):
        full = tokenizer.apply_chat_template([{"role": "system", "content": prompt}, *turns])
        assert full[: len(prefix)] == prefix
    other = system_prefix_ids(tokenizer, DEFAULT_PERSONAS["tutor"]["system_prompt"])
    assert other != prefix


def test_defaults_include_the_default_persona() -> None:
    assert DEFAULT_PERSONA in DEFAULT_PERSONAS
    assert all(p["system_prompt"] and p["description"] for p in DEFAULT_PERSONAS.values())


def test_event_ids_round_trip() -> None:
    assert parse_event_id(event_id(3, "17-2")) == (3, "17-2")
    assert parse_event_id("17-2") == (None, "17-2")
    assert parse_event_id(None) == (None, "0")
    assert parse_event_id("4:") == (4, "0")


# -- each key's share of the pins (a real tiny engine and Redis behind a live gateway) ----------------------
ADMIN, KA, KB, KC = "admin-key", "key-a", "key-b", "key-c"
H = {k: {"Authorization": f"Bearer {k}"} for k in (ADMIN, KA, KB, KC)}
BLOCK = 16
NUM_BLOCKS = 128
# The pin budget is 96 blocks; each key's own personas hold at most a quarter of it (24 blocks, three of
# the 8-block personas below). The three default shared personas pin 31 blocks.
SHARE_SETTINGS = {"max_pinned_fraction": 0.75, "max_pinned_share_per_key": 0.25}


@pytest.fixture(scope="module")
def pins_server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    from tiny_model import make_tiny_model_dir

    from engine.async_engine import AsyncEngine

    url = redis_proc.url.rsplit("/", 1)[0] + "/4"
    sync_redis.Redis.from_url(url).flushdb()
    engine = AsyncEngine.from_args(model=str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))),
                                   num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=512)
    settings = Settings(api_keys=(KA, KB, KC), admin_keys=(ADMIN,), **SHARE_SETTINGS)
    app = create_app(engine, Store.from_url(url, 3600, 60), settings)
    with LiveServer(app) as live:
        gw = app.state.gateway
        deadline = time.monotonic() + 60
        while len(gw.personas.pinned) < len(DEFAULT_PERSONAS) and time.monotonic() < deadline:
            time.sleep(0.05)
        live.gw = gw  # type: ignore[attr-defined]
        yield live


def _prompt(blocks: int, word: str, tok: Any) -> str:
    """A system prompt whose chat-templated prefix is exactly ``blocks`` full blocks."""
    text = word
    while len(system_prefix_ids(tok, text)) < blocks * BLOCK:
        text += "x"
    assert len(system_prefix_ids(tok, text)) == blocks * BLOCK
    return text


def _put(server: LiveServer, key: str, name: str, blocks: int) -> httpx.Response:
    tok = server.gw.engine.tokenizer  # type: ignore[attr-defined]
    return httpx.put(f"{server.url}/v1/personas/{name}", headers=H[key], timeout=60,
                     json={"system_prompt": _prompt(blocks, f"{key} {name} says", tok)})


def _pinned(server: LiveServer) -> set[str]:
    return set(server.gw.personas.pinned)  # type: ignore[attr-defined]


def _own_key(server: LiveServer, key: str, name: str) -> str:
    return pin_key(name, server.gw.auth.check_key(key))  # type: ignore[attr-defined]


def _clear_own(server: LiveServer) -> None:
    for key in (KA, KB, KC):
        for p in httpx.get(server.url + "/v1/personas", headers=H[key]).json()["data"]:
            if p["scope"] == "own":
                assert httpx.delete(f"{server.url}/v1/personas/{p['name']}", headers=H[key]).status_code == 200


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_key_past_its_share_unpins_only_its_own_least_recently_used(pins_server: LiveServer) -> None:
    shared = {pin_key(n) for n in DEFAULT_PERSONAS}
    assert _pinned(pins_server) == shared
    try:
        for name in ("b0", "b1", "b2"):
            r = _put(pins_server, KB, name, 8)
            assert r.status_code == 201 and r.json()["pinned"] and r.json()["pinned_tokens"] == 8 * BLOCK
        assert httpx.get(pins_server.url + "/v1/personas/b0", headers=H[KB]).status_code == 200  # b1 is now LRU
        # The budget has room (31 + 32 of 96 blocks), but b3 would take key B past its 24.
        r = _put(pins_server, KB, "b3", 8)
        assert r.status_code == 201 and r.json()["pinned"]
        assert _pinned(pins_server) == shared | {_own_key(pins_server, KB, n) for n in ("b0", "b2", "b3")}
        listed = {p["name"]: p for p in httpx.get(pins_server.url + "/v1/personas", headers=H[KB]).json()["data"]}
        assert listed["b1"]["pinned"] is False and listed["b1"]["pinned_tokens"] == 0  # still stored
        assert all(listed[n]["pinned"] for n in ("b0", "b2", "b3", *DEFAULT_PERSONAS))
    finally:
        _clear_own(pins_server)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_key_cannot_unpin_another_keys_or_the_shared_pins(pins_server: LiveServer) -> None:
    try:
        for key, names in ((KB, ("b0", "b1", "b2")), (KC, ("c0", "c1", "c2"))):
            for name in names:
                assert _put(pins_server, key, name, 8).json()["pinned"]
        others = _pinned(pins_server)
        assert len(others) == 9  # 31 + 24 + 24 = 79 of 96 blocks
        # 20 blocks are within key A's share but not within what the others leave: stored, not pinned, and
        # nobody else's pin is touched.
        r = _put(pins_server, KA, "big", 20)
        assert r.status_code == 201 and r.json()["pinned"] is False and r.json()["pinned_tokens"] == 0
        assert _pinned(pins_server) == others
        got = httpx.get(pins_server.url + "/v1/personas/big", headers=H[KA]).json()
        assert got["scope"] == "own" and got["pinned"] is False
        sid = httpx.post(pins_server.url + "/v1/sessions", json={"persona": "big"}, headers=H[KA]).json()["id"]
        r = httpx.post(f"{pins_server.url}/v1/sessions/{sid}/messages", json={"content": "hi", "max_tokens": 2},
                       headers=H[KA], timeout=60)
        assert r.status_code == 200 and '"done"' in r.text  # an unpinned persona still works
        # Once the budget is full, key A makes room only among its own pins.
        for name in ("a0", "a1"):
            assert _put(pins_server, KA, name, 8).json()["pinned"]
        r = _put(pins_server, KA, "a2", 8)  # 79 + 16 + 8 > 96: a0, A's least recently used, goes
        assert r.json()["pinned"]
        assert _pinned(pins_server) == others | {_own_key(pins_server, KA, n) for n in ("a1", "a2")}
        # Larger than key A's whole share (though not the whole budget): refused, nothing stored.
        r = _put(pins_server, KA, "huge", 26)
        assert r.status_code == 413 and r.json()["error"]["code"] == "persona_too_large"
        assert httpx.get(pins_server.url + "/v1/personas/huge", headers=H[KA]).status_code == 404
        assert _pinned(pins_server) == others | {_own_key(pins_server, KA, n) for n in ("a1", "a2")}
    finally:
        _clear_own(pins_server)
