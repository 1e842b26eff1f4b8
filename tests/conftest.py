"""Shared test setup.

The Triton interpreter is chosen when ``triton.jit`` decorates a kernel, so the variable must
be set before any kernel module is imported; conftest runs before test modules are imported.

Every test timeout (the ini default and each ``pytest.mark.timeout``) is in seconds of the reference
machine and is scaled to this one when the test starts (tests/timing.py), so a busy or slower machine
does not fail tests that are merely slow there.

Tests marked ``long`` (multi-process chaos, soak) are skipped unless ``--run-long`` is given: README's test
command stays short, and .ci/run runs them after it.

The run can be spread over pytest-xdist worker processes, a test module at a time (``-n 3 --dist loadfile``):
many tests wait on subprocesses, Redis and servers, and more workers than cores fill that idle time. Module-scoped
fixtures (one model load, one server per module) stay shared within their module only with ``loadfile``. A
worker gives torch its share of the cores, not all of them, so that the workers do not oversubscribe them.

httpx builds a new SSL context for every client, loading certifi's CA bundle each time; the tests make
thousands of clients (``httpx.get`` in polling loops), every one to a plain-HTTP server on localhost, and a
run spent about 35 s of CPU loading that bundle. Clients that take httpx's default verification share one
context instead (``share_default_ssl_context``); a client given its own ``verify`` or ``cert`` is untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import Any

import background
import pytest
import pytest_timeout
from timing import calibrated_slowdown, load_slowdown, slowdown

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_as_found() -> Iterator[None]:
    """A module that sets torch's thread count for its own engines leaves it as it found it, so the modules
    after it run as they do alone (torch is only looked at, never imported, here)."""
    before = torch.get_num_threads() if (torch := sys.modules.get("torch")) is not None else None
    yield
    if before is not None and (torch := sys.modules.get("torch")) is not None:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _freed_memory_returned() -> Iterator[None]:
    """A module's freed engines go back to the OS when it ends. Every CPU engine sets glibc to keep freed
    memory (``engine.runner.keep_freed_memory``), so without this a worker stays at the peak of every module
    it ran, and three workers of float32 engines (an AVX2-only CPU's dtype) outgrow a 24 GiB machine."""
    yield
    if not sys.platform.startswith("linux"):
        return
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _xdist_workers() -> int:
    """How many xdist workers share the machine when this process is one of them, else 0."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) if "PYTEST_XDIST_WORKER" in os.environ else 0


def share_default_ssl_context(package: str) -> None:
    """Make ``package`` (httpx, or the copy the openai SDK ships as httpx2) build its default client SSL
    context once per process: one for each value of the SSL_CERT_FILE and SSL_CERT_DIR it reads per client.
    A client given its own ``verify`` or ``cert`` gets its own context, as httpx builds it."""
    try:
        transports = importlib.import_module(f"{package}._transports.default")
    except ImportError:
        return
    build: Callable[..., ssl.SSLContext] = getattr(transports, "create_ssl_context")  # noqa: B009
    if getattr(build, "shares_default", False):
        return
    shared: dict[tuple[str | None, ...], ssl.SSLContext] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else (None, None)
        if key not in shared:
            shared[key] = build(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    create_ssl_context.shares_default = True  # type: ignore[attr-defined]
    setattr(transports, "create_ssl_context", create_ssl_context)  # noqa: B010 - a module, typed as Any


def pytest_configure(config: pytest.Config) -> None:
    for package in ("httpx", "httpx2"):
        share_default_ssl_context(package)
    if workers := _xdist_workers():
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"time limits x{slowdown():.2f} of the reference machine's (loop x{calibrated_slowdown():.2f}, "
            f"load x{load_slowdown():.2f}; tests/timing.py)", f"engine: {_kernels_in_use()}"]


def _kernels_in_use() -> str:
    """What the engine tests compute with on this machine: the C++ kernels' ISA build, or the torch reference
    kernels and why (a failed build); loading them here builds them if setup has not."""
    from kernels import get_backend
    from kernels.runtime import describe_runtime

    return describe_runtime(get_backend("auto"), "float32").describe()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: pytest_timeout.Settings) -> bool:
    scaled = settings._replace(timeout=settings.timeout * slowdown())
    return bool(pytest_timeout.pytest_timeout_set_timer(item, scaled))


LONG_REASON = "long (multi-process chaos, soak or a benchmark smoke run): .ci/run runs it; pytest --run-long here"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-long", action="store_true",
                     help="also run the tests marked long, which the default run skips (.ci/run runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-long"):
        return
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason=LONG_REASON))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the long single-threaded jobs the collected tests will need (tests/background.py). Not in an xdist
    worker: every worker collects every test, so each would start them, and the test that needs a job starts
    it itself while the other workers keep the cores busy."""
    if _xdist_workers():
        return
    wanted = {item.nodeid for item in session.items if item.get_closest_marker("skip") is None}
    if any(n.startswith("tests/test_code_quality.py::test_mypy") for n in wanted):
        background.start("mypy-strict", background.STRICT_MYPY)
    if any(n.startswith("tests/test_kernels_cpu.py::") for n in wanted):
        from kernels import cpu_kernels

        background.start("kernel-builds", background.kernel_build(cpu_kernels.testable_isas()))


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()
