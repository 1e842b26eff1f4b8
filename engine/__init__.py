"""The paged-KV engine: ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# torch's CPU allocator puts allocations of 2 MiB and more on transparent huge pages (2 MiB-aligned, advised
# MADV_HUGEPAGE) when this is set at its first allocation, so before torch allocates anything: every process
# that runs an engine imports this package first. A decode step streams every weight and reads KV blocks from
# all over the pool; on 4 KiB pages that is tens of thousands of TLB misses a step. Measured by
# benchmarks/huge_pages.py (a process each way, alternated): decode steps 1.07x (32 sequences) and 1.09x (64)
# faster on the 2-core EPYC VM. It changes no value the model computes. An operator's setting wins (0: off).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
