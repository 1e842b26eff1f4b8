"""Offline API: ``LLM(...).generate(...)`` and ``.chat(...)``, mirroring vLLM's names."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestOutput
from engine.protocol import EngineStats
from engine.request import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """``settings``: ``EngineConfig``'s fields (dtype, num_kv_blocks, max_model_len, ...). Offline use
        queues every prompt at once, so the waiting queue is unbounded unless ``max_waiting`` says otherwise."""
        settings.setdefault("max_waiting", 1 << 30)
        self.engine = LLMEngine(EngineConfig(model=model, **settings))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass prompts or prompt_token_ids, not both")
        items: list[tuple[str | None, list[int] | None]]
        if prompts is not None:
            items = [(p, None) for p in prompts]
        elif prompt_token_ids is not None:
            items = [(None, list(ids)) for ids in prompt_token_ids]
        else:
            raise ValueError("prompts or prompt_token_ids is required")
        params = self._params_list(sampling_params, len(items))
        # Validate everything before adding anything, so a bad request changes no state.
        groups = [self.engine.make_request(f"llm-{next(self._ids)}", p, prompt=text, prompt_token_ids=ids)
                  for (text, ids), p in zip(items, params, strict=True)]
        for group in groups:
            self.engine.add_group(group)
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(groups), desc="generate")
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.request_finished and progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [LLMEngine.request_output(g) for g in groups]

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        conversations: list[list[dict[str, Any]]]
        if messages and isinstance(messages[0], dict):
            conversations = [list(messages)]  # type: ignore[arg-type]
        else:
            conversations = [list(c) for c in messages]  # type: ignore[arg-type]
        ids = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @staticmethod
    def _params_list(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)
