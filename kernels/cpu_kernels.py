"""CPU kernels: decode attention in C++ (built on first use), the rest from the torch reference.

Decode attention is the one kernel where the reference's approach (gather the blocks into a dense
copy, then ``bmm``) costs most on CPU: attention is memory-bound there and the copy doubles the bytes
moved. ``csrc/paged_attention_cpu.cpp`` reads each block in place instead. It is compiled with the
machine's C++ compiler through ``torch.utils.cpp_extension`` the first time it is needed (tens of
seconds) and cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``).
``scripts/setup.sh`` builds it once so the first request does not pay for it.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from kernels.reference import copy_blocks, paged_attention_prefill, swap_blocks, write_kv_cache

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"


def _isa_flags() -> tuple[str, list[str]]:
    """Vector ISA flags this CPU supports; part of the module name, so a cache dir shared between
    different CPUs never hands one a binary built for the other."""
    try:
        cpu_flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                                 if line.startswith("flags")).split())
    except OSError:
        cpu_flags = set()
    if {"avx2", "fma", "f16c"} <= cpu_flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip-installed one sits beside this interpreter,
    which is not on PATH when the venv's python is run without activating the venv."""
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


# The first failed build, kept so later engines fall back at once instead of compiling again (a minute).
_build_failure: list[Exception] = []


def load_extension() -> ModuleType:
    """Build (or load the cached build of) the C++ kernels. Raises if they cannot be built here."""
    if _build_failure:
        raise RuntimeError(f"the C++ CPU kernels failed to build earlier: {_build_failure[0]}")
    try:
        return _build()
    except Exception as exc:
        _build_failure.append(exc)
        raise


@functools.cache
def _build() -> ModuleType:
    from torch.utils import cpp_extension

    _ninja_on_path()

    isa, flags = _isa_flags()
    return cpp_extension.load(
        name=f"chatsvc_paged_attention_cpu_{isa}",
        sources=[str(SOURCE)],
        # OpenMP: at::parallel_for is a header template; without -fopenmp it silently runs serially.
        # The extension then shares the libgomp torch already loaded (same soname).
        extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        verbose=bool(os.environ.get("CHATSVC_VERBOSE_BUILD")),
    )


def paged_attention_decode(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> Tensor:
    """One query token per sequence attends to its whole context, read through the block table."""
    del max_context_len  # the kernel walks each sequence's own length
    ext = load_extension()
    return ext.paged_attention_decode(query, k_cache, v_cache, block_tables.to(torch.int32),
                                      context_lens.to(torch.int32), float(scale))


__all__ = ["copy_blocks", "load_extension", "paged_attention_decode", "paged_attention_prefill", "swap_blocks",
           "write_kv_cache"]


if __name__ == "__main__":  # `python -m kernels.cpu_kernels`: build now (scripts/setup.sh does)
    print(f"built {load_extension().__file__}")
