"""The paged-KV engine: ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.engine import CompletionOutput, LLMEngine, RequestOutput
    from engine.llm import LLM

# Lazy, so `import engine.block_manager` (plain Python) does not pull in torch.
_LAZY = {"LLM": "engine.llm", "LLMEngine": "engine.engine", "RequestOutput": "engine.engine",
         "CompletionOutput": "engine.engine"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "SamplingParams"]
