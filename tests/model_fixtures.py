"""The default model in transformers: the oracle the engine's tokens are compared with.

Loading it dequantizes the GGUF to float32, which takes seconds, and several modules compare against it,
so it is loaded once per test process (``hf_reference``), and a greedy continuation asked for twice is
generated once (``hf_greedy``). Modules take them with ``from model_fixtures import ...``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.model_files import default_model_path


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_reference: Any) -> Callable[[list[int], int], list[int]]:
    """``greedy(prompt_ids, max_new_tokens)``: the reference's greedy continuation (remembered)."""
    done: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in done:
            with torch.inference_mode():
                gen = hf_reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            done[key] = gen[0, len(ids):].tolist()
        return list(done[key])

    return greedy
