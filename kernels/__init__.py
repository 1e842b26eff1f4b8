"""Paged-KV kernels: a plain-torch reference (test oracle, fallback), C++ CPU kernels and Triton kernels (CUDA).

``get_backend`` picks one; all implement ``AttentionBackend`` (five attention functions and the model's
elementwise ``ModelOps``), see ``kernels.backend``.
"""

from __future__ import annotations

import logging

import torch

from kernels import reference
from kernels.backend import (
    AttentionBackend,
    DecodeWeight,
    LayerStack,
    ModelOps,
    StackedLayer,
    StackShape,
    no_layer_stack,
)

REFERENCE_OPS = ModelOps(fused_add_rms_norm=reference.fused_add_rms_norm, silu_and_mul=reference.silu_and_mul,
                         rotary_embedding=reference.rotary_embedding)


class TorchBackend:
    """The reference kernels: plain torch ops, on any device."""

    name = "torch"
    ops = REFERENCE_OPS
    mixed_batches = False
    argmax = staticmethod(reference.argmax)
    write_kv_cache = staticmethod(reference.write_kv_cache)
    paged_attention_decode = staticmethod(reference.paged_attention_decode)
    paged_attention_prefill = staticmethod(reference.paged_attention_prefill)
    copy_blocks = staticmethod(reference.copy_blocks)
    swap_blocks = staticmethod(reference.swap_blocks)
    layer_stack = staticmethod(no_layer_stack)


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
        return TorchBackend()
    if name == "cpu":
        from kernels.cpu_kernels import CpuKernels

        return CpuKernels()  # builds or loads the extension now, not inside the first forward pass
    if name == "triton":
        # Imported lazily: importing triton is slow and decorating reads TRITON_INTERPRET at that moment.
        from kernels.triton_kernels import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or 'triton'")


__all__ = ["REFERENCE_OPS", "AttentionBackend", "DecodeWeight", "LayerStack", "ModelOps", "StackShape", "StackedLayer", "TorchBackend",
           "get_backend", "reference"]
