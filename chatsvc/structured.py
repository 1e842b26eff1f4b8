"""Structured outputs at the gateway: a request's grammar is compiled here before anything is queued.

The engine compiles each spec again for its own vocabulary (a worker behind Redis holds its own cache), so
this compile is a check: it refuses, with a 400 naming the problem, a schema llguidance cannot compile or one
that takes longer than ``engine.grammar.GrammarCompiler``'s bound (a pathological schema never reaches an
engine, whose step loop would wait on it). It runs on the compiler's threads, off the event loop, and is
cached by the spec's key, so a schema sent again is checked at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from chatsvc.errors import APIError
from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec

log = logging.getLogger(__name__)


class Grammars:
    """The gateway's compiler, built from the engine's tokenizer while the gateway starts (``prepare``), before
    it serves: the build is about a second for a 49k vocabulary, nearly all of it in llguidance's Rust
    tokenizer constructor with the GIL held, so built on a worker thread at the first grammar request it
    still stalled the event loop, and every stream on it, for that long. A gateway that could not build it
    (a slow tokenizer) serves every other request and builds again at the first grammar request."""

    def __init__(self) -> None:
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # one build, however many requests arrive while it runs

    @property
    def ready(self) -> bool:
        return self._compiler is not None

    def prepare(self, tokenizer: Any) -> None:
        """Build the compiler now (a blocking call: run it on a thread)."""
        try:
            self._build(tokenizer)
        except Exception as exc:  # noqa: BLE001 - only grammar requests need it; they get the error then
            log.warning("no grammar compiler for this tokenizer (%s): structured outputs are refused", exc)

    async def compiler(self, tokenizer: Any) -> GrammarCompiler:
        if self._compiler is not None:
            return self._compiler
        return await asyncio.to_thread(self._build, tokenizer)

    def _build(self, tokenizer: Any) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_hf(tokenizer.hf, None, tokenizer.eos_token_ids)
            return self._compiler

    async def check(self, tokenizer: Any, spec: GrammarSpec | None, param: str = "response_format") -> None:
        """``APIError`` 400 unless ``spec`` compiles within the time bound."""
        if spec is None:
            return
        compiler = await self.compiler(tokenizer)
        try:
            await compiler.compile_async(spec)
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", code="invalid_value", param=param) from exc
