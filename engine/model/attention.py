"""Per-step attention metadata and the paged attention layer every model layer calls."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from kernels import AttentionBackend


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Tensor  # int64 [T]; where each new token's K/V goes (-1 = do not store)
    block_tables: Tensor  # int32 [B, max_blocks]
    context_lens: Tensor  # int32 [B]; tokens in cache per sequence after this step's writes
    query_start_loc: Tensor  # int32 [B + 1]
    num_decodes: int  # sequences [0, num_decodes) are single-token decodes; they come first
    max_query_len: int
    max_context_len: int
    # Real tokens when the step's rows are padded (see engine.model.linear.gemm_rows): rows past it are
    # padding that attention neither stores nor attends from. None: every row is a real token.
    num_tokens: int | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @cached_property
    def prefill_query_start_loc(self) -> Tensor:
        # Computed once per step (not once per layer): the prefill kernel indexes its own queries from 0.
        return self.query_start_loc[self.num_decodes :] - self.num_decodes


def prefill_metadata(seq_lens: list[int], block_size: int, num_cached: list[int] | None = None,
                     device: str | torch.device = "cpu") -> tuple[AttentionMetadata, Tensor]:
    """Metadata for prefilling fresh sequences into consecutive blocks of an empty cache (tests, tools).

    Sequence i owns blocks laid out after sequence i-1's; ``num_cached[i]`` leading tokens are taken as
    already in the cache (only the rest are queries). Returns (metadata, positions of the query tokens).
    """
    cached = num_cached or [0] * len(seq_lens)
    tables: list[list[int]] = []
    slots: list[int] = []
    positions: list[int] = []
    starts = [0]
    next_block = 0
    for n, c in zip(seq_lens, cached, strict=True):
        nb = -(-n // block_size)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table)
        for p in range(c, n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
        starts.append(starts[-1] + n - c)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_decodes=0,
        max_query_len=max(n - c for n, c in zip(seq_lens, cached, strict=True)),
        max_context_len=max(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends through the block tables.

    Decode rows go to the decode kernel and the rest to the prefill kernel, since one step mixes both; a
    backend whose prefill kernel is varlen over decodes too (``mixed_batches``) takes the whole step at once.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        t = meta.num_tokens
        if t is None or t == q.shape[0]:
            return self._attend(q, k, v, kv_cache, meta)
        # Padding rows only keep the step's GEMM shapes few; whatever they hold is never read back.
        out = q.new_empty(q.shape)
        out[:t] = self._attend(q[:t], k[:t], v[:t], kv_cache, meta)
        return out

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        k_cache = kv_cache[self.layer_idx, 0]
        v_cache = kv_cache[self.layer_idx, 1]
        be = self.backend
        be.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return be.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                             meta.max_context_len)
        if nd == 0 or be.mixed_batches:
            return be.paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                              meta.context_lens, self.scale, meta.max_query_len,
                                              meta.max_context_len)
        out = torch.empty_like(q)
        out[:nd] = be.paged_attention_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                             meta.context_lens[:nd], self.scale, meta.max_context_len)
        out[nd:] = be.paged_attention_prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                                              meta.prefill_query_start_loc, meta.context_lens[nd:], self.scale,
                                              meta.max_query_len, meta.max_context_len)
        return out
