"""Personas: named system prompts. Each one's chat-templated system prefix is pinned in the engine's
prefix cache while the persona exists, so every session of a persona shares the same KV blocks."""

from __future__ import annotations

import logging
from typing import Any

from chatsvc.store import Store
from engine.client import EngineClient

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


def pin_key(name: str) -> str:
    return f"persona:{name}"


class Personas:
    """Keeps the engine's pinned prefixes in step with the personas stored in Redis."""

    def __init__(self, engine: EngineClient, store: Store) -> None:
        self.engine = engine
        self.store = store
        self.pinned: dict[str, int] = {}  # persona name -> pinned tokens

    async def sync(self) -> None:
        """Seed defaults (once per Redis) and pin every stored persona."""
        await self.store.seed_personas(DEFAULT_PERSONAS)
        for name, body in (await self.store.list_personas()).items():
            await self.pin(name, body["system_prompt"])

    async def pin(self, name: str, system_prompt: str) -> int:
        if name in self.pinned:
            await self.unpin(name)
        ids = system_prefix_ids(self.engine.tokenizer, system_prompt)
        n = await self.engine.pin_prefix(pin_key(name), ids)
        self.pinned[name] = n
        log.info("persona %r: %d prompt tokens, %d pinned", name, len(ids), n)
        return n

    async def unpin(self, name: str) -> None:
        if self.pinned.pop(name, None) is not None:
            self.engine.unpin_prefix(pin_key(name))
