"""AttentionMetadata helpers and how PagedAttention splits a mixed step between the two kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.model.attention import AttentionMetadata, PagedAttention, prefill_metadata
from kernels import REFERENCE_OPS, AttentionBackend, LayerStack, StackedLayer, StackShape


def test_prefill_metadata_lays_out_blocks_and_slots() -> None:
    meta, pos = prefill_metadata([5, 3], block_size=4, num_cached=[4, 0])
    # Seq 0 owns blocks 0-1 and only its 5th token is new; seq 1 owns block 2.
    assert meta.block_tables.tolist() == [[0, 1], [2, 0]]
    assert meta.slot_mapping.tolist() == [4, 8, 9, 10]
    assert pos.tolist() == [4, 0, 1, 2]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.context_lens.tolist() == [5, 3]
    assert (meta.num_decodes, meta.max_query_len, meta.max_context_len) == (0, 3, 5)
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32


class RecordingBackend:
    """Records what the layer passes to each kernel; outputs mark which kernel produced a row."""

    name = "recording"
    ops = REFERENCE_OPS

    def __init__(self, mixed_batches: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.mixed_batches = mixed_batches

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not called by the layer")

    def as_backend(self) -> AttentionBackend:
        return self  # type-checked against the protocol here

    def copy_blocks(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        raise AssertionError("not called by the layer")

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        raise AssertionError("not called by the layer")

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        self.calls.append(("write", {"tokens": key.shape[0], "slots": slot_mapping.tolist()}))

    def paged_attention_decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, max_context_len: int | None = None) -> torch.Tensor:
        self.calls.append(("decode", {"rows": query.shape[0], "tables": block_tables.tolist(),
                                      "lens": context_lens.tolist()}))
        return torch.full_like(query, 1.0)

    def paged_attention_prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                max_query_len: int | None = None, max_context_len: int | None = None) -> torch.Tensor:
        self.calls.append(("prefill", {"rows": query.shape[0], "tables": block_tables.tolist(),
                                       "starts": query_start_loc.tolist(), "lens": context_lens.tolist()}))
        return torch.full_like(query, 2.0)

    def layer_stack(self, layers: Sequence[StackedLayer], final_norm: torch.Tensor,
                    shape: StackShape) -> LayerStack | None:
        raise AssertionError("not called by the layer")


def mixed_step_metadata() -> AttentionMetadata:
    """Two decodes (contexts 9 and 4) then two prefill chunks of 3 and 2 tokens."""
    return AttentionMetadata(
        slot_mapping=torch.arange(7), block_tables=torch.tensor([[0], [1], [2], [3]], dtype=torch.int32),
        context_lens=torch.tensor([9, 4, 3, 2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 5, 7], dtype=torch.int32), num_decodes=2, max_query_len=3,
        max_context_len=9)


def test_mixed_step_splits_decodes_and_prefills() -> None:
    rec = RecordingBackend()
    layer = PagedAttention(layer_idx=1, num_heads=4, num_kv_heads=2, head_dim=8, backend=rec.as_backend())
    meta = mixed_step_metadata()
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    out = layer(torch.zeros(7, 4, 8), torch.zeros(7, 2, 8), torch.zeros(7, 2, 8), kv, meta)
    assert [name for name, _ in rec.calls] == ["write", "decode", "prefill"]
    assert rec.calls[0][1] == {"tokens": 7, "slots": list(range(7))}
    assert rec.calls[1][1] == {"rows": 2, "tables": [[0], [1]], "lens": [9, 4]}
    # The prefill kernel sees its own sequences only, with query offsets starting from 0.
    assert rec.calls[2][1] == {"rows": 5, "tables": [[2], [3]], "starts": [0, 3, 5], "lens": [3, 2]}
    assert out[:2].eq(1.0).all() and out[2:].eq(2.0).all()


def test_mixed_step_is_one_call_when_the_prefill_kernel_takes_decodes() -> None:
    rec = RecordingBackend(mixed_batches=True)
    layer = PagedAttention(layer_idx=1, num_heads=4, num_kv_heads=2, head_dim=8, backend=rec.as_backend())
    meta = mixed_step_metadata()
    out = layer(torch.zeros(7, 4, 8), torch.zeros(7, 2, 8), torch.zeros(7, 2, 8), torch.zeros(2, 2, 4, 4, 2, 8), meta)
    assert [name for name, _ in rec.calls] == ["write", "prefill"]
    assert rec.calls[1][1] == {"rows": 7, "tables": [[0], [1], [2], [3]], "starts": [0, 1, 2, 5, 7],
                               "lens": [9, 4, 3, 2]}
    assert out.eq(2.0).all()


def test_pure_steps_call_one_kernel() -> None:
    rec = RecordingBackend()
    layer = PagedAttention(0, 2, 1, 4, rec.as_backend())
    kv = torch.zeros(1, 2, 2, 4, 1, 4)
    decode = AttentionMetadata(torch.tensor([0, 4]), torch.tensor([[0], [1]], dtype=torch.int32),
                               torch.tensor([1, 1], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                               num_decodes=2, max_query_len=1, max_context_len=1)
    layer(torch.zeros(2, 2, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), kv, decode)
    meta, _ = prefill_metadata([3], 4)
    layer(torch.zeros(3, 2, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), kv, meta)
    assert [name for name, _ in rec.calls] == ["write", "decode", "write", "prefill"]
