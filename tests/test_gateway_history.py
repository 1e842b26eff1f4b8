"""chatsvc/history.py: a session's history is cut from its oldest turn until the reply has room; a turn reads
only the tail of it that it needs, with the same result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from chatsvc.history import fit_conversation, fit_stored_history
from chatsvc.store.sessions import MessagePage


class WordTokenizer:
    """One token per word plus two per message: enough to make lengths predictable."""

    def __init__(self) -> None:
        self.calls = 0

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
        self.calls += 1
        ids: list[int] = []
        for m in messages:
            ids += [1] + [len(w) for w in m["content"].split()] + [2]
        return ids + ([3] if add_generation_prompt else [])


def turns(n: int, words: int = 10) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out.append({"role": "user", "content": " ".join([f"u{i}"] * words)})
        out.append({"role": "assistant", "content": " ".join([f"a{i}"] * words)})
    return out


def test_a_history_that_fits_is_kept_whole() -> None:
    tok = WordTokenizer()
    prompt, dropped = fit_conversation(tok, "sys", turns(3), "hello", max_model_len=200, room=16)
    assert dropped == 0 and len(prompt) == 2 + 1 + 6 * 12 + 3 + 1
    assert tok.calls == 1


def test_the_fewest_oldest_turns_are_dropped_and_the_system_prompt_stays() -> None:
    tok = WordTokenizer()
    history = turns(6)  # each turn: 24 tokens
    full, _ = fit_conversation(tok, "be brief", history, "hello", max_model_len=10_000, room=0)
    limit = len(full) - 24 * 2 + 10  # room for all but the two oldest turns, with 10 tokens spare
    prompt, dropped = fit_conversation(tok, "be brief", history, "hello", max_model_len=limit, room=10)
    assert dropped == 2
    assert len(prompt) + 10 <= limit
    assert prompt[:4] == [1, 2, 5, 2]  # the system message is still first
    # one turn fewer dropped would not have fitted
    assert len(full) - 24 + 10 > limit


def test_when_nothing_but_the_new_message_fits_every_turn_is_dropped() -> None:
    tok = WordTokenizer()
    prompt, dropped = fit_conversation(tok, "sys", turns(4), "a long new message " * 20, max_model_len=50, room=10)
    assert dropped == 4
    assert prompt == tok.apply_chat_template([{"role": "system", "content": "sys"},
                                              {"role": "user", "content": "a long new message " * 20}],
                                             add_generation_prompt=True)


def fewest_dropped(tok: WordTokenizer, system: str, history: list[dict[str, Any]], content: str, max_model_len: int,
                   room: int) -> int:
    """The reference: try every number of oldest turns dropped, fewest first."""
    n = len(history) // 2
    for k in range(n + 1):
        msgs = [{"role": "system", "content": system}, *history[2 * k:], {"role": "user", "content": content}]
        if len(tok.apply_chat_template(msgs, add_generation_prompt=True)) + room <= max_model_len:
            return k
    return n


def test_stored_counts_only_guide_the_search_the_answer_is_exact() -> None:
    import random

    rng = random.Random(7)
    for case in range(300):
        history = []
        for i in range(rng.randrange(1, 30)):
            for role in ("user", "assistant"):
                words = rng.randrange(1, 40)
                msg: dict[str, Any] = {"role": role, "content": " ".join([f"{role[0]}{i}"] * words)}
                # Stored counts that are right, missing, or wrong either way (a recovered or edited message).
                kind = rng.randrange(4)
                if kind:
                    msg["tokens"] = [0, words, words * 3, max(1, words // 4)][kind]
                history.append(msg)
        max_len, room = rng.randrange(20, 600), rng.randrange(0, 30)
        tok = WordTokenizer()
        prompt, dropped = fit_conversation(tok, "sys", history, "hello there", max_len, room)
        assert dropped == fewest_dropped(WordTokenizer(), "sys", history, "hello there", max_len, room), case
        assert prompt == WordTokenizer().apply_chat_template(
            [{"role": "system", "content": "sys"}, *history[2 * dropped:], {"role": "user", "content": "hello there"}],
            add_generation_prompt=True)


class MeasuringTokenizer(WordTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int]:
        ids = super().apply_chat_template(messages, add_generation_prompt)
        self.sizes.append(len(ids))
        return ids


def test_a_long_history_is_never_tokenized_whole() -> None:
    history = turns(5000, words=200)  # about 2M tokens of history for a 2048-token context
    for m in history:
        m["tokens"] = 200
    tok = MeasuringTokenizer()
    prompt, dropped = fit_conversation(tok, "sys", history, "hello", max_model_len=2048, room=256)
    assert len(prompt) + 256 <= 2048 and dropped == 5000 - 4  # four turns of 404 tokens fit, five do not
    assert tok.calls <= 4 and max(tok.sizes) <= 2 * 2048, tok.sizes


def stored(history: list[dict[str, Any]], reads: list[int]) -> Callable[[int], Awaitable[MessagePage]]:
    """The store's newest-``n`` page of ``history`` (chatsvc.store.sessions.message_page's shape)."""

    async def read(n: int) -> MessagePage:
        reads.append(n)
        page = history[max(0, len(history) - n):]
        return MessagePage(page, len(history) - len(page), len(history), 0,
                           sum(m["role"] == "user" for m in history))
    return read


def whole_fit(tok: WordTokenizer, history: list[dict[str, Any]], max_len: int,
              room: int) -> Callable[[list[dict[str, Any]]], Awaitable[tuple[list[int], int]]]:
    async def fit(part: list[dict[str, Any]]) -> tuple[list[int], int]:
        return fit_conversation(tok, "sys", part, "hello there", max_len, room)
    return fit


async def test_tails_give_exactly_the_prompt_and_count_of_the_whole_history() -> None:
    import random

    rng = random.Random(11)
    for case in range(300):
        history: list[dict[str, Any]] = []
        for i in range(rng.randrange(0, 60)):
            history.append({"role": "user", "content": " ".join([f"u{i}"] * rng.randrange(1, 30))})
            for _ in range(rng.choice((1, 1, 1, 3))):  # a turn of several messages: replies and tool results
                history.append({"role": rng.choice(("assistant", "tool")), "content": " ".join(["a"] * rng.randrange(0, 30))})
        max_len, room = rng.randrange(20, 800), rng.randrange(0, 30)
        want = fit_conversation(WordTokenizer(), "sys", history, "hello there", max_len, room)
        reads: list[int] = []
        ids, dropped, read = await fit_stored_history(stored(history, reads), whole_fit(WordTokenizer(), history,
                                                                                          max_len, room), first=4)
        assert (ids, dropped) == want, case
        assert read == history[len(history) - len(read):]  # a tail, whole turns from its first message
        # Each tail is four times the last: the reads end within a factor of four of what the prompt needs.
        assert reads == [4 * 4 ** k for k in range(len(reads))]


async def test_a_long_history_reads_only_a_tail_near_the_context() -> None:
    history = turns(5000, words=200)
    reads: list[int] = []
    ids, dropped, read = await fit_stored_history(stored(history, reads), whole_fit(WordTokenizer(), history, 2048, 256))
    assert dropped == 5000 - 4 and len(read) <= 32 and reads == [32]
