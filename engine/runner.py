"""The mechanism: owns the KV tensors, turns a scheduler step into tensors, runs the model.

It executes the scheduler's block plans (swap out, swap in, copy-on-write copies) before the
forward pass that needs them, then runs every scheduled sequence in one flattened batch:
single-token decodes first, then prefill chunks, no padding between sequences.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from engine.config import CacheConfig
from engine.model import ModelConfig
from engine.model.attention import AttentionMetadata
from engine.model.linear import Linear, gemm_rows, probe_slow_rows, remembered_probe
from engine.model.llama import LlamaForCausalLM
from engine.plan import ScheduledSeq, SchedulerOutput, StepSeq
from engine.tokenizer import cache_dir
from kernels import AttentionBackend


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False,
            zeroed: bool = True) -> Tensor:
    """A pool of the kernels' KV shape ``[layers, 2, blocks, block_size, Hkv, D]``, stored head-major within each
    block (``[..., Hkv, block_size, D]`` in memory) and returned as that shape's view.

    The pool the kernels read is zeroed: they mask the slots past a sequence's length, but a masked value still
    meets its zero weight, and 0 x NaN is NaN. ``zeroed=False`` is for the swap space and the host tier, whose
    blocks are read only after a whole block was written there: left untouched they cost neither the time to
    clear them at every engine start (256 MiB of swap space by default) nor memory until they are used.

    A decode work item reads one KV head of one sequence. Token-major, that head's rows of a block are
    ``block_size`` runs of D values with the other heads' rows between them, which the hardware prefetchers
    fetch too; head-major they are one run (4 KiB for SmolLM2 in float32). The kernels address the cache
    through its strides, so the view is all they see. Whole blocks stay one piece of memory for the block
    copies and swaps (the CPU pool has the same layout). ``benchmarks/step_ab.py`` times decode steps of a commit with
    the other layout against this checkout's, step by step.
    """
    layers, kv, blocks, block_size, heads, dim = shape
    make = torch.zeros if zeroed else torch.empty
    storage = make((layers, kv, blocks, heads, block_size, dim), dtype=dtype, device=device, pin_memory=pin_memory)
    return storage.transpose(3, 4)


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


class BlockTables:
    """Every scheduled sequence's block table as a row of one persistent int32 tensor, kept up to date by
    the plan's table updates (mostly a block appended every ``block_size`` tokens), so a step gathers its
    rows instead of rebuilding and padding every table from lists. Entries past a table's length are stale
    and never read: the kernels read only the blocks that hold a sequence's context."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = torch.zeros((rows, width), dtype=torch.int32)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(rows - 1, -1, -1))

    def update(self, item: StepSeq) -> int:
        """Apply one sequence's update (idempotent: a step re-run after a fault applies it again); its row."""
        seq_id = item.seq_id
        row = self._row.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * self.table.shape[0])
            row = self._row[seq_id] = self._free_rows.pop()
        end = item.table_start + len(item.new_blocks)
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        if item.new_blocks:
            self.table[row, item.table_start : end] = torch.tensor(item.new_blocks, dtype=torch.int32)
        return row

    def free(self, seq_id: int) -> None:
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self.table
        new_rows, new_width = rows or old.shape[0], width or old.shape[1]
        self.table = torch.zeros((new_rows, new_width), dtype=torch.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        self._free_rows[:0] = range(new_rows - 1, old.shape[0] - 1, -1)


S = TypeVar("S", bound=StepSeq)


@dataclass(frozen=True)
class ModelInput(Generic[S]):
    input_ids: Tensor
    positions: Tensor
    attn_metadata: AttentionMetadata
    sample_rows: Tensor  # token row of each sampling sequence's last scheduled token
    samplers: tuple[S, ...]  # the sequences those rows belong to


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_key(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, object]:
    """What the packed linears' timing at a row count depends on: the CPU and the ISA oneDNN may use, torch,
    the threads, the dtype and the weight shapes."""
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)})
    return {"cpu": cpu_model_name(), "capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(dtype),
            "shapes": [list(s) for s in shapes] + [[model.config.vocab_size, model.config.hidden_size]]}


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, cache: CacheConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        """``model``: this rank's whole model or shard; its ``layer_config`` shapes the KV cache."""
        self.model = model
        self.config = config = model.layer_config
        self.backend = backend
        self.block_size = block_size = cache.block_size
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()
        per_block = (block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = kv_pool((config.num_layers, 2, cache.num_device_blocks, *per_block), dtype, device)
        self.cpu_cache = kv_pool((config.num_layers, 2, cache.num_cpu_blocks, *per_block), dtype, "cpu",
                                 pin_memory=device.type == "cuda", zeroed=False)
        # The host tier of engine.kv_tiers: the same layout, so its blocks move with the same swap kernel.
        self.host_cache = kv_pool((config.num_layers, 2, cache.num_host_blocks, *per_block), dtype, "cpu",
                                  pin_memory=device.type == "cuda" and cache.num_host_blocks > 0, zeroed=False)
        self.block_tables = BlockTables()
        # Packed (oneDNN) linears pay for every new row count; F.linear and GPU GEMMs do not.
        self.pad_rows = model.lm_head_packed is not None
        # Row counts this CPU's packed GEMMs may run slower than a few rows more (engine.model.linear), padded
        # in every step (decode included) and at the LM head. Not under tensor parallelism: every rank must
        # pad alike. Nor where a decode's rows run on the extension's GEMM (amx_linear, bf16_linear, f32_linear),
        # which has no such band: padded from 32 to 33 rows, it would only multiply more rows.
        probe = self.pad_rows and model.tp is None and device.type == "cpu" and model.lm_head_decode is None
        self.slow_rows = (remembered_probe(cache_dir() / "gemm_probes.json", probe_key(model, dtype),
                                           lambda: probe_slow_rows(model.run_linears)) if probe else None)

    # -- block plans ----------------------------------------------------------------------------
    def _mapping(self, pairs: tuple[tuple[int, int], ...]) -> Tensor:
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)

    def execute_block_plans(self, out: SchedulerOutput) -> None:
        # Order matters: blocks evicted or swapped out may be handed to other sequences (and tier loads) in this
        # same step, so everything that reads the device pool's old contents goes first.
        if out.tiers.offload:
            self.backend.swap_blocks(self.kv_cache, self.host_cache, self._mapping(out.tiers.offload))
        if out.blocks_to_swap_out:
            self.backend.swap_blocks(self.kv_cache, self.cpu_cache, self._mapping(out.blocks_to_swap_out))
        if out.blocks_to_swap_in:
            self.backend.swap_blocks(self.cpu_cache, self.kv_cache, self._mapping(out.blocks_to_swap_in))
        if out.tiers.load:
            self.backend.swap_blocks(self.host_cache, self.kv_cache, self._mapping(out.tiers.load))
        if out.blocks_to_copy:
            self.backend.copy_blocks(self.kv_cache, self._mapping(out.blocks_to_copy).to(self.device))

    # -- inputs -----------------------------------------------------------------------------------
    def free_seq(self, seq_id: int) -> None:
        """Forget a sequence's block table (it finished or was aborted)."""
        self.block_tables.free(seq_id)

    def prepare(self, scheduled: Sequence[S]) -> ModelInput[S]:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        order = decodes + prefills
        rows = [self.block_tables.update(item) for item in order]
        input_ids = [t for item in order for t in item.new_token_ids]
        context_lens = [item.start + item.num_new_tokens for item in order]
        positions = [p for item, end in zip(order, context_lens, strict=True) for p in range(item.start, end)]
        query_start = list(itertools.accumulate((item.num_new_tokens for item in order), initial=0))
        samplers = [item for item in order if item.samples]
        sample_rows = [query_start[i + 1] - 1 for i, item in enumerate(order) if item.samples]
        bs = self.block_size
        max_context_len = max(context_lens)
        tables = self.block_tables.table[torch.tensor(rows), : -(-max_context_len // bs)]
        pos = torch.tensor(positions, dtype=torch.int64)
        # Each new token's slot: its sequence's block at its position, in one gather for the whole batch.
        new_tokens = torch.tensor([s.num_new_tokens for s in order])
        seq_of_token = torch.repeat_interleave(torch.arange(len(order)), new_tokens)
        slots = tables[seq_of_token, pos // bs].long() * bs + pos % bs
        dev = self.device
        num_tokens = len(input_ids)
        # Steps with a prompt chunk are padded to the row buckets; decode-only steps only out of the slow
        # band (their row counts are few already). Attention runs on the real rows alone
        # (AttentionMetadata.num_tokens).
        if self.pad_rows and prefills:
            rows_run = gemm_rows(num_tokens, self.slow_rows)
        elif self.slow_rows is not None and num_tokens in self.slow_rows:
            rows_run = self.slow_rows.stop
        else:
            rows_run = num_tokens
        if rows_run > num_tokens:  # padding: token 0 at position 0
            input_ids.extend([0] * (rows_run - num_tokens))
            pos = torch.cat((pos, pos.new_zeros(rows_run - num_tokens)))
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=tables.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            num_decodes=len(decodes),
            max_query_len=max(s.num_new_tokens for s in order),
            max_context_len=max_context_len,
            num_tokens=num_tokens if rows_run > num_tokens else None,
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=pos.to(dev),
            attn_metadata=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            samplers=tuple(samplers),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[Tensor | None, tuple[ScheduledSeq, ...]]:
        """Run one step; returns float32 logits for each sampling sequence (None if none samples)."""
        self.execute_block_plans(out)
        if not out.scheduled:
            return None, ()
        return self.run(out.scheduled)

    def run(self, scheduled: Sequence[S]) -> tuple[Tensor | None, tuple[S, ...]]:
        """The forward pass of one step's sequences (their block plans already executed)."""
        inp = self.prepare(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata)
        if not inp.samplers:
            return None, ()
        last = hidden[inp.sample_rows]
        n = last.shape[0]
        if self.slow_rows is not None and n in self.slow_rows:  # the LM head out of the slow band too
            last = torch.cat((last, last.new_zeros(self.slow_rows.stop - n, last.shape[1])))
        logits = self.model.compute_logits(last, widen=False)[:n]
        return logits, inp.samplers
