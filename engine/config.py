"""Frozen engine settings: ``EngineConfig`` as given (by ``LLM(...)``, the CLI, a test), and the cache and
scheduler configs the engine resolves from it once the model is known (sizes in blocks, the context limit).

``EngineConfig`` is the one list of engine settings: ``LLM``, ``LLMEngine``, ``AsyncEngine``, ``ProcessEngine``
and the CLI (whose engine flags are generated from its fields) all build one. Each field's ``help`` metadata is
its documentation and the CLI's help text.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

PreemptionMode = Literal["auto", "swap", "recompute"]
# How much KV a request reserves at admission. "paged" reserves nothing ahead (blocks as tokens arrive); the
# others are the PagedAttention paper's Orca baselines, for benchmarks only: "max" (alias "max_len") reserves
# max_model_len tokens, "pow2" the prompt plus the next power of two of the request's true output length,
# "oracle" the prompt plus exactly that length (both read it from ``SamplingParams.reserve_output_tokens``).
KVReservation = Literal["paged", "max", "max_len", "pow2", "oracle"]
RESERVATIONS_NEEDING_OUTPUT_LENGTH = ("pow2", "oracle")
DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton"]
LinearBackendName = Literal["auto", "onednn", "torch"]
Quantization = Literal[None, "int8"]

DEFAULT_KV_CACHE_MB = 1024


def _setting(default: Any, help: str) -> Any:  # noqa: A002 - argparse's word
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _setting(None, "model name or path (default: SmolLM2-135M-Instruct GGUF)")
    dtype: DType = _setting(
        "auto", "auto: bfloat16 where the CPU (AVX512-BF16/AMX) or GPU multiplies it natively, else float32")
    device: Device = _setting("cpu", "where the model and the KV cache live")
    block_size: int = _setting(16, "tokens per KV block")
    num_kv_blocks: int | None = _setting(None, "KV blocks on the device (default: from kv_cache_mb)")
    kv_cache_mb: int | None = _setting(
        None, f"KV cache size in MiB, per tensor-parallel rank (default {DEFAULT_KV_CACHE_MB})")
    swap_space_mb: int = _setting(256, "CPU swap space for preempted sequences' KV, in MiB")
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV of identical prompt prefixes (off: for measuring what it buys; personas then pin "
              "nothing)")
    max_num_seqs: int = _setting(64, "sequences running at once")
    max_num_batched_tokens: int = _setting(2048, "tokens per step (prefill chunks and decodes together)")
    max_model_len: int | None = _setting(
        None, "longest prompt + reply in tokens (default: the model's limit, or what the KV cache holds)")
    max_waiting: int = _setting(1024, "waiting-queue bound; beyond it requests are refused (the gateway's 429)")
    preemption_mode: PreemptionMode = _setting(
        "auto", "how a preempted request gives its blocks back when the pool is full: swap to CPU, recompute "
                "later, or auto: whichever the engine's measured swap and prefill costs say is cheaper")
    kv_reservation: KVReservation = _setting(
        "paged", "benchmark baselines (the paper's Orca): max (alias max_len) reserves max_model_len tokens per "
                 "sequence at admission; pow2 the prompt + the next power of two of the request's true output "
                 "length, oracle the prompt + exactly that length (both need reserve_output_tokens on every "
                 "request)")
    attention_backend: AttentionBackendName = _setting(
        "auto", "auto: Triton on CUDA, the C++ kernels on CPU (torch's where they cannot be built)")
    linear_backend: LinearBackendName = _setting(
        "auto", "onednn: weights packed once for oneDNN (auto: where it runs the dtype natively)")
    quantization: Quantization = _setting(
        None, "int8: the projections (not the LM head) in int8, weights per channel, activations per token "
              "(oneDNN; CPUs with VNNI/AMX only). Costs accuracy and, with native bf16, speed: see README")
    engine_threads: int | None = _setting(None, "torch threads of the engine (default: as torch chooses; all "
                                                "cores in an engine process); split evenly among the "
                                                "tensor-parallel ranks")
    adaptive_threads: bool | None = _setting(
        None, "run each step on engine_threads or one fewer, whichever its measured step times say is faster "
              "(default: on in an engine process, which shares the cores with the gateway; off in LLM and with "
              "tensor parallelism)")
    tensor_parallel_size: int = _setting(
        1, "processes the model is sharded over (heads, MLP features, vocabulary); it must divide the model's KV "
           "heads. The engine spawns the other ranks itself, or joins the ranks torchrun started")
    kv_host_bytes: int = _setting(
        0, "host-memory tier under the KV pool, in bytes (0: off): full blocks the pool evicts are copied there "
           "and restored instead of recomputed when their prefix returns")
    kv_disk_dir: str | None = _setting(
        None, "directory of the disk tier under the host tier (chatsvc: <data dir>/kv when --kv-disk-bytes is "
              "set); kept across restarts")
    kv_disk_bytes: int = _setting(
        0, "disk tier size in bytes (0: off); needs kv_host_bytes, through which its blocks are loaded")
    kv_host_preload: bool = _setting(
        True, "at start-up, refill the host tier from the disk tier in the background (most recently used "
              "first, up to kv_host_bytes, never evicting): the first turns after a restart restore from memory")

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a Path is as good as its string, and pickles the same
            object.__setattr__(self, "model", os.fspath(self.model))
        _check_choices(self)
        if self.num_kv_blocks is not None and self.kv_cache_mb is not None:
            raise ValueError("give num_kv_blocks or kv_cache_mb, not both")
        _check_at_least(self, 1, "block_size", "num_kv_blocks", "kv_cache_mb", "engine_threads",
                        "tensor_parallel_size")
        _check_at_least(self, 0, "swap_space_mb", "kv_host_bytes", "kv_disk_bytes")
        if isinstance(self.kv_disk_dir, os.PathLike):
            object.__setattr__(self, "kv_disk_dir", os.fspath(self.kv_disk_dir))
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("kv_disk_bytes needs kv_disk_dir")
        if self.kv_disk_bytes and not self.kv_host_bytes:
            raise ValueError("kv_disk_bytes needs kv_host_bytes: disk blocks are loaded through the host tier")
        if self.kv_host_bytes and self.tensor_parallel_size > 1:
            raise ValueError("the KV host and disk tiers are not supported with tensor parallelism")
        if self.kv_host_bytes and not self.enable_prefix_caching:
            raise ValueError("the KV host and disk tiers need enable_prefix_caching: they are keyed by its hashes")

    def cache_config(self, block_bytes: int) -> CacheConfig:
        """Sizes in blocks, for blocks of ``block_bytes`` (all layers' K and V of ``block_size`` tokens)."""
        mb = self.kv_cache_mb or DEFAULT_KV_CACHE_MB
        num_blocks = self.num_kv_blocks or max(1, mb * 2**20 // block_bytes)
        return CacheConfig(self.block_size, num_blocks, self.swap_space_mb * 2**20 // block_bytes,
                           self.enable_prefix_caching, self.kv_host_bytes // block_bytes)

    def scheduler_config(self, model_limit: int, cache: CacheConfig) -> SchedulerConfig:
        """``model_limit``: the model's positions, which bound max_model_len (and are its default, up to
        what the cache holds)."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(model_limit, cache.num_device_blocks * cache.block_size)
        elif max_model_len > model_limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_limit} positions")
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)}
        return SchedulerConfig(**{**same, "max_model_len": max_model_len})


def literal_choices(hint: Any) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` type hint; () for any other hint."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _check_choices(config: Any) -> None:
    """ValueError for a field of a config dataclass whose value is not one its ``Literal`` hint allows."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        choices = literal_choices(hints[f.name])
        if choices and getattr(config, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(config, f.name)!r}")


def _check_at_least(config: Any, minimum: int, *names: str) -> None:
    """ValueError for any of the fields ``names`` below ``minimum`` (unset ones, None, pass)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_device_blocks: int = 1024
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    # Blocks of the host tier (engine.kv_tiers); 0: no tier.
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "block_size", "num_device_blocks")
        _check_at_least(self, 0, "num_cpu_blocks", "num_host_blocks")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = "auto"
    # Anything but "paged" reserves a sequence's blocks at admission (see ``KVReservation``): the
    # contiguous-reservation baselines of the PagedAttention paper, kept for benchmarks only.
    kv_reservation: KVReservation = "paged"
    # Bound on the waiting queue; the gateway turns a full queue into 429.
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")
        _check_at_least(self, 2, "max_model_len")
        _check_choices(self)
