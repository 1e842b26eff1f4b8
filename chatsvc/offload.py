"""CPU-heavy request work kept off the event loop: tokenizing long prompts and rendering large responses
run on a worker thread, so one big request does not stall every other client (or /health).

The HF tokenizer's Rust core and ``json.dumps``' C encoder each hold the GIL for a whole call, so a
worker thread alone is not enough: prompts that cannot fit the context are refused before tokenizing,
and large responses are encoded in many small pieces.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from chatsvc.errors import APIError
from chatsvc.tools import chat_prompt_ids, prompt_chars
from engine.client import EngineClient

T = TypeVar("T")
INLINE_CHARS = 4096  # shorter prompts are tokenized on the loop: a thread hop would cost more
_PIECE = 64  # lists longer than this are encoded item by item


class Offload:
    def __init__(self, engine: EngineClient, workers: int = 2) -> None:
        self.engine = engine
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chatsvc-cpu")

    async def warm(self) -> None:
        """Give every worker thread its own tokenizer copy now, at start-up, and render a chat template with
        it: making one, and its first render, hold the GIL for a few tenths of a second
        (engine.tokenizer.Tokenizer), which would otherwise stall live traffic."""
        barrier = threading.Barrier(self.workers)

        def touch() -> None:
            barrier.wait(timeout=30)  # one task per thread: none finishes before all have started
            # A chat template rendered once: the thread's first render also costs tenths of a second.
            self.tokenizer.apply_chat_template([{"role": "user", "content": "warm-up"}])

        await asyncio.gather(*(self.run(touch) for _ in range(self.workers)))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry: no token decodes to more characters (a byte-level entry has one
        character per byte), so a text of c characters has at least c / this many tokens."""
        hf = getattr(self.tokenizer, "hf", None)
        vocab = hf.get_vocab() if hf is not None else {}
        return max((len(t) for t in vocab), default=0) or 1 << 20

    def check_fits(self, chars: int, param: str) -> None:
        """Refuse, without tokenizing it, a prompt that cannot fit the context whatever its tokens."""
        at_least = chars // self.max_token_chars
        if at_least >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                           f"has at least {at_least} tokens.", code="context_length_exceeded", param=param)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _tokenize(self, chars: int, param: str, ids: Callable[[], list[int]]) -> list[int]:
        self.check_fits(chars, param)
        return ids() if chars <= INLINE_CHARS else await self.run(ids)

    async def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """OpenAI's messages (tool calls and results included) and the tools shown to the model (chatsvc.tools)."""
        return await self._tokenize(prompt_chars(messages, tools), "messages",
                                    lambda: chat_prompt_ids(self.tokenizer, messages, tools))

    async def encode(self, text: str) -> list[int]:
        return await self._tokenize(len(text), "prompt",
                                    lambda: list(self.tokenizer.encode(text, add_special_tokens=True)))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Raw(str):
    """A JSON text already encoded: :func:`dumps_in_pieces` writes it as is. Rendering each logprobs entry
    as soon as it is built keeps a large reply from holding millions of live containers, which the
    cyclic garbage collector would otherwise walk (holding the GIL) again and again while it grows."""


def dumps_in_pieces(obj: Any) -> str:
    """Exactly ``json.dumps(obj)`` (with :class:`Raw` parts inserted as they are), but long lists (and the
    dicts holding them) are encoded item by item, so no single C-encoder call holds the GIL for the whole
    of a large response."""
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, list) and (len(obj) > _PIECE or any(isinstance(x, list | dict | Raw) for x in obj)):
        return "[" + ", ".join(dumps_in_pieces(x) for x in obj) + "]"
    if isinstance(obj, dict) and any(isinstance(v, list | dict | Raw) for v in obj.values()):
        return "{" + ", ".join(json.dumps(str(k)) + ": " + dumps_in_pieces(v) for k, v in obj.items()) + "}"
    return json.dumps(obj)


class TokenTexts:
    """Token id -> its text, decoded once per request (logprobs name each sampled and top token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = str(self.tok.decode([tid], skip_special_tokens=False))
        return s
