from __future__ import annotations

import json
import types

import pytest
import torch

from kernels import TorchBackend, cpu_kernels
from kernels.cpu_kernels import CpuKernels
from kernels.runtime import KernelRuntime, build_error_gist, describe_runtime

# torch's RuntimeError for a build whose compiler is missing: the command, then ninja's output.
NO_COMPILER = (
    "Error building extension 'chatsvc_cpu_kernels_avx2': [1/2] c++ -MMD -MF cpu_kernels.o.d -O3 -c x.cpp\n"
    "FAILED: cpu_kernels.o \n"
    "c++ -MMD -MF cpu_kernels.o.d -O3 -c x.cpp\n"
    "/bin/sh: 1: c++: not found\n"
    "ninja: build stopped: subcommand failed.\n")


@pytest.fixture
def no_build_failures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Exception]:
    failures: dict[str, Exception] = {}
    monkeypatch.setattr(cpu_kernels, "_build_failure", failures)
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    return failures


def test_the_cpp_kernels_are_named_with_their_isa_build(no_build_failures: dict[str, Exception]) -> None:
    backend = CpuKernels(ext=types.ModuleType("chatsvc_cpu_kernels_avx2"))
    rt = describe_runtime(backend, torch.bfloat16)
    assert rt == KernelRuntime(kernels="cpp", isa="avx2", cpu_isa=cpu_kernels.supported_isas()[0],
                               dtype="bfloat16", threads=torch.get_num_threads(), device="cpu", fallback=None)
    assert rt.describe().startswith("C++ CPU kernels (avx2 build) on cpu, dtype bfloat16, ")


def test_an_extension_of_another_name_has_no_isa(no_build_failures: dict[str, Exception]) -> None:
    rt = describe_runtime(CpuKernels(ext=types.ModuleType("base_kernels")), "float32")
    assert (rt.kernels, rt.isa, rt.dtype) == ("cpp", None, "float32")
    assert rt.describe().startswith("C++ CPU kernels on cpu")


def test_the_torch_kernels_say_why_the_cpp_build_is_not_running(no_build_failures: dict[str, Exception]) -> None:
    rt = describe_runtime(TorchBackend(), torch.float32)
    assert (rt.kernels, rt.isa, rt.fallback) == ("torch", None, None)  # asked for, or never tried

    no_build_failures[cpu_kernels.selected_isa()] = RuntimeError(NO_COMPILER)
    rt = describe_runtime(TorchBackend(), torch.float32)
    assert rt.fallback == "Error building extension 'chatsvc_cpu_kernels_avx2': /bin/sh: 1: c++: not found"
    assert "C++ build failed: Error building extension" in rt.describe()


def test_a_forced_isa_this_cpu_cannot_run_is_the_reason(no_build_failures: dict[str, Exception],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "no-such-isa")
    rt = describe_runtime(TorchBackend(), torch.float32)
    assert rt.fallback is not None and "no-such-isa" in rt.fallback


def test_the_thread_count_is_the_processs_now() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert describe_runtime(TorchBackend(), torch.float32).threads == 1
    finally:
        torch.set_num_threads(before)


def test_triton_off_the_cpu_has_no_cpu_fields() -> None:
    rt = describe_runtime(types.SimpleNamespace(name="triton"), torch.float16, device="cuda")
    assert rt == KernelRuntime(kernels="triton", isa=None, cpu_isa=None, dtype="float16",
                               threads=torch.get_num_threads(), device="cuda", fallback=None)
    assert rt.describe().startswith("Triton kernels on cuda, dtype float16")


def test_as_dict_is_flat_json() -> None:
    rt = describe_runtime(TorchBackend(), torch.bfloat16)
    d = rt.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d) == {"kernels", "isa", "cpu_isa", "dtype", "threads", "device", "fallback"}
    assert all(v is None or isinstance(v, str | int) for v in d.values())


@pytest.mark.parametrize(("message", "gist"), [
    (NO_COMPILER, "Error building extension 'chatsvc_cpu_kernels_avx2': /bin/sh: 1: c++: not found"),
    ("Error building extension 'x': [1/2] c++ ...\nx.cpp:3:10: fatal error: Python.h: No such file or directory\n",
     "Error building extension 'x': x.cpp:3:10: fatal error: Python.h: No such file or directory"),
    ("ninja is required to load C++ extensions", "ninja is required to load C++ extensions"),
    ("", "RuntimeError"),
])
def test_build_error_gist(message: str, gist: str) -> None:
    assert build_error_gist(RuntimeError(message)) == gist


def test_build_error_gist_is_bounded() -> None:
    assert len(build_error_gist(RuntimeError("x" * 1000), limit=50)) == 50
