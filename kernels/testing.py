"""Random paged-attention problems for tests and benchmarks.

A problem keeps each sequence's logical K/V densely (the ground truth) and scatters it into a paged cache
through a shuffled block table, so an oracle can work on the dense copy while kernels read the pages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PagedProblem:
    query: Tensor  # [T, Hq, D]: the last query_lens[i] tokens of each sequence's context
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor
    block_tables: Tensor  # int32 [B, max_blocks]; padding entries point at a never-written block
    context_lens: Tensor  # int32 [B]
    query_start_loc: Tensor  # int32 [B + 1]
    keys: list[Tensor]  # per sequence [context_len, Hkv, D], the logical context
    values: list[Tensor]
    scale: float
    poison_block: int

    @property
    def query_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()


def make_problem(
    context_lens: list[int],
    query_lens: list[int] | None = None,
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shared_blocks: int = 0,
    fill: float = float("nan"),
    extra_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> PagedProblem:
    """Build a random problem.

    ``query_lens`` defaults to 1 per sequence (decode). ``shared_blocks`` full leading blocks are the same
    physical blocks in every sequence long enough to hold them (a shared prefix). Every slot that holds no
    token is set to ``fill`` (NaN catches kernels that read past a context; use a finite value for the
    torch reference, which needs finite garbage).
    """
    query_lens = query_lens or [1] * len(context_lens)
    assert len(query_lens) == len(context_lens)
    assert all(1 <= q <= c for q, c in zip(query_lens, context_lens, strict=True))
    gen = generator
    num_q_heads = num_kv_heads * group

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    shares = [shared_blocks if c >= shared_blocks * block_size else 0 for c in context_lens]
    first_sharer = next((i for i, s in enumerate(shares) if s), None)
    owned = sum(n - s for n, s in zip(blocks_per_seq, shares, strict=True)) + (
        shared_blocks if first_sharer is not None else 0
    )
    num_blocks = owned + extra_blocks + 1
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = physical.pop()

    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    max_blocks = max(blocks_per_seq) + 2  # always some padding
    block_tables = torch.full((len(context_lens), max_blocks), poison_block, dtype=torch.int32)

    shared_ids = [physical.pop() for _ in range(shared_blocks)] if first_sharer is not None else []
    shared_k = rand(shared_blocks * block_size, num_kv_heads, head_dim)
    shared_v = rand(shared_blocks * block_size, num_kv_heads, head_dim)
    keys, values = [], []
    for i, ctx in enumerate(context_lens):
        k, v = rand(ctx, num_kv_heads, head_dim), rand(ctx, num_kv_heads, head_dim)
        if shares[i]:
            k[: shared_blocks * block_size] = shared_k
            v[: shared_blocks * block_size] = shared_v
        ids = shared_ids[: shares[i]] + [physical.pop() for _ in range(blocks_per_seq[i] - shares[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for j, b in enumerate(ids):
            chunk = slice(j * block_size, min((j + 1) * block_size, ctx))
            n = chunk.stop - chunk.start
            k_cache[b, :n], v_cache[b, :n] = k[chunk], v[chunk]
        keys.append(k)
        values.append(v)

    query = rand(sum(query_lens), num_q_heads, head_dim)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    dev = torch.device(device)
    return PagedProblem(
        query=query.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        block_tables=block_tables.to(dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        query_start_loc=starts.to(dev),
        keys=[t.to(dev) for t in keys],
        values=[t.to(dev) for t in values],
        scale=1.0 / math.sqrt(head_dim),
        poison_block=poison_block,
    )


def naive_attention(problem: PagedProblem) -> Tensor:
    """Dense per-token attention over each sequence's logical context, in float64. Returns [T, Hq, D]."""
    query = problem.query.double()
    num_q_heads = query.shape[1]
    out = torch.empty_like(query)
    row = 0
    for k_seq, v_seq, q_len in zip(problem.keys, problem.values, problem.query_lens, strict=True):
        ctx = k_seq.shape[0]
        group = num_q_heads // k_seq.shape[1]
        for j in range(q_len):
            visible = ctx - q_len + j + 1
            for h in range(num_q_heads):
                k = k_seq[:visible, h // group].double()  # [n, D]
                v = v_seq[:visible, h // group].double()
                p = torch.softmax((k @ query[row, h]) * problem.scale, dim=0)
                out[row, h] = p @ v
            row += 1
    return out


def head_major(cache: Tensor) -> Tensor:
    """The values of ``cache`` (``[..., blocks, block_size, Hkv, D]``: one layer's K or V, or a whole pool) in the
    memory layout of the engine's pools (``engine.runner.kv_pool``): each block's KV heads one after another."""
    return cache.transpose(-3, -2).contiguous().transpose(-3, -2)


def as_head_major(problem: PagedProblem) -> PagedProblem:
    """``problem`` with its caches stored as the engine stores its pools."""
    return dataclasses.replace(problem, k_cache=head_major(problem.k_cache), v_cache=head_major(problem.v_cache))
