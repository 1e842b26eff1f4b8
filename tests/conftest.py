"""Shared test setup.

The Triton interpreter is chosen when ``triton.jit`` decorates a kernel, so the variable must
be set before any kernel module is imported; conftest runs before test modules are imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
