"""Fitting a session's history into the model's context: the oldest turns go first, the system prompt stays.

A turn reads only the newest messages it can use (:func:`fit_stored_history`): tails growing until the
context is full or the history is exhausted, with exactly the prompt the whole history would give."""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable
from typing import Any

from chatsvc.store.sessions import MessagePage
from chatsvc.tools import chat_prompt_ids

TEMPLATE_TOKENS = 5  # what the chat template adds around one message (<|im_start|>role\n ... <|im_end|>\n)
CHARS_PER_TOKEN = 3  # a guess for a stored message without its token count


def _guessed_tokens(message: dict[str, Any]) -> int:
    """A message's tokens as the store recorded them (a user message's count, a reply's completion tokens),
    plus the template's; only a guess to start the search from, never trusted for the result."""
    tokens = message.get("tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        tokens = len(str(message.get("content", ""))) // CHARS_PER_TOKEN
    return tokens + TEMPLATE_TOKENS


def fit_conversation(tokenizer: Any, system_prompt: str, history: list[dict[str, Any]],
                     message: str | dict[str, Any], max_model_len: int, room: int,
                     tools: list[dict[str, Any]] | None = None) -> tuple[list[int], int]:
    """(prompt ids, turns dropped): the conversation with as few of its oldest turns dropped as leaves
    ``room`` tokens to generate. ``message``: the new one (text: a user message); ``tools``: shown to the
    model (chatsvc.tools renders them, the history's tool calls and its tool results). When even the system prompt and the new message alone leave no room, that
    prompt is returned (the caller's context check reports it).

    A long history is never tokenized whole: the search starts from the turn the stored token counts
    point to, and only prompts near the context's size are tokenized (a few of them), so the work is
    bounded by the context, not by the history's length."""
    system: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
    user = [{"role": "user", "content": message} if isinstance(message, str) else message]
    turns: list[dict[str, Any]] = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in m} for m in history]
    # Where each turn (a user message and the replies after it) starts: history is dropped turn by turn. A
    # tool result belongs to the user turn whose reply called the tool: they go together.
    starts = [0] + [i for i, m in enumerate(turns) if m["role"] == "user" and i > 0] + [len(turns)]
    last = len(starts) - 1  # every turn dropped
    prompts: dict[int, list[int]] = {}

    def ids(dropped: int) -> list[int]:
        if dropped not in prompts:
            prompts[dropped] = chat_prompt_ids(tokenizer, system + turns[starts[dropped]:] + user, tools)
        return prompts[dropped]

    def fits(dropped: int) -> bool:
        return len(ids(dropped)) + room <= max_model_len

    guesses = [_guessed_tokens(m) for m in history]
    # Usually the whole history fits: one tokenization, when it is not so long that trying costs much.
    if not turns or (sum(guesses) <= 2 * max_model_len and fits(0)):
        return ids(0), 0
    if not fits(last):  # more turns only make it longer
        return ids(last), last
    # The fewest turns to drop by the stored counts: the kept turns' guessed tokens fit what is left.
    budget = max_model_len - room - len(ids(last))
    guess, kept = last, 0
    while guess > 0:
        kept += sum(guesses[starts[guess - 1]:starts[guess]])
        if kept > budget:
            break
        guess -= 1
    # The exact answer: the fewest dropped that fits (fitting is monotone in the turns dropped). Invariant:
    # fits(hi), and nothing below lo fits. Gallop from the guess, then bisect.
    lo, hi = (1 if 0 in prompts else 0), last
    if fits(guess):
        hi, step = guess, 1
        while hi - step >= lo:
            if not fits(hi - step):
                lo = hi - step + 1
                break
            hi, step = hi - step, step * 2
    else:
        lo, step = guess + 1, 1
        while lo + step - 1 < hi:
            if fits(lo + step - 1):
                hi = lo + step - 1
                break
            lo, step = lo + step, step * 2
    hi = lo + bisect.bisect_left(range(lo, hi), True, key=fits)
    return ids(hi), hi


FIRST_TAIL = 32  # messages a turn reads first; each further read takes four times as many
TAIL_GROWTH = 4


def whole_turns(page: MessagePage) -> list[dict[str, Any]]:
    """The page's messages from its first user message on: a tail cut inside a turn would make that turn's
    rest a turn of its own, which the whole history does not have. The whole history is kept as it is."""
    if page.first_index == 0:
        return page.messages
    first = next((i for i, m in enumerate(page.messages) if m.get("role") == "user"), len(page.messages))
    return page.messages[first:]


async def fit_stored_history(
        read: Callable[[int], Awaitable[MessagePage]],
        fit: Callable[[list[dict[str, Any]]], Awaitable[tuple[list[int], int]]],
        first: int | None = None) -> tuple[list[int], int, list[dict[str, Any]]]:
    """(prompt ids, turns dropped, the messages read): :func:`fit_conversation` (``fit``) of the stored
    history's newest turns, read with ``read(n)`` (the newest ``n`` messages, user messages counted) in
    tails growing until one does not fit whole or no older message is stored.

    Exact: fitting is monotone in the turns dropped, so when a tail does not fit whole, keeping any older
    turn would not fit either, and the fewest turns to drop are found inside the tail. Turns dropped count
    the whole conversation's, trimmed ones included (its user messages before the tail, each a turn's start)."""
    n = first or FIRST_TAIL
    while True:
        page = await read(n)
        history = whole_turns(page)
        ids, dropped = await fit(history)
        if dropped > 0 or not page.has_more:
            before = 0 if page.first_index == 0 else page.user_messages - sum(m.get("role") == "user" for m in history)
            return ids, before + dropped, history
        n *= TAIL_GROWTH
