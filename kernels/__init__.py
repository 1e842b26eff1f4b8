"""Paged-KV kernels: a plain-torch reference (test oracle, fallback), C++ CPU kernels and Triton kernels (CUDA).

``get_backend`` picks one; all expose the same five functions, see ``AttentionBackend``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_cache: Callable[..., None]
    paged_attention_decode: Callable[..., torch.Tensor]
    paged_attention_prefill: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]


def _from_module(name: str, module: Any) -> AttentionBackend:
    return AttentionBackend(
        name=name,
        write_kv_cache=module.write_kv_cache,
        paged_attention_decode=module.paged_attention_decode,
        paged_attention_prefill=module.paged_attention_prefill,
        copy_blocks=module.copy_blocks,
        swap_blocks=module.swap_blocks,
    )


log = logging.getLogger(__name__)


def get_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """Pick the kernels: "auto" = Triton on CUDA, the C++ kernels on CPU (torch if they cannot be
    built here); "torch" / "cpu" / "triton" force one.

    "triton" on CPU tensors works only under TRITON_INTERPRET=1 (set before the kernels are imported).
    """
    if name == "auto":
        if torch.device(device).type == "cuda":
            return get_backend("triton", device)
        try:
            return get_backend("cpu", device)
        except Exception as exc:  # no compiler, no ninja, a failed build: the reference still works
            log.warning("C++ CPU kernels unavailable (%s); using the torch reference kernels", exc)
            return get_backend("torch", device)
    if name == "torch":
        return _from_module("torch", reference)
    if name == "cpu":
        from kernels import cpu_kernels

        cpu_kernels.load_extension()  # build or load now, not inside the first forward pass
        return _from_module("cpu", cpu_kernels)
    if name == "triton":
        # Imported lazily: importing triton is slow and decorating reads TRITON_INTERPRET at that moment.
        from kernels import triton_kernels

        return _from_module("triton", triton_kernels)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")


__all__ = ["AttentionBackend", "get_backend", "reference"]
