"""CPU kernels in C++ (built on first use): paged attention, the KV-cache write, and the elementwise ops
around them (``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding``, see ``kernels.ModelOps``);
block copies come from the torch reference.

Attention is where the reference's approach (gather the blocks into a dense copy, then matmuls) costs most
on CPU: it is memory-bound there and the copy doubles the bytes moved. ``csrc/cpu_kernels.cpp`` reads
each block in place instead, for decode and for prefill chunks over a cached prefix alike. The
elementwise ops each replace several torch ops (and their temporaries) with one pass over the rows.

The source is compiled once per vector ISA, each build a separate extension (the ISA is part of its name,
so a cache dir shared between machines never hands one CPU a binary built for another):

- ``avx512bf16``: AVX-512 with native bfloat16 converts (Sapphire Rapids and later, Zen 4);
- ``avx512``: AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake);
- ``avx2``: AVX2 + FMA + F16C (Haswell and later, Zen 1-3);
- ``generic``: plain C++.

The best one /proc/cpuinfo allows is used; ``CHATSVC_CPU_ISA`` forces another (one this CPU can run), so
the AVX2 and generic builds are exercised on an AVX-512 machine too. The ``avx512bf16`` build also runs AMX
tiles (prefill attention scores, a decode's linears) where the CPU and OS grant them, unless
``ONEDNN_MAX_CPU_ISA`` caps oneDNN below AMX (``amx_allowed``): one cap then keeps every matmul of the
engine, oneDNN's and these kernels', off the tiles, as on an AVX-512 CPU without AMX. Only builds actually
asked for are compiled (tens of seconds each, with the machine's C++ compiler through ``torch.utils.cpp_extension``),
then cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), one build or load at a
time per extension (``kernels.build_lock``: a killed build's leftover lock never stalls the next).
``scripts/setup.sh`` builds the default one so the first request does not pay for it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from kernels.backend import DecodeWeight, LayerStack, ModelOps, StackedLayer, StackShape
from kernels.build_lock import build_lock
from kernels.reference import copy_blocks, swap_blocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
ISA_ENV = "CHATSVC_CPU_ISA"

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
# name -> (/proc/cpuinfo flags it needs, compiler flags), best first.
ISAS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx512bf16": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16"}),
                   [*_AVX512, "-mavx512bf16"]),
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}), _AVX512),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ["-mavx2", "-mfma", "-mf16c"]),
    "generic": (frozenset(), []),
}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(" ".join(line.split(":", 1)[1] for line in lines if line.startswith("flags")).split())


def supported_isas() -> list[str]:
    """Every build this CPU can run, best first."""
    return [name for name, (needs, _) in ISAS.items() if needs <= _cpu_flags()]


def testable_isas() -> list[str]:
    """The builds worth covering on this CPU: its best, plus each fallback of a different vector width
    (the plain ``avx512`` build differs from ``avx512bf16`` only in its bfloat16 stores, so it stands in
    for it only where it is the best)."""
    isas = supported_isas()
    return [isas[0], *(i for i in ("avx2", "generic") if i in isas[1:])]


def amx_allowed() -> bool:
    """Whether these kernels may use AMX tiles: not when ``ONEDNN_MAX_CPU_ISA`` caps oneDNN to an ISA without
    AMX (``AVX2``, ``AVX512_CORE_BF16``...; its AMX values and ``ALL``/``DEFAULT`` leave them on)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not cap or "AMX" in cap or cap in ("ALL", "DEFAULT")


def selected_isa() -> str:
    """``CHATSVC_CPU_ISA`` if set (it must be one this CPU runs), else the best this CPU runs."""
    forced = os.environ.get(ISA_ENV)
    if not forced:
        return supported_isas()[0]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in supported_isas():
        raise RuntimeError(f"{ISA_ENV}={forced!r}: this CPU lacks {' '.join(sorted(ISAS[forced][0] - _cpu_flags()))}")
    return forced


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip-installed one sits beside this interpreter,
    which is not on PATH when the venv's python is run without activating the venv."""
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


# The first failed build of each ISA, kept so later engines fall back at once instead of compiling again.
_build_failure: dict[str, Exception] = {}


# The extension each value of CHATSVC_CPU_ISA resolved to, so that a new engine does not resolve the ISA
# (environment, CPU flags) again.
_resolved: dict[str | None, ModuleType] = {}


def load_extension(isa: str | None = None) -> ModuleType:
    """Build (or load the cached build of) the C++ kernels for ``isa`` (default: ``selected_isa()``).
    Raises if they cannot be built here."""
    if isa is None:
        forced = os.environ.get(ISA_ENV)
        ext = _resolved.get(forced)
        if ext is None:
            ext = _resolved[forced] = load_extension(selected_isa())
        return ext
    if isa in _build_failure:
        raise RuntimeError(f"the C++ CPU kernels ({isa}) failed to build earlier: {_build_failure[isa]}")
    try:
        return _build(isa)
    except Exception as exc:
        _build_failure[isa] = exc
        raise


@functools.cache
def _build(isa: str) -> ModuleType:
    return build_source(SOURCE, f"chatsvc_cpu_kernels_{isa}", isa)


def build_source(source: Path, name: str, isa: str) -> ModuleType:
    """Build (or load the cached build of) ``source`` for ``isa`` as the extension ``name``, with the engine's
    flags; benchmarks/cpu_attention.py --base builds another commit's kernels this way, beside this one's."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with build_lock(build_dir):  # torch's own wait on a killed build's lock file never ends
        ext: ModuleType = cpp_extension.load(
            name=name,
            sources=[str(source)],
            # OpenMP: at::parallel_for is a header template; without -fopenmp it silently runs serially.
            # The extension then shares the libgomp torch already loaded (same soname). No FMA contraction
            # of plain C++ expressions: the elementwise ops round exactly as torch's own kernels do.
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *ISAS[isa][1]],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=bool(os.environ.get("CHATSVC_VERBOSE_BUILD")),
        )
    return ext


class CpuKernels:
    """The CPU attention backend: one ISA build of the C++ kernels (``selected_isa()`` unless given), loaded
    once, here; block copies come from the torch reference. Inputs must have the dtypes of the kernel contract
    (``kernels.backend``): the C++ side checks them, nothing is converted per call."""

    name = "cpu"
    mixed_batches = True  # one varlen kernel: a decode is a sequence with one query
    copy_blocks = staticmethod(copy_blocks)
    swap_blocks = staticmethod(swap_blocks)

    def __init__(self, isa: str | None = None, ext: ModuleType | None = None) -> None:
        """``ext``: an already built extension to use instead (benchmarks/cpu_attention.py --base: another
        commit's kernels through ``build_source``)."""
        self.ext = ext if ext is not None else load_extension(isa)
        self.amx = amx_allowed()
        if not self.amx and hasattr(self.ext, "set_amx"):
            self.ext.set_amx(False)  # process-wide in the extension: the cap holds for the whole process
        self.ops = ModelOps(fused_add_rms_norm=self.fused_add_rms_norm, silu_and_mul=self.silu_and_mul,
                            rotary_embedding=self.rotary_embedding)

    def paged_attention_decode(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               context_lens: Tensor, scale: float, max_context_len: int | None = None) -> Tensor:
        """One query token per sequence attends to its whole context, read through the block table."""
        del max_context_len  # the kernel walks each sequence's own length
        out: Tensor = self.ext.paged_attention(query, k_cache, v_cache, block_tables, None, context_lens, scale)
        return out

    def paged_attention_prefill(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                query_start_loc: Tensor, context_lens: Tensor, scale: float,
                                max_query_len: int | None = None, max_context_len: int | None = None) -> Tensor:
        """Each sequence's queries (the last ``query_start_loc[i+1] - query_start_loc[i]`` tokens of its
        context) attend causally to its context, cached prefix included, read through the block table."""
        del max_query_len, max_context_len  # the kernel walks each sequence's own lengths
        out: Tensor = self.ext.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                               context_lens, scale)
        return out

    def argmax(self, logits: Tensor) -> Tensor:
        """torch.argmax(logits, -1) for ``[rows, vocab]`` logits with contiguous rows (first index on ties,
        first NaN if any), several times faster than torch's index-tracking reduction."""
        out: Tensor = self.ext.argmax_rows(logits)
        return out

    def write_kv_cache(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor) -> None:
        """Store each token's K/V ``[T, Hkv, D]`` at its slot (``block_id * block_size + offset``; -1 = skip).
        In place; key/value may be strided views (e.g. of the fused QKV projection)."""
        self.ext.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
        """In place, vLLM's fused_add_rms_norm: ``residual += x``, then ``x = rms_norm(residual) * weight``.

        x, residual ``[..., N]`` with contiguous rows, same dtype as weight ``[N]``. float32 math; for half
        types the sum and the normalized value are rounded to the storage type before the weight multiply, as
        ``h + out`` then HF's ``weight * norm(h).to(dtype)`` do.
        """
        n = x.shape[-1]
        self.ext.fused_add_rms_norm(x.view(-1, n), residual.view(-1, n), weight, eps)

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        """``[..., 2I] -> [..., I]``: ``silu(gate_up[..., :I]) * gate_up[..., I:]`` (the fused gate/up
        projection's output, rows contiguous)."""
        out: Tensor = self.ext.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]))
        return out.view(*gate_up.shape[:-1], out.shape[-1])

    def rotary_embedding(self, qk: Tensor, cos: Tensor, sin: Tensor) -> None:
        """In place on ``qk [T, H, D]`` (a strided view of the QKV projection is fine, D contiguous), the
        "rotate_half" layout: x1 <- x1 cos - x2 sin, x2 <- x2 cos + x1 sin for the halves x1, x2 of each head.
        cos, sin ``[T, D/2]`` (or ``[T, 1, D/2]``) in qk's dtype. In float32 this rounds exactly as the torch
        expression does (two products, then one add or subtract)."""
        half = qk.shape[-1] // 2
        self.ext.rotary_embedding(qk, cos.reshape(-1, half), sin.reshape(-1, half))

    def decode_weight(self, weight: Tensor) -> DecodeWeight | None:
        """``weight [N, K]`` packed for this build's decode GEMM, which runs a decode's few rows faster than
        oneDNN's packed GEMM where it runs at all: for bf16, ``amx_linear`` (N and K multiples of 32, the
        AVX512-BF16 build on a CPU and OS with AMX tiles, not capped off) or else ``bf16_linear`` (N a multiple
        of 32, K even, the AVX512-BF16 build); for float32, ``f32_linear`` (N a multiple of 16, the AVX2
        build). None elsewhere."""
        if weight.dim() != 2:
            return None
        n, k = weight.shape
        if weight.dtype == torch.bfloat16:
            if self.amx and n % 32 == 0 and k % 32 == 0 and self._runs("amx"):
                return self._decode_pack("amx", weight)
            return self._decode_pack("bf16", weight) if n % 32 == 0 and k % 2 == 0 and self._runs("bf16") else None
        if weight.dtype == torch.float32:
            return self._decode_pack("f32", weight) if n % 16 == 0 and self._runs("f32") else None
        return None

    def _runs(self, kernel: str) -> bool:
        """Whether ``<kernel>_linear`` runs here (an extension from another commit may lack it)."""
        return bool(getattr(self.ext, f"{kernel}_linear_supported", lambda: False)())

    def _decode_pack(self, kernel: str, weight: Tensor) -> DecodeWeight:
        ext = self.ext
        return DecodeWeight(getattr(ext, f"{kernel}_pack_weight")(weight.detach()), getattr(ext, f"{kernel}_linear"),
                            int(getattr(ext, f"{kernel}_linear_rows")))

    def layer_stack(self, layers: Sequence[StackedLayer], final_norm: Tensor, shape: StackShape) -> LayerStack | None:
        """The C++ ``DecoderStack`` over ``layers``: each layer's ops as the modules run them, through these
        kernels and oneDNN's packed GEMMs. None for an extension built before it existed (another commit's
        kernels, benchmarks/cpu_attention.py --base)."""
        if not hasattr(self.ext, "DecoderStack"):
            return None
        # An extension from before the decode packs (another commit's) takes the layers without them.
        weights = [self.ext.LayerWeights(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)
                                            if not f.name.endswith("_decode") or getattr(layer, f.name) is not None})
                   for layer in layers]
        stack: LayerStack = self.ext.DecoderStack(weights, final_norm, shape.eps, shape.num_heads, shape.num_kv_heads,
                                                  shape.head_dim, shape.scale)
        return stack


__all__ = ["ISAS", "CpuKernels", "amx_allowed", "build_all", "load_extension", "selected_isa", "supported_isas", "testable_isas"]


def build_all(names: Sequence[str]) -> int:
    """Build each ISA's kernels in a process of its own, side by side (one compiler each), printing a
    ``built PATH`` line per build in the order given; returns how many failed (their output goes to stderr)."""
    procs = [subprocess.Popen([sys.executable, "-m", "kernels.cpu_kernels", name], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parent.parent) for name in names]
    failed = 0
    for proc in procs:
        out, _ = proc.communicate()
        print(out, end="", flush=True)
        failed += proc.returncode != 0
    return failed


if __name__ == "__main__":
    # `python -m kernels.cpu_kernels [ISA...]`: build now. `--testable`: the selected build first, then the
    # others the tests cover on this CPU (scripts/setup.sh builds them, so no test waits on a compiler).
    if sys.argv[1:] == ["--testable"]:
        first = selected_isa()
        sys.exit(build_all([first, *(i for i in testable_isas() if i != first)]))
    for name in sys.argv[1:] or [selected_isa()]:
        print(f"built {load_extension(name).__file__}")
