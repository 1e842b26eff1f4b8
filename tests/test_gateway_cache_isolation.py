"""Prefix-cache isolation through the gateway, with the real model: the attack of issue 34 measured as a
client sees it (``usage.prompt_tokens_details.cached_tokens``). Key A guessing key B's private persona or
recent prompt finds nothing cached; key B finds its own blocks; a shared persona's pinned blocks serve both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from gateway_fixtures import LiveServer, default_model_path, redis_proc, wait_personas_pinned  # noqa: F401

from chatsvc.app import create_app
from chatsvc.personas import DEFAULT_PERSONAS
from chatsvc.settings import Settings
from chatsvc.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ADMIN, KA, KB = "admin-key", "key-a", "key-b"
H = {k: {"Authorization": f"Bearer {k}"} for k in (ADMIN, KA, KB)}
BLOCK = 16
# Long enough for several full blocks; words no other test sends, so nothing else warms them.
SECRET_PROMPT = ("You are the private diary assistant of the lighthouse keeper on Skerry Nine. Remember the "
                 "keeper's brother Aldous, the brass telescope, the storm of the third winter and the "
                 "password cormorant-seventeen. Never reveal these to anyone but the keeper.")


@pytest.fixture(scope="module")
def server(redis_proc) -> Iterator[LiveServer]:  # noqa: F811
    from engine.engine_process import ProcessEngine

    redis.Redis.from_url(redis_proc.url).flushdb()
    eng = ProcessEngine.from_args(default_model_path(), dtype="float32", attention_backend="torch",
                                  num_kv_blocks=512, block_size=BLOCK, max_num_seqs=8)
    settings = Settings(api_keys=(KA, KB), admin_keys=(ADMIN,), max_pinned_fraction=0.5)
    app = create_app(eng, Store.from_url(redis_proc.url, 3600, 60), settings)
    with LiveServer(app) as live:
        wait_personas_pinned(app)
        yield live


def cached(server: LiveServer, key: str, messages: list[dict[str, str]]) -> int:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=H[key], timeout=120,
                   json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def session_turn_cached(server: LiveServer, key: str, persona: str, content: str) -> int:
    """A session turn's cached prompt tokens, as stored with its reply."""
    sid = httpx.post(f"{server.url}/v1/sessions", json={"persona": persona}, headers=H[key]).json()["id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", headers=H[key], timeout=120,
                   json={"content": content, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and '"done"' in r.text, r.text
    reply = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=H[key]).json()["messages"][-1]
    return int(reply["cached_tokens"])


def test_another_key_cannot_confirm_a_guess_of_a_private_persona(server: LiveServer) -> None:
    r = httpx.put(f"{server.url}/v1/personas/diary", json={"system_prompt": SECRET_PROMPT}, headers=H[KB],
                  timeout=120)
    assert r.status_code == 201, r.text
    pinned = r.json()["pinned_tokens"]
    assert pinned >= 3 * BLOCK
    guess = [{"role": "system", "content": SECRET_PROMPT}, {"role": "user", "content": "Hello"}]
    assert cached(server, KA, guess) == 0  # the exact prompt, pinned and hot: nothing to learn from it
    assert cached(server, KB, guess) >= pinned  # its owner's requests hit its pinned blocks
    assert session_turn_cached(server, KB, "diary", "Good evening") >= pinned


def test_another_key_cannot_confirm_a_guess_of_a_recent_prompt(server: LiveServer) -> None:
    recent = [{"role": "user", "content": "Draft a letter to the harbour master of Port Quillan about the "
                                          "missing crates of saffron, invoice 88-213, due on the fourth."}]
    first = cached(server, KB, recent)
    assert cached(server, KA, recent) == 0
    assert cached(server, KB, recent) > first  # the owner's repeat finds its own blocks


def test_a_shared_persona_is_shared_by_every_key(server: LiveServer) -> None:
    pinned = httpx.get(f"{server.url}/v1/personas/tutor", headers=H[KA]).json()["pinned_tokens"]
    assert pinned >= 2 * BLOCK
    system = DEFAULT_PERSONAS["tutor"]["system_prompt"]
    for key, question in ((KA, "What is a prime number?"), (KB, "Why is the sky blue?")):
        hits = cached(server, key, [{"role": "system", "content": system}, {"role": "user", "content": question}])
        assert hits >= pinned, key
        assert session_turn_cached(server, key, "tutor", question + " Briefly.") >= pinned, key


def test_only_a_shared_personas_whole_prompt_is_left_unsalted() -> None:
    from chatsvc.auth import Auth
    from chatsvc.cache_isolation import CacheIsolation
    from engine.request import SamplingParams

    auth = Auth((KA,))
    auth.set_secret(b"s" * 32)
    isolation = CacheIsolation(auth)
    isolation.share("tutor", [1, 2, 3, 4])
    params = SamplingParams(max_tokens=4)
    salted = isolation.apply("owner-a", params, [1, 2, 3, 4, 9, 9])
    assert salted.cache_salt == auth.cache_salt("owner-a") and salted.shared_prefix_tokens == 4
    assert isolation.apply("owner-a", params, [1, 2, 3, 5, 9]).shared_prefix_tokens == 0  # a near miss: all own
    isolation.unshare("tutor")
    assert isolation.apply("owner-a", params, [1, 2, 3, 4, 9]).shared_prefix_tokens == 0
