"""Personas: named system prompts. Each one's chat-templated system prefix is pinned in the engine's
prefix cache, so every session of a persona shares the same KV blocks.

Shared personas (written by admin keys) are visible to everyone; any other key's personas are its own
(``owner:{owner}:personas`` in Redis), so names never collide across owners and an owner's persona shadows
a shared one of the same name for that owner only. Pins may hold at most ``max_pinned_fraction`` of the
KV pool. A shared persona's pin may unpin any least recently used pin to fit; a key's own personas hold at
most ``max_pinned_share_per_key`` of that budget and make room only by unpinning that key's own least
recently used pins, so no key can push out another key's pins or the shared ones. A persona that finds no
room is stored unpinned (it still works, its prefix is just not kept); one that alone would exceed its
budget (the key's share, or the whole budget for a shared one) is refused before anything is stored.

A shared persona's prompt is computed and pinned without a cache salt, and every owner's requests that start
with it share those blocks; an owner's own persona is computed and pinned under the owner's salt, so only
that owner's requests hit it (chatsvc.cache_isolation)."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from chatsvc.cache_isolation import CacheIsolation
from chatsvc.errors import APIError
from chatsvc.offload import Offload
from chatsvc.rates import Rates
from chatsvc.settings import Settings
from chatsvc.store.personas import PersonaLimitReached, PersonaStore
from engine.client import EngineClient
from engine.protocol import QueueFullError

log = logging.getLogger("chatsvc.personas")

DEFAULT_PERSONA = "assistant"

DEFAULT_PERSONAS: dict[str, dict[str, str]] = {
    "assistant": {
        "description": "A concise, helpful general assistant.",
        "system_prompt": (
            "You are a helpful assistant. Answer clearly and concisely. If you are not sure about "
            "something, say so instead of guessing. Prefer short paragraphs and plain language, and "
            "use lists only when they make the answer easier to follow."
        ),
    },
    "pirate": {
        "description": "Answers like a friendly pirate.",
        "system_prompt": (
            "You are a cheerful pirate captain who has sailed the seven seas. Answer every question "
            "helpfully, but speak like a pirate: say 'arr' and 'matey', talk about your ship and your "
            "crew, and keep your answers short and good-humoured."
        ),
    },
    "tutor": {
        "description": "A patient teacher who explains step by step.",
        "system_prompt": (
            "You are a patient tutor. Explain ideas step by step with a simple example, check the "
            "student's understanding with a short question at the end, and never make the student "
            "feel bad for not knowing something."
        ),
    },
}


def system_prefix_ids(tokenizer: Any, system_prompt: str) -> list[int]:
    """Token ids every conversation with this system prompt starts with.

    The system-only template and a conversation template are compared rather than trusting the
    system-only rendering: a template may end the system turn differently when more follows.
    """
    system = [{"role": "system", "content": system_prompt}]
    alone = tokenizer.apply_chat_template(system, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(system + [{"role": "user", "content": "x"}], add_generation_prompt=True)
    n = 0
    for a, b in zip(alone, full, strict=False):
        if a != b:
            break
        n += 1
    return list(full[:n])


SHARED = "shared"


def _persona_limit(limit: int) -> APIError:
    return APIError(403, f"at most {limit} personas per key", code="persona_limit_reached")


def pin_key(name: str, owner: str | None = None) -> str:
    """The engine's pin key: ``persona:{name}`` for a shared persona, ``persona:{owner}:{name}`` for an owner's."""
    return f"persona:{name}" if owner is None else f"persona:{owner}:{name}"


class Personas:
    """Persona storage by scope, and the engine's pinned prefixes kept in step with it under a pool cap."""

    def __init__(self, engine: EngineClient, store: PersonaStore, settings: Settings,
                 offload: Offload, isolation: CacheIsolation, rates: Rates | None = None) -> None:
        self.engine = engine
        self.rates = rates  # charges a write's prefill to its key
        self.isolation = isolation
        self.store = store
        self.settings = settings
        self.offload = offload  # where a PUT's prompt is tokenized (off the event loop)
        # pin key -> pinned tokens, least recently used first; and the owner of each key's own pin.
        self.pinned: OrderedDict[str, int] = OrderedDict()
        self.pin_owners: dict[str, str] = {}

    # -- storage ----------------------------------------------------------------------------------
    async def get(self, owner: str, name: str) -> tuple[str, dict[str, str]] | None:
        """(scope, body) of the persona ``owner`` sees under ``name`` (their own first); marks it used."""
        own = await self.store.get_persona(name, owner)
        if own is not None:
            self._touch(pin_key(name, owner))
            return owner, own
        body = await self.store.get_persona(name)
        if body is None:
            return None
        self._touch(pin_key(name))
        return SHARED, body

    async def visible(self, owner: str) -> list[dict[str, Any]]:
        own = await self.store.list_personas(owner)
        shared = await self.store.list_personas()
        out = [{"name": n, **b, "scope": "own", "pinned": pin_key(n, owner) in self.pinned,
                "pinned_tokens": self.pinned.get(pin_key(n, owner), 0)} for n, b in own.items()]
        out += [{"name": n, **b, "scope": SHARED, "pinned": pin_key(n) in self.pinned,
                 "pinned_tokens": self.pinned.get(pin_key(n), 0)} for n, b in shared.items() if n not in own]
        return out

    async def put(self, owner: str, admin: bool, name: str, body: dict[str, str]) -> tuple[bool, int]:
        """Store and pin a persona (shared when written by an admin); (created, pinned tokens).

        Everything that can refuse it runs first, so a refused persona leaves nothing behind."""
        ids = await self.offload.run(system_prefix_ids, self.offload.tokenizer, body["system_prompt"])
        context = self.engine.max_model_len
        if len(ids) >= context:
            raise APIError(400, f"the persona's prompt is {len(ids)} tokens; the context is {context}",
                           code="context_length_exceeded", param="system_prompt")
        if self._blocks(len(ids)) > self._budget_blocks(None if admin else owner):
            what = ("the share of the KV cache personas may pin" if admin
                    else "this key's share of the KV cache personas may pin")
            raise APIError(413, f"the persona's prompt ({len(ids)} tokens) alone exceeds {what}",
                           code="persona_too_large", param="system_prompt")
        key = pin_key(name) if admin else pin_key(name, owner)
        limit = self.settings.max_personas_per_key
        if not admin and not await self.store.persona_room(name, owner, limit):
            raise _persona_limit(limit)
        if self.rates is not None:
            await self.rates.charge(owner, len(ids), "system_prompt")
        # Pinned before it is stored: a prefill the engine refuses (queue full, engine down) leaves no
        # persona behind; one the store then refuses is unpinned again.
        try:
            pinned = await self._pin(key, ids, None if admin else self.isolation.salt(owner),
                                     None if admin else owner)
        except QueueFullError:
            raise APIError(429, "the server is at capacity; retry shortly", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        try:
            created = await (self.store.put_persona(name, body) if admin
                             else self.store.put_persona(name, body, owner, limit=limit))
        except BaseException as exc:
            self._unpin(key)
            if isinstance(exc, PersonaLimitReached):
                raise _persona_limit(limit) from None
            raise
        if admin:
            self.isolation.share(name, ids)
        return created, pinned

    async def delete(self, owner: str, admin: bool, name: str) -> bool:
        """Delete the caller's own persona of that name, else (admins only) the shared one."""
        if await self.store.delete_persona(name, owner):
            self._unpin(pin_key(name, owner))
            return True
        if not admin:
            if await self.store.get_persona(name) is not None:
                raise APIError(403, "shared personas can only be changed with an admin key",
                               code="admin_required")
            return False
        if await self.store.delete_persona(name):
            self._unpin(pin_key(name))
            self.isolation.unshare(name)
            return True
        return False

    def session_pin_key(self, owner: str, name: str) -> str:
        """The pin a session of ``owner`` with persona ``name`` uses (their own persona shadows a shared one)."""
        own = pin_key(name, owner)
        return own if own in self.pinned else pin_key(name)

    # -- pins -------------------------------------------------------------------------------------
    async def sync(self) -> None:
        """Seed defaults (once per Redis) and pin every shared persona; one that fails is skipped (logged), so
        a bad stored persona never stops the others. Owners' personas are pinned when written."""
        await self.store.seed_personas(DEFAULT_PERSONAS)
        for name, body in (await self.store.list_personas()).items():
            try:
                # At start-up, before most traffic: on the loop, where the tokenizer is already warm.
                ids = system_prefix_ids(self.engine.tokenizer, body["system_prompt"])
                if len(ids) >= self.engine.max_model_len:
                    raise ValueError(f"{len(ids)} prompt tokens do not fit the context ({self.engine.max_model_len})")
                self.isolation.share(name, ids)
                await self._pin(pin_key(name), ids)
            except Exception as exc:  # noqa: BLE001 - whatever is wrong with one persona, the rest are pinned
                log.error("persona %r not pinned: %s", name, exc)

    async def _pin(self, key: str, ids: list[int], cache_salt: str | None = None, owner: str | None = None) -> int:
        """Pin ``ids`` under ``key`` (``owner``'s own pin, else a shared one) and return the tokens pinned: 0
        when no room can be made for it within the rules above."""
        self._unpin(key)
        need = self._blocks(len(ids))
        if need > self._budget_blocks(owner):
            log.warning("%s: %d prompt tokens exceed the pin cap; not pinned", key, len(ids))
            return 0
        if owner is not None:
            # Over its share, and then over the whole budget, a key gives up only its own pins.
            self._unpin_lru([k for k in self.pinned if self.pin_owners.get(k) == owner],
                            lambda: self._pinned_blocks(owner) + need > self._budget_blocks(owner))
            self._unpin_lru([k for k in self.pinned if self.pin_owners.get(k) == owner],
                            lambda: self._pinned_blocks() + need > self._cap_blocks())
            if self._pinned_blocks() + need > self._cap_blocks():
                log.info("%s: no room among this key's own pins; stored unpinned", key)
                return 0
        else:
            self._unpin_lru(list(self.pinned), lambda: self._pinned_blocks() + need > self._cap_blocks())
        n = await self.engine.pin_prefix(key, ids, cache_salt)
        self.pinned[key] = n
        if owner is not None:
            self.pin_owners[key] = owner
        log.info("%s: %d prompt tokens, %d pinned", key, len(ids), n)
        return n

    def _unpin_lru(self, candidates: list[str], over: Callable[[], bool]) -> None:
        """Unpin ``candidates`` (least recently used first) while ``over()``."""
        for victim in candidates:
            if not over():
                return
            log.info("unpinning %s (least recently used) to stay under the pin cap", victim)
            self._unpin(victim)

    def _unpin(self, key: str) -> None:
        self.pin_owners.pop(key, None)
        if self.pinned.pop(key, None) is not None:
            self.engine.unpin_prefix(key)

    def _touch(self, key: str) -> None:
        if key in self.pinned:
            self.pinned.move_to_end(key)

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.engine.kv_snapshot().block_size)

    def _pinned_blocks(self, owner: str | None = None) -> int:
        """Blocks pinned in all (``owner``: by that key's own personas)."""
        return sum(self._blocks(n) for k, n in self.pinned.items()
                   if owner is None or self.pin_owners.get(k) == owner)

    def _budget_blocks(self, owner: str | None) -> int:
        """The most one pin may take: the whole pin budget for a shared persona, a key's share for its own."""
        cap = self._cap_blocks()
        return cap if owner is None else int(cap * self.settings.max_pinned_share_per_key)

    def _cap_blocks(self) -> int:
        total = self.engine.stats().kv_blocks_total
        if total <= 0:  # the pool size is not known yet (no stats published): nothing to measure against
            return 1 << 30
        return int(total * self.settings.max_pinned_fraction)
