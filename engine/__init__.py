"""The paged-KV engine: ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.engine import CompletionOutput, LLMEngine, RequestOutput
    from engine.llm import LLM


def __getattr__(name: str) -> object:
    # Lazy, so `import engine.block_manager` (plain Python) does not pull in torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name in ("LLMEngine", "RequestOutput", "CompletionOutput"):
        from engine import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(name)


__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "SamplingParams"]
