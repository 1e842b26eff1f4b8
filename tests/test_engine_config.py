"""EngineConfig: the one list of engine settings; what it refuses, how it resolves sizes, and that it crosses a
process boundary (ProcessEngine pickles it to its child)."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig


def test_it_is_frozen_and_pickles() -> None:
    config = EngineConfig(model="m.gguf", dtype="float32", num_kv_blocks=64, preemption_mode="recompute")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "bfloat16"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config


def test_a_path_model_becomes_its_string() -> None:
    assert EngineConfig(model=Path("/models/x.gguf")).model == "/models/x.gguf"  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    {"dtype": "float64"}, {"device": "tpu"}, {"attention_backend": "flash"}, {"linear_backend": "mkl"},
    {"preemption_mode": "drop"}, {"kv_reservation": "half"}, {"num_kv_blocks": 8, "kv_cache_mb": 8},
    {"block_size": 0}, {"num_kv_blocks": 0}, {"engine_threads": 0}, {"swap_space_mb": -1},
])
def test_bad_settings_are_refused_when_built(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**bad)  # type: ignore[arg-type]


def test_cache_sizes_come_from_blocks_or_megabytes() -> None:
    block_bytes = 2**20 // 4  # four blocks per MiB
    assert EngineConfig(num_kv_blocks=10, swap_space_mb=2).cache_config(block_bytes) == CacheConfig(16, 10, 8, True)
    assert EngineConfig(kv_cache_mb=3, swap_space_mb=0).cache_config(block_bytes).num_device_blocks == 12
    assert EngineConfig().cache_config(block_bytes).num_device_blocks == 1024 * 4  # the 1 GiB default
    assert EngineConfig(kv_cache_mb=1).cache_config(2**21).num_device_blocks == 1  # never zero blocks


def test_max_model_len_defaults_to_what_fits_and_is_bounded_by_the_model() -> None:
    cache = CacheConfig(block_size=16, num_device_blocks=8)
    assert EngineConfig().scheduler_config(2048, cache).max_model_len == 128  # 8 blocks of 16
    assert EngineConfig().scheduler_config(100, cache).max_model_len == 100
    assert EngineConfig(max_model_len=1000).scheduler_config(2048, cache).max_model_len == 1000
    with pytest.raises(ValueError, match="exceeds the model"):
        EngineConfig(max_model_len=4096).scheduler_config(2048, cache)
    sched = EngineConfig(max_num_seqs=3, max_waiting=5, kv_reservation="max_len").scheduler_config(2048, cache)
    assert (sched.max_num_seqs, sched.max_waiting, sched.kv_reservation) == (3, 5, "max_len")


@pytest.mark.parametrize("policy", ["paged", "max", "max_len", "pow2", "oracle"])
def test_every_kv_reservation_policy_reaches_the_scheduler(policy: str) -> None:
    cache = CacheConfig(block_size=16, num_device_blocks=8)
    assert EngineConfig(kv_reservation=policy).scheduler_config(2048, cache).kv_reservation == policy  # type: ignore[arg-type]


def test_config_imports_no_torch() -> None:
    code = "import sys, engine.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
