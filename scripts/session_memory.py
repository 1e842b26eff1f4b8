"""Redis bytes one session holds: MEMORY USAGE summed over its keys after a conversation of N turns.

Usage: python scripts/session_memory.py REDIS_URL [--turns 40] [--user-chars 300] [--reply-chars 1200]
       [--prompt-chars 0]

Writes through the store's own calls (create_session, begin_turn, end_turn), so the figure is what the
gateway stores; the settings are the defaults (retention included, where the store has it). Prints one
JSON line: the session's keys and bytes, and the shared prompt's bytes (stored once for every session of
that persona; absent where sessions copy their prompt). The Redis database is emptied first.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from chatsvc.personas import DEFAULT_PERSONAS
from chatsvc.store import Store


async def measure(url: str, turns: int, user_chars: int, reply_chars: int, prompt_chars: int) -> dict[str, object]:
    store = Store.from_url(url)
    try:
        await store.r.flushdb()
        prompt = DEFAULT_PERSONAS["assistant"]["system_prompt"]
        if prompt_chars:
            prompt = (prompt + " ") * (prompt_chars // len(prompt) + 1)
            prompt = prompt[:prompt_chars]
        meta = await store.create_session("owner", "assistant", prompt)
        for turn in range(1, turns + 1):
            user = {"role": "user", "content": (f"question {turn} " + "x" * user_chars)[:user_chars],
                    "created": 0.0, "tokens": user_chars // 4}
            assert await store.begin_turn(meta.id, user) == turn
            reply = {"role": "assistant", "content": (f"answer {turn} " + "y" * reply_chars)[:reply_chars],
                     "created": 0.0, "tokens": reply_chars // 4, "finish_reason": "stop", "prompt_tokens": 0,
                     "cached_tokens": 0}
            await store.end_turn(meta.id, turn, reply)
        keys = [k async for k in store.r.scan_iter(match="*{" + meta.id + "}*")]
        session_bytes = {k: int(await store.r.memory_usage(k, samples=0)) for k in keys}
        shared = [k async for k in store.r.scan_iter(match="chatsvc:prompt:*")]
        return {"turns": turns, "user_chars": user_chars, "reply_chars": reply_chars, "prompt_chars": len(prompt),
                "session_bytes": sum(session_bytes.values()), "keys": session_bytes,
                "messages_stored": await store.r.llen(next(k for k in keys if k.endswith(":messages"))),
                "shared_prompt_bytes": sum([int(await store.r.memory_usage(k, samples=0)) for k in shared])}
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--user-chars", type=int, default=300)
    ap.add_argument("--reply-chars", type=int, default=1200)
    ap.add_argument("--prompt-chars", type=int, default=0, help="a persona prompt of this size (0: the default's)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(measure(args.url, args.turns, args.user_chars, args.reply_chars,
                                         args.prompt_chars))))


if __name__ == "__main__":
    main()
