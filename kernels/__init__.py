"""Paged-KV kernels: a plain-torch reference (CPU path, test oracle) and Triton kernels (CUDA).

``get_backend`` picks one; both expose the same five functions, see ``AttentionBackend``.
"""

from __future__ import annotations

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


def get_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """Pick the kernels: "auto" = Triton on CUDA, torch elsewhere; "torch" / "triton" force one.

    "triton" on CPU tensors works only under TRITON_INTERPRET=1 (set before the kernels are imported).
    """
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return _from_module("torch", reference)
    if name == "triton":
        # Imported lazily: importing triton is slow and decorating reads TRITON_INTERPRET at that moment.
        from kernels import triton_kernels

        return _from_module("triton", triton_kernels)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch' or 'triton'")


__all__ = ["AttentionBackend", "get_backend", "reference"]
