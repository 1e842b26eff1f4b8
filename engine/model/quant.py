"""int8 linears: weights quantized once at load (symmetric, one scale per output channel), activations
quantized on the fly at every call, the GEMM in int8 with int32 accumulation.

The kernel: ``onednn`` (CPUs with AVX512-VNNI or AVX-VNNI, AMX-INT8 where present),
``torch.ops.onednn.qlinear_pointwise`` on a weight packed once by ``qlinear_prepack``. Activations get one
scale per token (row): a per-tensor scale lets one outlier row (a prompt's first token) coarsen every other
row of the batch. oneDNN takes one activation scale, so it is given 1.0 and the rows are rescaled after the
GEMM.

CPUs without VNNI (AVX2-only: Zen 3, Haswell) are refused. The int8 path stock torch has for them, fbgemm's
``torch.ops.quantized.linear_dynamic``, quantizes activations per tensor inside the op (7 bits there:
without VNNI its u8 x s8 products are summed in pairs into int16, which saturates at 8), which moves the
model about an order of magnitude further from float32 than per-token oneDNN does. It is kept only as an
explicitly named kernel for benchmarks/quantization_accuracy.py (which measures both), never chosen by
``int8``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Int8Kernel = Literal["onednn", "fbgemm"]
INT8_KERNELS: tuple[str, ...] = ("onednn", "fbgemm")
QUANTIZATIONS: tuple[str | None, ...] = (None, "int8")
ACT_ZERO_POINT = 128  # activations quantized to [-127, 127], stored shifted into u8


def has_vnni() -> bool:
    """AVX512-VNNI or AVX-VNNI: the u8/s8 dot products that make oneDNN's int8 GEMM fast."""
    return bool(torch.cpu._is_vnni_supported())


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def int8_kernel(device: torch.device | str, name: str = "auto") -> str:
    """"auto" -> "onednn" where the CPU has VNNI, else a ValueError; "fbgemm" only when named (see above)."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"int8 quantization runs on CPU only, not on {device}")
    if name not in ("auto", *INT8_KERNELS):
        raise ValueError(f"int8 kernel must be one of {('auto', *INT8_KERNELS)}, got {name!r}")
    if name == "fbgemm":
        if not fbgemm_available():
            raise ValueError(f"fbgemm is not in this torch build (quantized engines "
                             f"{torch.backends.quantized.supported_engines})")
        return name
    if not (torch.backends.mkldnn.is_available() and has_vnni()):  # type: ignore[no-untyped-call]
        raise ValueError("int8 quantization needs an x86 CPU with VNNI (AVX512-VNNI or AVX-VNNI) for oneDNN's "
                         "int8 GEMMs; use bf16 or float32 here")
    return "onednn"


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """int8 weight [N, K] and its float32 per-output-channel scales [N] (symmetric, zero point 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


# One linear's quantized, packed weight; calling it computes x W^T + b in x's dtype.
Int8Weight = Callable[[Tensor, Tensor | None], Tensor]


class OneDNNInt8Weight:
    def __init__(self, weight: Tensor) -> None:
        q, self.scale = quantize_weight(weight)
        self.packed: Tensor = torch.ops.onednn.qlinear_prepack(q, None)
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.int64)

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        row_scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
        row_scale.clamp_(min=1e-12).div_(127)
        # Unsigned, with zero point 128 (the same integers shifted): VNNI multiplies u8 by s8, and oneDNN has
        # no VNNI kernel for s8 activations, only AMX's; on an AVX512-VNNI CPU without AMX (Zen 4) s8 falls to
        # its reference kernel, thousands of times slower than u8.
        qx = torch.div(x, row_scale).round_().add_(ACT_ZERO_POINT).to(torch.uint8)
        out: Tensor = torch.ops.onednn.qlinear_pointwise(qx, 1.0, ACT_ZERO_POINT, self.packed, self.scale,
                                                         self.zero_points, None, 1.0, 0, x.dtype, "none", [], "")
        out.mul_(row_scale)
        if bias is not None:
            out.add_(bias)
        return out


class FbgemmInt8Weight:
    def __init__(self, weight: Tensor) -> None:
        q, scale = quantize_weight(weight)
        with warnings.catch_warnings():
            # quantize_per_channel is deprecated in favour of torchao, but it is how fbgemm's prepack takes
            # a per-channel int8 weight in stock torch.
            warnings.simplefilter("ignore", UserWarning)
            zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
            qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.reduce_range = not has_vnni()

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        out: Tensor = torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)
        if bias is not None:
            out.add_(bias)
        return out.to(x.dtype)


def make_int8_weight(weight: Tensor, kernel: str) -> Int8Weight:
    if kernel == "onednn":
        return OneDNNInt8Weight(weight)
    if kernel == "fbgemm":
        return FbgemmInt8Weight(weight)
    raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, got {kernel!r}")


__all__ = ["INT8_KERNELS", "QUANTIZATIONS", "FbgemmInt8Weight", "Int8Kernel", "Int8Weight", "OneDNNInt8Weight",
           "fbgemm_available", "has_vnni", "int8_kernel", "make_int8_weight", "quantize_weight"]
