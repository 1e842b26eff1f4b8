"""Warm on intent: when a client opens a session (WebSocket ``hello``, ``GET /v1/sessions/{id}``), the engine
is asked to bring the KV blocks of the session's history up its tiers (disk to host memory, host memory to
the pool) before the next message arrives, so that message's first token does not wait for the disk.

A hint, never a cost to the caller: it runs as a task of its own, tokenizes off the event loop, and any
failure is logged and forgotten (the message then restores or recomputes as it would have). One warm per
session at a time here, and the engine keeps one per session in flight (engine.kv_tiers ``warm``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from chatsvc.cache_isolation import CacheIsolation
from chatsvc.history import TEMPLATE_TOKENS
from chatsvc.offload import Offload
from chatsvc.store import SessionMeta, Store
from chatsvc.tools import chat_prompt_ids
from engine.client import EngineClient

log = logging.getLogger("chatsvc.warm")


def history_prompt_ids(tokenizer: Any, system_prompt: str, history: list[dict[str, Any]]) -> list[int]:
    """The tokens the session's next prompt starts with (``chatsvc.history.fit_conversation`` renders the same
    messages, then the new one and the generation prompt), when no turn has to be dropped to fit."""
    turns: list[dict[str, Any]] = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in m}
                                   for m in history]
    return chat_prompt_ids(tokenizer, [{"role": "system", "content": system_prompt}, *turns],
                           add_generation_prompt=False)


class SessionWarmer:
    def __init__(self, engine: EngineClient, store: Store, offload: Offload | None = None,
                 isolation: CacheIsolation | None = None) -> None:
        self.engine = engine
        self.store = store
        self.offload = offload
        self.isolation = isolation  # the owner's salt, which the session's requests carry
        self.in_flight: dict[str, asyncio.Task[None]] = {}

    def warm(self, meta: SessionMeta) -> None:
        """Start warming ``meta``'s history (the caller has checked it owns the session); returns at once."""
        if meta.id in self.in_flight:
            return
        task = asyncio.create_task(self._warm(meta), name=f"warm-{meta.id}")
        self.in_flight[meta.id] = task
        task.add_done_callback(lambda _: self.in_flight.pop(meta.id, None))

    async def _warm(self, meta: SessionMeta) -> None:
        try:
            # Each message is at least TEMPLATE_TOKENS: a history of more than this is past the context.
            page = await self.store.message_page(meta.id, self.engine.max_model_len // TEMPLATE_TOKENS + 1)
            history = page.messages
            if not history or page.has_more or page.trimmed:
                return
            # A history past the context is cut when the next prompt is fitted: its blocks would not match.
            guessed = sum(len(str(m.get("content") or "")) // 4 + TEMPLATE_TOKENS for m in history)
            if guessed > self.engine.max_model_len:
                return
            tok = self.engine.tokenizer

            def tokenize() -> list[int]:
                return history_prompt_ids(tok, meta.system_prompt, history)

            ids = await (self.offload.run(tokenize) if self.offload is not None else asyncio.to_thread(tokenize))
            if len(ids) >= self.engine.max_model_len:
                return
            if self.isolation is None:
                self.engine.warm_prefix(meta.id, ids)
            else:
                self.engine.warm_prefix(meta.id, ids, self.isolation.salt(meta.owner),
                                        self.isolation.shared_prefix_tokens(ids))
        except Exception as exc:  # noqa: BLE001 - a hint: the next message restores or recomputes as before
            log.warning("could not warm session %s: %r", meta.id, exc)


__all__ = ["SessionWarmer", "history_prompt_ids"]
