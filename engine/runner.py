"""The mechanism: owns the KV tensors, turns a scheduler step into tensors, runs the model.

It executes the scheduler's block plans (swap out, swap in, copy-on-write copies) before the
forward pass that needs them, then runs every scheduled sequence in one flattened batch:
single-token decodes first, then prefill chunks, no padding between sequences.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.config import CacheConfig
from engine.model import ModelConfig
from engine.model.attention import AttentionMetadata
from engine.model.llama import LlamaForCausalLM
from engine.plan import ScheduledSeq, SchedulerOutput
from kernels import AttentionBackend


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS (process-wide).

    Every step allocates and frees the same large temporaries (gathered K/V, activations). By
    default glibc serves big ones with fresh mmaps and trims the heap on free, so each step
    page-faults its whole working set again: ~290k faults per decode step at batch 64 in float32,
    about half the step time. Keeping the memory removes that (the working set stays mapped).
    Returns whether the settings were applied (False off glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@dataclass(frozen=True)
class ModelInput:
    input_ids: Tensor
    positions: Tensor
    attn_metadata: AttentionMetadata
    order: tuple[ScheduledSeq, ...]  # the scheduled sequences in batch order
    sample_rows: Tensor  # token row of each sampling sequence's last scheduled token
    samplers: tuple[ScheduledSeq, ...]  # the sequences those rows belong to


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        backend: AttentionBackend,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.config = config
        self.backend = backend
        self.block_size = block_size = cache.block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
        per_block = (block_size, config.num_kv_heads, config.head_dim)
        shape = (config.num_layers, 2, cache.num_device_blocks, *per_block)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        cpu_shape = (config.num_layers, 2, cache.num_cpu_blocks, *per_block)
        self.cpu_cache = torch.zeros(cpu_shape, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")

    # -- block plans ----------------------------------------------------------------------------
    def _mapping(self, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)

    def execute_block_plans(self, out: SchedulerOutput) -> None:
        # Order matters: blocks swapped out may be handed to other sequences in this same step.
        if out.blocks_to_swap_out:
            self.backend.swap_blocks(self.kv_cache, self.cpu_cache, self._mapping(out.blocks_to_swap_out))
        if out.blocks_to_swap_in:
            self.backend.swap_blocks(self.cpu_cache, self.kv_cache, self._mapping(out.blocks_to_swap_in))
        if out.blocks_to_copy:
            self.backend.copy_blocks(self.kv_cache, self._mapping(out.blocks_to_copy).to(self.device))

    # -- inputs -----------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> ModelInput:
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        order = decodes + prefills
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        samplers: list[ScheduledSeq] = []
        max_blocks = max(len(s.block_table) for s in order)
        tables = [list(s.block_table) + [0] * (max_blocks - len(s.block_table)) for s in order]
        for item in order:
            start, end = item.start, item.start + item.num_new_tokens
            table = item.block_table
            input_ids.extend(item.seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + item.num_new_tokens)
            context_lens.append(end)
            if item.samples:
                sample_rows.append(query_start[-1] - 1)
                samplers.append(item)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            num_decodes=len(decodes),
            max_query_len=max(s.num_new_tokens for s in order),
            max_context_len=max(context_lens),
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attn_metadata=meta,
            order=tuple(order),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            samplers=tuple(samplers),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[Tensor | None, tuple[ScheduledSeq, ...]]:
        """Run one step; returns float32 logits for each sampling sequence (None if none samples)."""
        self.execute_block_plans(out)
        if not out.scheduled:
            return None, ()
        inp = self.prepare(out)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)
        if not inp.samplers:
            return None, ()
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        return logits, inp.samplers
