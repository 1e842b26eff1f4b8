"""Fitting a session's history into the model's context: the oldest turns go first, the system prompt stays."""

from __future__ import annotations

from typing import Any


def fit_conversation(tokenizer: Any, system_prompt: str, history: list[dict[str, Any]], content: str,
                     max_model_len: int, room: int) -> tuple[list[int], int]:
    """(prompt ids, turns dropped): the conversation with as few of its oldest turns dropped as leaves
    ``room`` tokens to generate. When even the system prompt and the new message alone leave no room, that
    prompt is returned (the caller's context check reports it)."""
    system = [{"role": "system", "content": system_prompt}]
    user = [{"role": "user", "content": content}]
    turns = [{"role": m["role"], "content": m["content"]} for m in history]
    # Where each turn (a user message and the replies after it) starts: history is dropped turn by turn.
    starts = [0] + [i for i, m in enumerate(turns) if m["role"] == "user" and i > 0] + [len(turns)]

    def ids(dropped: int) -> list[int]:
        return list(tokenizer.apply_chat_template(system + turns[starts[dropped]:] + user,
                                                  add_generation_prompt=True))

    def fits(prompt: list[int]) -> bool:
        return len(prompt) + room <= max_model_len

    full = ids(0)
    if fits(full) or not turns:
        return full, 0
    # Fewer turns is a shorter prompt, so the fewest to drop is found by bisection (log T tokenizations).
    lo, hi = 1, len(starts) - 1
    best = ids(hi)
    if not fits(best):
        return best, hi
    while lo < hi:
        mid = (lo + hi) // 2
        prompt = ids(mid)
        if fits(prompt):
            hi, best = mid, prompt
        else:
            lo = mid + 1
    return best, hi
