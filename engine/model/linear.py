"""Linear layers whose weights are packed once, at load, into oneDNN's blocked layout.

Plain ``F.linear`` re-lays out (or streams unblocked) the weight on every call; on CPU the model's
linears are most of a step, and oneDNN's packed GEMMs use AMX / AVX512-BF16 for bf16 where the CPU has
them, and AVX-512 for fp32 on CPUs where MKL's sgemm does not (AMD). One packing serves every batch
size. ``torch.ops.mkldnn._reorder_linear_weight`` packs, ``_linear_pointwise`` multiplies; both ship
with stock torch on x86. Packing is CPU-only and skipped, with a log line, where oneDNN cannot run the
dtype natively (bf16 without AVX512-BF16 falls to a reference path several times slower than fp32).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.quant import Int8Weight, make_int8_weight

log = logging.getLogger(__name__)

LinearBackend = Literal["auto", "onednn", "torch"]
LINEAR_BACKENDS: tuple[str, ...] = ("auto", "onednn", "torch")


def onednn_supports(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN runs packed GEMMs of this dtype natively on this device."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def resolve_linear_backend(name: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """"auto" -> "onednn" where it runs natively, else "torch"; "onednn" where it cannot run is an error."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    supported = onednn_supports(dtype, device)
    if name == "onednn" and not supported:
        raise ValueError(f"oneDNN packed linears do not run {dtype} natively on {device}")
    if name == "auto":
        if not supported and torch.device(device).type == "cpu":
            log.info("oneDNN has no native %s GEMM on this CPU: linears use F.linear", dtype)
        return "onednn" if supported else "torch"
    return name


def gemm_rows(tokens: int) -> int:
    """The row count a step of ``tokens`` tokens is padded to when its linears are packed for oneDNN.

    oneDNN builds (and caches) a GEMM primitive per input shape, which costs a single-threaded 2-6 ms per
    weight shape the first time a row count is seen: ~24 ms for a step of the model's linears on the
    2-core VM, 10-30% of a step that mixes decodes with a short prompt. Prompts make nearly every such
    step a new row count, so rows are rounded up to a few shapes instead: 64 and below stay exact (decode
    batches, at most max_num_seqs of them), above that a multiple of 1/16 to 1/32 of the count, so the
    padding costs a few percent of a step while ~16 shapes cover each doubling.
    """
    if tokens <= 64:
        return tokens
    granule = max(16, 1 << (tokens.bit_length() - 5))
    return -(-tokens // granule) * granule


def pack_weight(weight: Tensor) -> Tensor:
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return packed


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class Linear(nn.Module):
    """y = x W^T + b with uninitialized parameters: every weight is loaded from a checkpoint right after,
    and nn.Linear's random init (or building on the meta device) costs seconds for nothing.

    After :meth:`pack` the forward pass runs on the packed copy; the plain weight stays the parameter
    (checkpoint loading, tests and the LM head's tied embedding read it). After :meth:`quantize` it runs
    in int8 instead (see engine.model.quant).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.packed: Tensor | None = None
        self.int8: Int8Weight | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def quantize(self, kernel: str) -> None:
        """Run in int8 with ``kernel`` ("onednn" or "fbgemm") from now on; a packed copy is dropped."""
        self.int8 = make_int8_weight(self.weight, kernel)
        self.packed = None

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.int8 is not None:
            return self.int8(x, bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.bias)


__all__ = ["LINEAR_BACKENDS", "Linear", "LinearBackend", "gemm_rows", "onednn_supports", "pack_weight", "packed_linear",
           "resolve_linear_backend"]
