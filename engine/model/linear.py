"""Linear layers whose weights are packed once, at load, into oneDNN's blocked layout.

Plain ``F.linear`` re-lays out (or streams unblocked) the weight on every call; on CPU the model's
linears are most of a step, and oneDNN's packed GEMMs use AMX / AVX512-BF16 for bf16 where the CPU has
them, and AVX-512 for fp32 on CPUs where MKL's sgemm does not (AMD). One packing serves every batch
size. ``torch.ops.mkldnn._reorder_linear_weight`` packs, ``_linear_pointwise`` multiplies; both ship
with stock torch on x86. Packing is CPU-only and skipped, with a log line, where oneDNN cannot run the
dtype natively (bf16 without AVX512-BF16 falls to a reference path several times slower than fp32).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.quant import Int8Weight, make_int8_weight
from kernels.backend import DecodeWeight

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


# The row counts oneDNN's packed GEMMs may run slower than a few rows more: with AMX and bf16, a pass of the
# model's packed linears at 17-32 rows can take much longer than at 16 or at 33-40, and at other times on
# the same machine no longer (benchmarks/gemm_row_band.py measures the band). Padding it to 33 rows is
# checked once, at load (``probe_slow_rows``): it pads unless 33 rows measures slower than 32 there, since
# where the band is not slow at load it may be later, and where 33 rows costs more (a compute-bound GEMM) it
# is left alone.
SLOW_ROWS = range(17, 33)


def probe_slow_rows(run: Callable[[int], object], reps: int = 5, gain: float = 1.0,
                    clock: Callable[[], float] = time.perf_counter) -> range | None:
    """``SLOW_ROWS`` if running the model's linears (``run(rows)``) at one row past the band takes less than
    ``gain`` times as long as at its last count, else None. Medians of alternated reps, after one untimed
    pass of each (oneDNN builds a primitive per new row count); not minima, since on a shared machine a slow
    count has fast outliers too."""
    last, padded = SLOW_ROWS.stop - 1, SLOW_ROWS.stop
    times: dict[int, list[float]] = {last: [], padded: []}
    for rows in times:
        run(rows)
    for _ in range(reps):
        for rows, seen in times.items():
            start = clock()
            run(rows)
            seen.append(clock() - start)
    at_last, at_padded = statistics.median(times[last]), statistics.median(times[padded])
    slow = at_padded < gain * at_last
    log.info("packed linears at %d rows %.1f ms, at %d rows %.1f ms: %s", last, at_last * 1e3, padded,
             at_padded * 1e3, f"rows {SLOW_ROWS.start}-{last} run as {padded}" if slow else "no padding")
    return SLOW_ROWS if slow else None


def remembered_probe(path: Path, key: Mapping[str, object], probe: Callable[[], range | None]) -> range | None:
    """``probe()``'s decision as last made for ``key`` (the machine, torch, threads, dtype and linear shapes:
    what the timing depends on), read from ``path``; probed and written there when absent. The probe runs
    the model's linears a dozen times (seconds of a start-up on 2 cores), and every start of the same model on
    the same machine would measure the same thing. Deleting the file measures again. An unreadable file is
    probed over, never an error."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    try:
        known = json.loads(path.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(digest)
    if isinstance(entry, dict) and isinstance(entry.get("slow"), bool):
        log.info("packed linears' slow-row band as probed before (%s): %s", path,
                 "padded" if entry["slow"] else "no padding")
        return SLOW_ROWS if entry["slow"] else None
    found = probe()
    known[digest] = {"slow": found is not None, "key": dict(key)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: processes starting together each write a whole file
    except OSError as e:
        log.warning("cannot remember the slow-row probe in %s: %s", path, e)
    return found


def gemm_rows(tokens: int, slow: range | None = None) -> int:
    """The row count a step of ``tokens`` tokens is padded to when its linears are packed for oneDNN.

    oneDNN builds (and caches) a GEMM primitive per input shape, which costs a single-threaded few
    milliseconds per weight shape the first time a row count is seen: for a step of the model's linears, a
    sizeable share of a step that mixes decodes with a short prompt. Prompts make nearly every such
    step a new row count, so rows are rounded up to a few shapes instead: 64 and below stay exact (decode
    batches, at most max_num_seqs of them), above that a multiple of 1/16 to 1/32 of the count, so the
    padding costs a few percent of a step while ~16 shapes cover each doubling. Counts in ``slow`` (a band
    ``probe_slow_rows`` found slower than ``slow.stop`` rows) run as ``slow.stop``.
    """
    if slow is not None and tokens in slow:
        return slow.stop
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
    (checkpoint loading, tests and the LM head's tied embedding read it). With a ``decode`` copy too (the
    backend's ``decode_weight``, set by the model), a decode's few rows run on it instead. After :meth:`quantize`
    it runs in int8 instead (see engine.model.quant).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.packed: Tensor | None = None
        self.decode: DecodeWeight | None = None
        self.int8: Int8Weight | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def quantize(self, kernel: str) -> None:
        """Run in int8 with ``kernel`` ("onednn" or "fbgemm") from now on; a packed copy is dropped."""
        self.int8 = make_int8_weight(self.weight, kernel)
        self.packed = self.decode = None

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.int8 is not None:
            return self.int8(x, bias)
        if self.decode is not None and bias is None and x.dim() == 2 and x.shape[0] <= self.decode.max_rows:
            return self.decode(x)  # the rule the C++ layer loop follows (cpu_kernels.cpp, project)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.bias)


__all__ = ["LINEAR_BACKENDS", "SLOW_ROWS", "Linear", "LinearBackend", "gemm_rows", "probe_slow_rows", "onednn_supports", "pack_weight", "packed_linear",
           "resolve_linear_backend"]
