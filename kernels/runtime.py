"""What an engine computes with: the kernel set, the vector ISA of its C++ build, the model's dtype and
torch's thread count, as one record for the start-up log and the engine's published stats.

The C++ CPU kernels are several times faster than the torch reference kernels that ``get_backend("auto")``
falls back to where they cannot be built, so a measured speed means little without saying which set ran;
this record says so wherever the speed is reported.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from kernels import cpu_kernels

# backend.name -> the kernel set it is.
KERNEL_SETS = {"cpu": "cpp", "torch": "torch", "triton": "triton"}
_EXT_PREFIX = "chatsvc_cpu_kernels_"


@dataclass(frozen=True)
class KernelRuntime:
    kernels: str  # "cpp" (C++ CPU kernels), "torch" (the reference), "triton"
    isa: str | None  # the C++ build's vector ISA ("avx2", ...); None for the other sets
    cpu_isa: str | None  # the best C++ build this CPU runs; None off the CPU
    dtype: str  # "bfloat16", "float32", ...
    threads: int  # torch's intra-op threads in this process
    device: str
    fallback: str | None  # why the C++ kernels are not running on a CPU engine, where a build failed

    def as_dict(self) -> dict[str, str | int | None]:
        """JSON-ready (``/v1/kv``) and flat (a Prometheus info metric's labels)."""
        return asdict(self)

    def describe(self) -> str:
        """One line for the start-up log."""
        kernels = {"cpp": "C++ CPU kernels" + (f" ({self.isa} build)" if self.isa else ""),
                   "torch": "torch reference kernels",
                   "triton": "Triton kernels"}.get(self.kernels, self.kernels)
        parts = [f"{kernels} on {self.device}", f"dtype {self.dtype}", f"{self.threads} torch threads"]
        if self.cpu_isa is not None and self.isa != self.cpu_isa:
            parts.append(f"this CPU runs the {self.cpu_isa} build")
        if self.fallback:
            parts.append(f"C++ build failed: {self.fallback}")
        return ", ".join(parts)


def describe_runtime(backend: object, dtype: torch.dtype | str, device: str | torch.device = "cpu") -> KernelRuntime:
    """The record for an engine computing in ``dtype`` on ``device`` with ``backend`` (what
    ``kernels.get_backend`` returned). Call it in the process that runs the engine: the thread count and a
    failed build are that process's."""
    name = str(getattr(backend, "name", type(backend).__name__))
    kernels = KERNEL_SETS.get(name, name)
    on_cpu = torch.device(device).type == "cpu"
    isa = None
    if kernels == "cpp":
        ext_name = getattr(getattr(backend, "ext", None), "__name__", "")
        isa = ext_name.removeprefix(_EXT_PREFIX) if ext_name.startswith(_EXT_PREFIX) else None
    cpu_isa = cpu_kernels.supported_isas()[0] if on_cpu else None
    fallback = _build_failure() if on_cpu and kernels == "torch" else None
    dtype_name = str(dtype).removeprefix("torch.")
    return KernelRuntime(kernels=kernels, isa=isa, cpu_isa=cpu_isa, dtype=dtype_name,
                         threads=torch.get_num_threads(), device=str(torch.device(device)), fallback=fallback)


def _build_failure() -> str | None:
    """Why this process's C++ build for the selected ISA failed, if it was tried and did."""
    try:
        wanted = cpu_kernels.selected_isa()
    except (ValueError, RuntimeError) as exc:  # CHATSVC_CPU_ISA names a build this CPU cannot run
        return str(exc)
    failure = cpu_kernels._build_failure.get(wanted)
    return None if failure is None else build_error_gist(failure)


def build_error_gist(exc: BaseException, limit: int = 300) -> str:
    """torch's build error names the extension, then carries the build's whole output: the gist is the
    first line that says what went wrong (a compiler error, a missing compiler)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0].split(": [", 1)[0]  # "Error building extension 'name'", without the command it ran
    detail = next((line for line in lines[1:] if re.search(r"error|not found", line, re.IGNORECASE)
                   and not line.startswith("ninja:")), None)
    text = f"{head}: {detail}" if detail else head
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["KERNEL_SETS", "KernelRuntime", "build_error_gist", "describe_runtime"]
