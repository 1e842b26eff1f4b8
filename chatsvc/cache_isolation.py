"""Prefix-cache isolation between owners (vLLM's ``cache_salt``).

The engine's prefix cache finds a prompt's leading blocks by the hash of their tokens, and every reply says
how many prompt tokens it found there (``usage.prompt_tokens_details.cached_tokens``). Unsalted, that count
lets one key confirm guesses of another key's private persona or recent prompts a block at a time. So every
request carries its owner's salt (``Auth.cache_salt``: an HMAC of the owner id under a key derived from the
server secret, never the owner id itself), and only requests of the same owner hit its blocks.

A shared persona's prompt is the same for every owner and pinned once: the leading blocks that lie wholly
inside it hash without a salt (``SamplingParams.shared_prefix_tokens``), so every owner reads the pinned
blocks. The block that holds the persona's last tokens together with the owner's first ones is salted: at
block granularity the boundary falls at the last full block of the persona's prompt, which is exactly what
its pin holds. An owner's own persona is computed and pinned under the owner's salt.
"""

from __future__ import annotations

import dataclasses

from chatsvc.auth import Auth
from engine.request import SamplingParams


class CacheIsolation:
    """Each owner's salt, and the shared personas' prompts that every owner's requests may share."""

    def __init__(self, auth: Auth) -> None:
        self.auth = auth
        self._shared: dict[str, tuple[int, ...]] = {}  # shared persona name -> its prompt's token ids

    def salt(self, owner: str) -> str:
        return self.auth.cache_salt(owner)

    def share(self, name: str, token_ids: list[int]) -> None:
        """A shared persona's prompt: requests that start with it share its blocks whoever sends them."""
        self._shared[name] = tuple(token_ids)

    def unshare(self, name: str) -> None:
        self._shared.pop(name, None)

    def shared_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """Leading tokens of ``prompt_ids`` that are a shared persona's whole prompt (0 if none is)."""
        return max((len(ids) for ids in self._shared.values() if tuple(prompt_ids[: len(ids)]) == ids), default=0)

    def apply(self, owner: str, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
        """``params`` salted for ``owner``, the shared persona prompt it starts with left unsalted."""
        return dataclasses.replace(params, cache_salt=self.salt(owner),
                                   shared_prefix_tokens=self.shared_prefix_tokens(prompt_ids))
