"""benchmarks/machine.py: the machine class a record belongs to, and where a run writes its record."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
XEON = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
ZEN5 = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
ZEN3 = ["avx2"]


def _load() -> ModuleType:
    # benchmarks/ is a folder of scripts, not an installed package: load the module from its file.
    spec = importlib.util.spec_from_file_location("bench_machine", ROOT / "benchmarks" / "machine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


machine = _load()


@pytest.mark.parametrize(("isa", "dtype", "expected"), [
    (XEON, "bfloat16", "amx-bf16"),
    (ZEN5, "bfloat16", "avx512-bf16"),
    (ZEN3, "float32", "avx2-fp32"),
    (XEON, "float32", "amx-fp32"),
    ([], "float32", "generic-fp32"),
])
def test_the_class_is_the_isa_tier_and_the_dtype(isa: list[str], dtype: str, expected: str) -> None:
    assert machine.machine_class(isa, dtype) == expected


@pytest.mark.parametrize(("isa", "expected"), [(XEON, "amx-bf16"), (ZEN5, "avx512-bf16"), (ZEN3, "avx2-fp32"),
                                               (["avx2", "avx512f"], "avx512-fp32")])
def test_auto_resolves_as_the_engine_does(isa: list[str], expected: str) -> None:
    """bf16 only where the CPU multiplies it natively (AVX512-BF16 or AMX), float32 elsewhere."""
    assert machine.machine_class(isa, "auto") == expected


def test_an_isa_cap_gives_the_capped_class() -> None:
    caps = "CHATSVC_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"
    assert machine.machine_class(ZEN5, "float32", caps) == "avx2-fp32"
    assert machine.machine_class(XEON, "auto", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == "avx512-bf16"
    assert machine.machine_class(XEON, "auto", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == "amx-bf16"
    assert machine.machine_class(ZEN3, "float32", {"CHATSVC_CPU_ISA": "generic"}) == "generic-fp32"
    # The avx512bf16 build still takes the tiles (kernels.cpu_kernels.amx_allowed): no cap below AMX.
    assert machine.machine_class(XEON, "auto", {"CHATSVC_CPU_ISA": "avx512bf16"}) == "amx-bf16"


def test_mkl_is_capped_like_onednn() -> None:
    """torch's float32 F.linear is MKL's SGEMM, which neither the oneDNN nor the ATen cap reaches."""
    assert machine.machine_class(XEON, "float32", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}) == "avx2-fp32"
    assert machine.machine_class(XEON, "auto", {"MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"}) == "avx512-bf16"
    assert machine.machine_class(XEON, "float32", {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}) == "generic-fp32"


def test_partial_caps_name_what_is_missing() -> None:
    avx2 = "CHATSVC_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"
    assert machine.missing_caps(XEON, avx2) == ["MKL_ENABLE_INSTRUCTIONS=AVX2"]
    assert machine.missing_caps(XEON, avx2 + " MKL_ENABLE_INSTRUCTIONS=AVX2") == []
    assert machine.missing_caps(XEON, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ["MKL_ENABLE_INSTRUCTIONS=AVX512"]
    assert machine.missing_caps(XEON, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                                       "MKL_ENABLE_INSTRUCTIONS": "AVX512"}) == []
    # A cap above the class counts as missing: MKL on AVX-512 under an AVX2 oneDNN.
    assert machine.missing_caps(ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                                       "ATEN_CPU_CAPABILITY": "avx2", "CHATSVC_CPU_ISA": "avx2"}) == [
        "MKL_ENABLE_INSTRUCTIONS=AVX2"]
    # On an AVX2 CPU an AVX2 cap caps nothing; no cap at all is complete.
    assert machine.missing_caps(ZEN3, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == []
    assert machine.missing_caps(XEON, None) == []


def test_describe_refuses_partial_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "isa_flags", lambda: XEON)
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    with pytest.raises(SystemExit, match="MKL_ENABLE_INSTRUCTIONS=AVX512"):
        machine.describe()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512")
    assert machine.describe().extra["isa_caps"] == "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MKL_ENABLE_INSTRUCTIONS=AVX512"


def test_a_cap_never_raises_the_tier() -> None:
    assert machine.machine_class(ZEN3, "float32", {"CHATSVC_CPU_ISA": "avx512bf16"}) == "avx2-fp32"
    assert machine.machine_class(ZEN3, "float32", {"SOMETHING_ELSE": "amx"}) == "avx2-fp32"


def test_parse_caps_reads_a_records_isa_caps() -> None:
    assert machine.parse_caps("CHATSVC_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2") == {
        "CHATSVC_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert machine.parse_caps(None) == {}


def test_current_class_counts_the_caps_set_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATSVC_CPU_ISA", "generic")
    assert machine.current_class("float32") == "generic-fp32"
    assert machine.record_path("step_ab", "float32") == ROOT / "benchmarks" / "results" / "step_ab" / "generic-fp32"


def test_report_replaces_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step_ab" / "avx2-fp32" / "record.txt"
    machine.report(["# first run", "{}"], out)
    machine.report(["# second run", '{"a": 1}'], out)
    assert out.read_text() == '# second run\n{"a": 1}\n'
    assert "# second run" in capsys.readouterr().out
