"""Paged-KV kernels: a plain-torch reference (test oracle, fallback), C++ CPU kernels and Triton kernels (CUDA).

``get_backend`` picks one; all expose the same five attention functions and the same elementwise model ops,
see ``AttentionBackend`` and ``ModelOps``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import reference


@dataclass(frozen=True)
class ModelOps:
    """The elementwise ops of a decoder layer, fused (one pass over the rows, no temporaries) where the
    backend has kernels for them. Same semantics in every backend (float32 math inside for half types):

    - ``fused_add_rms_norm(x, residual, weight, eps) -> None``, in place (vLLM semantics): residual += x,
      then x = rms_norm(residual) * weight; x, residual ``[..., N]``, weight ``[N]``.
    - ``silu_and_mul(gate_up) -> Tensor``: ``[..., 2I] -> [..., I]``, silu(first half) * second half.
    - ``rotary_embedding(qk, cos, sin) -> None``, in place on ``qk [T, H, D]`` (may be a strided view of the
      fused QKV output), "rotate_half" layout; cos, sin ``[T, D/2]`` or ``[T, 1, D/2]`` in qk's dtype.
    """

    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary_embedding: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _ops_from_module(module: Any) -> ModelOps:
    return ModelOps(fused_add_rms_norm=module.fused_add_rms_norm, silu_and_mul=module.silu_and_mul,
                    rotary_embedding=module.rotary_embedding)


REFERENCE_OPS = _ops_from_module(reference)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_cache: Callable[..., None]
    paged_attention_decode: Callable[..., torch.Tensor]
    paged_attention_prefill: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]
    ops: ModelOps = REFERENCE_OPS


def _from_module(name: str, module: Any, ops: ModelOps) -> AttentionBackend:
    return AttentionBackend(
        name=name,
        write_kv_cache=module.write_kv_cache,
        paged_attention_decode=module.paged_attention_decode,
        paged_attention_prefill=module.paged_attention_prefill,
        copy_blocks=module.copy_blocks,
        swap_blocks=module.swap_blocks,
        ops=ops,
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
        return _from_module("torch", reference, REFERENCE_OPS)
    if name == "cpu":
        from kernels import cpu_kernels

        cpu_kernels.load_extension()  # build or load now, not inside the first forward pass
        return _from_module("cpu", cpu_kernels, _ops_from_module(cpu_kernels))
    if name == "triton":
        # Imported lazily: importing triton is slow and decorating reads TRITON_INTERPRET at that moment.
        from kernels import triton_kernels

        # torch's own CUDA kernels for the elementwise ops: no Triton versions of them (yet).
        return _from_module("triton", triton_kernels, REFERENCE_OPS)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")


__all__ = ["REFERENCE_OPS", "AttentionBackend", "ModelOps", "get_backend", "reference"]
