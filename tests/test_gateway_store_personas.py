"""chatsvc/store/personas.py on a real Redis: shared personas seeded once, each owner's apart, the owner limit."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fixtures import redis_proc, redis_url  # noqa: F401
from store_fixtures import store  # noqa: F401

from chatsvc.store import Store
from chatsvc.store.personas import SEEDED_FIELD, PersonaLimitReached


async def test_personas_seed_once_and_deletion_sticks(store: Store) -> None:  # noqa: F811
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    assert list(await store.list_personas()) == ["a"]
    assert await store.delete_persona("a")
    await store.seed_personas({"a": {"system_prompt": "A", "description": ""}})
    assert await store.list_personas() == {}
    assert await store.put_persona("b", {"system_prompt": "B", "description": "d"})
    assert not await store.put_persona("b", {"system_prompt": "B2", "description": "d"})
    assert (await store.get_persona("b") or {})["system_prompt"] == "B2"
    # The flag lives in the hash (one key: one cluster slot) and is never a persona.
    assert await store.r.hget("chatsvc:personas", SEEDED_FIELD) == "1"
    assert await store.get_persona(SEEDED_FIELD) is None


async def test_an_owners_personas_are_apart_from_the_shared_ones_and_listed_by_name(
        store: Store) -> None:  # noqa: F811
    await store.put_persona("tutor", {"system_prompt": "shared", "description": ""})
    assert await store.put_persona("zed", {"system_prompt": "z", "description": ""}, "alice")
    assert await store.put_persona("tutor", {"system_prompt": "mine", "description": ""}, "alice")
    assert list(await store.list_personas("alice")) == ["tutor", "zed"]
    assert (await store.get_persona("tutor", "alice") or {})["system_prompt"] == "mine"
    assert (await store.get_persona("tutor") or {})["system_prompt"] == "shared"
    assert await store.get_persona("zed", "bob") is None and await store.list_personas("bob") == {}
    assert await store.r.hlen("chatsvc:owner:alice:personas") == 2
    assert await store.delete_persona("tutor", "alice")
    assert not await store.delete_persona("tutor", "alice")
    assert await store.get_persona("tutor") is not None


async def test_an_owner_at_the_limit_may_replace_but_not_add(store: Store) -> None:  # noqa: F811
    for name in ("a", "b"):
        await store.put_persona(name, {"system_prompt": name, "description": ""}, "o", limit=2)
    assert not await store.put_persona("a", {"system_prompt": "a2", "description": ""}, "o", limit=2)
    with pytest.raises(PersonaLimitReached):
        await store.put_persona("c", {"system_prompt": "c", "description": ""}, "o", limit=2)
    assert list(await store.list_personas("o")) == ["a", "b"]


async def test_concurrent_puts_cannot_pass_the_owner_limit(store: Store) -> None:  # noqa: F811
    results = await asyncio.gather(*(store.put_persona(f"p{i}", {"system_prompt": "x", "description": ""}, "o",
                                                       limit=4) for i in range(12)), return_exceptions=True)
    assert sum(r is True for r in results) == 4
    assert all(isinstance(r, PersonaLimitReached) for r in results if r is not True)
    stored = await store.list_personas("o")
    assert len(stored) == 4
    assert await store.persona_room(next(iter(stored)), "o", 4)  # replacing one of them is always allowed
    assert not await store.persona_room("new", "o", 4)
