"""What every benchmark record says about where it ran: CPU, ISA, cores, torch, commit, and how busy the
machine was around each run.

A number without this is not comparable: bf16 matmuls are several times faster with AMX than on an AVX2
core, and a load average above zero means another process took CPU time from the run being measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The flags that decide which matmul and attention paths a CPU gets (vLLM's and ours).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
# Settings that cap the instruction set below what the CPU has (to run the AVX2 paths on an AVX-512 machine):
# a record made under any of them says so. MKL is there because torch's float32 F.linear is MKL's SGEMM, which
# ignores the oneDNN and ATen caps (any linear left unpacked: ``--linear-backend torch``, vLLM's fallback).
ISA_CAPS = ("CHATSVC_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
# Above this 1-minute load average before a run, something else is using a core.
BUSY_LOAD = 0.5


def cpu_model() -> str:
    """``model name`` from ``/proc/cpuinfo``, with the x86 family and model: a VM's CPU often reads only "AMD
    EPYC", which a Zen 4 (family 25) and a Zen 5 (family 26) share while their AVX-512 runs at half and at
    full width."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                break  # the first processor's block ends at a blank line
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            family = f" (family {fields['cpu family']} model {fields['model']})" if "cpu family" in fields else ""
            return fields["model name"] + family
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The members of ``ISA_FLAGS`` this CPU reports (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [f for f in ISA_FLAGS if f in flags]


def cores() -> int:
    """CPUs this process may run on (the affinity mask, which a container or taskset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def commit() -> str:
    """Short sha of HEAD, ``-dirty`` when tracked files differ from it (what was measured is not the sha)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def load_avg() -> tuple[float, float, float]:
    """1, 5 and 15-minute load averages (what ``uptime`` prints)."""
    if hasattr(os, "getloadavg"):
        one, five, fifteen = os.getloadavg()
        return round(one, 2), round(five, 2), round(fifteen, 2)
    return float("nan"), float("nan"), float("nan")


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def bf16_supported() -> bool:
    """oneDNN has native bf16 here (AVX512-BF16 or AMX): the same test ``--dtype auto`` makes."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(dtype: str) -> str:
    """``auto`` -> ``bfloat16`` where oneDNN runs bf16 natively, else ``float32`` (emulated bf16 matmuls on
    an AVX2 core are several times slower than float32 ones); any other name is returned as is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if bf16_supported() else "float32"


# Instruction-set tiers, slowest first: what decides which matmul and attention paths run, so numbers are
# comparable only within one tier (and one dtype).
TIERS = ("generic", "avx2", "avx512", "amx")
# What each value of an ISA_CAPS variable caps the tier to (``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS``
# are matched by their longest prefix, their values naming ever larger AVX-512 subsets).
_CAP_TIERS: dict[str, dict[str, str]] = {
    # The avx512bf16 build runs AMX tiles where the CPU has them: only ONEDNN_MAX_CPU_ISA keeps it off them.
    "CHATSVC_CPU_ISA": {"generic": "generic", "avx2": "avx2", "avx512": "avx512", "avx512bf16": "amx"},
    "ATEN_CPU_CAPABILITY": {"default": "generic", "avx2": "avx2", "avx512": "avx512"},
    "ONEDNN_MAX_CPU_ISA": {"sse41": "generic", "avx": "generic", "avx2": "avx2", "avx512_core_amx": "amx",
                           "avx512": "avx512", "amx": "amx"},
    "MKL_ENABLE_INSTRUCTIONS": {"sse4_2": "generic", "avx": "generic", "avx2": "avx2", "avx512": "avx512"},
}
_PREFIX_MATCHED = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _cap_tier(name: str, value: str) -> str | None:
    table = _CAP_TIERS.get(name, {})
    value = value.strip().lower()
    if name in _PREFIX_MATCHED:
        for prefix, tier in sorted(table.items(), key=lambda kv: -len(kv[0])):  # longest prefix wins
            if value.startswith(prefix):
                return tier
        return None
    return table.get(value)


def parse_caps(caps: str | dict[str, str] | None) -> dict[str, str]:
    """``isa_caps`` as a record stores it (``"CHATSVC_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2"``) or a mapping."""
    if not caps:
        return {}
    if isinstance(caps, dict):
        return dict(caps)
    return dict(item.split("=", 1) for item in caps.split() if "=" in item)


def _cpu_tier(isa: list[str]) -> str:
    flags = set(isa)
    return ("amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else
            "avx2" if "avx2" in flags else "generic")


def _capped_tier(isa: list[str], caps: str | dict[str, str] | None) -> str:
    tier = _cpu_tier(isa)
    for name, value in parse_caps(caps).items():
        capped = _cap_tier(name, value)
        if capped is not None and TIERS.index(capped) < TIERS.index(tier):
            tier = capped
    return tier


def missing_caps(isa: list[str], caps: str | dict[str, str] | None) -> list[str]:
    """The ISA_CAPS a capped run lacks, as ``NAME=VALUE`` settings that would complete it: where one cap
    lowers the class, every library that would otherwise run the CPU's wider instructions must be capped too,
    or the record names a class part of it did not run in (MKL's SGEMM on AVX-512 under an "avx2" class).
    Empty when nothing is capped, or everything that must be is."""
    tier, cpu = _capped_tier(isa, caps), _cpu_tier(isa)
    if tier == cpu:
        return []
    needed = {"ONEDNN_MAX_CPU_ISA": {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16"}[tier],
              "MKL_ENABLE_INSTRUCTIONS": {"generic": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}[tier]}
    if TIERS.index(tier) < TIERS.index("avx512") <= TIERS.index(cpu):  # AVX-512 code in ATen and our kernels
        needed["ATEN_CPU_CAPABILITY"] = {"generic": "default", "avx2": "avx2"}[tier]
        needed["CHATSVC_CPU_ISA"] = tier
    given = parse_caps(caps)
    missing = []
    for name, value in needed.items():
        capped = _cap_tier(name, given[name]) if name in given else None
        if capped is None or TIERS.index(capped) > TIERS.index(tier):
            missing.append(f"{name}={value}")
    return missing


def machine_class(isa: list[str], dtype: str, caps: str | dict[str, str] | None = None) -> str:
    """The class a record belongs to, ``<tier>-<dtype>`` (``avx2-fp32``, ``avx512-bf16``, ``amx-bf16``...): the
    best tier the CPU's flags reach, lowered by any ISA cap the run was made under, and the dtype it ran
    (``auto``: the one the engine resolves it to on that tier).

    Two records of one class ran the same code paths; across classes the numbers differ by design."""
    flags = set(isa)
    tier = _capped_tier(isa, caps)
    if dtype == "auto":  # what the engine's ``--dtype auto`` picks: bf16 where the CPU has it natively
        native = tier in ("avx512", "amx") and bool(flags & {"avx512_bf16", "amx_bf16"})
        dtype = "bfloat16" if native else "float32"
    return f"{tier}-{_DTYPES.get(dtype, dtype)}"


def current_class(dtype: str) -> str:
    """This machine's class for a run in ``dtype`` (``auto`` resolved as the engine does), under the ISA caps
    set in this environment."""
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    return machine_class(isa_flags(), resolve_dtype(dtype), caps)


@dataclass
class Machine:
    cpu: str
    isa: list[str]
    cores: int
    torch: str | None
    commit: str
    python: str
    host: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d

    def line(self) -> str:
        return (f"{self.cpu}; ISA {' '.join(self.isa) or 'none of ' + '/'.join(ISA_FLAGS)}; {self.cores} cores; "
                f"torch {self.torch}; python {self.python}; commit {self.commit}"
                + "".join(f"; {k} {v}" for k, v in self.extra.items()))


def describe(**extra: Any) -> Machine:
    """This machine and checkout; ``extra`` adds fields (e.g. ``vllm="0.32.0"``), and ``isa_caps`` any ISA_CAPS
    set in the environment. Exits when those caps are partial (``missing_caps``): the record would name a
    class that part of the run was not in."""
    import platform

    caps = " ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name))
    missing = missing_caps(isa_flags(), caps)
    if missing:
        raise SystemExit(f"the ISA caps set here ({caps}) leave some libraries uncapped; set {' '.join(missing)} "
                         f"too, or none of them")
    return Machine(cpu_model(), isa_flags(), cores(), torch_version(), commit(), platform.python_version(),
                   platform.node(), {**({"isa_caps": caps} if caps else {}), **extra})


def warn_if_busy(label: str, load: tuple[float, float, float]) -> None:
    if load[0] > BUSY_LOAD:
        bar = "!" * 100
        print(f"{bar}\n!!! WARNING: 1-min load average {load[0]:.2f} > {BUSY_LOAD} before {label}: other work is "
              f"running on this machine, the numbers of this run are not trustworthy\n{bar}", file=sys.stderr,
              flush=True)


def settle(max_s: float, poll_s: float = 5.0) -> float:
    """Waits (at most ``max_s``) until the 1-min load average is back to ``BUSY_LOAD`` or below; returns the
    seconds waited. The 1-min average decays with a one-minute time constant, so right after a run of our
    own it reads ~2 on a quiet machine for about 1.5 minutes: without this, every run after the first would
    be flagged busy by the load its predecessor left behind."""
    start = time.monotonic()
    while load_avg()[0] > BUSY_LOAD and time.monotonic() - start < max_s:
        time.sleep(poll_s)
    return time.monotonic() - start


@contextmanager
def load_window(label: str, record: dict[str, Any]) -> Iterator[None]:
    """Records ``uptime``'s load averages before and after the block into ``record[label]`` (a dict with
    ``before``, ``after``, ``busy``) and warns loudly when the machine was busy at the start."""
    before = load_avg()
    warn_if_busy(label, before)
    entry: dict[str, Any] = {"before": list(before), "after": None, "busy": before[0] > BUSY_LOAD}
    record[label] = entry
    try:
        yield
    finally:
        entry["after"] = list(load_avg())


def record_path(benchmark: str, dtype: str = "auto") -> Path:
    """Where a run of ``benchmark`` here keeps its record: ``benchmarks/results/<benchmark>/<class>/``."""
    return ROOT / "benchmarks" / "results" / benchmark / current_class(dtype)


def report(lines: list[str], output: Path | None) -> None:
    """Prints a benchmark's report and, with ``output``, writes it there, replacing what was there: a record
    holds one run (``benchmarks/results/<benchmark>/<class>/record.txt``), git history the ones before."""
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    # `python benchmarks/machine.py [DTYPE]`: this machine's class for a run in DTYPE (default auto), the
    # folder name of the records a run here makes.
    print(current_class(sys.argv[1] if len(sys.argv) > 1 else "auto"))
