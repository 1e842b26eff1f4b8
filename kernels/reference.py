"""Plain-torch paged-KV kernels: the test oracle for the Triton kernels and the engine's CPU path.

Shapes (see kernels/__init__.py): a layer's cache is ``[num_blocks, block_size, Hkv, D]``; a slot is
``block_id * block_size + offset``. Attention goes through ``scaled_dot_product_attention``, whose CPU
kernels accumulate the softmax in float32 for half types, so the output has the query's dtype without
an explicit float32 copy of the gathered K/V. GQA is handled by folding the ``g = Hq // Hkv`` query
heads that share a KV head into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Store each token's K/V at its slot; slot -1 (e.g. padding) is skipped. In place."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    # Two-index assignment writes through any strides, so a view like kv_cache[l, 0] is updated in place.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _gather_context(cache: Tensor, block_table: Tensor) -> Tensor:
    """[..., nb] block ids -> [..., nb * block_size, Hkv, D] tokens in logical order (a copy).

    index_select over whole blocks as rows copies each block in one piece; advanced indexing
    (``cache[table]``) goes element-strided and was ~5x slower on CPU, where this gather is most of
    decode attention's cost.
    """
    if not cache.is_contiguous():  # reshape would copy the whole pool
        return cache[block_table].flatten(-4, -3)
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    rows = cache.view(num_blocks, -1).index_select(0, block_table.reshape(-1))
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *cache.shape[2:])


def paged_attention_decode(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> Tensor:
    """One query token per sequence (its last context token) attends to the sequence's whole context."""
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    # max_context_len is only an upper bound (e.g. taken over a whole mixed batch): never past the table.
    num_blocks = min(-(-max_context_len // block_size), block_tables.shape[1])
    lens = context_lens.to(device=query.device, dtype=torch.long)

    # Padding entries of a block table may hold anything: replace those past each context with block 0.
    table = block_tables[:, :num_blocks].to(device=k_cache.device, dtype=torch.long)
    needed = torch.arange(num_blocks, device=table.device) * block_size < lens[:, None]
    table = torch.where(needed, table, torch.zeros_like(table))

    keys = _gather_context(k_cache, table).to(query.dtype).transpose(1, 2)  # [B, Hkv, S, D]
    values = _gather_context(v_cache, table).to(query.dtype).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]

    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)  # the g heads of a KV head act as g queries
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def paged_attention_prefill(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
) -> Tensor:
    """Each sequence's q_i query tokens (the last q_i of its context) attend causally to its context."""
    del max_query_len, max_context_len  # sizes come from the per-sequence loop below
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    out = torch.empty_like(query)
    for i, ctx_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-ctx_len // block_size)
        table = block_tables[i, :num_blocks].to(device=k_cache.device, dtype=torch.long)
        keys = _gather_context(k_cache, table)[:ctx_len].to(query.dtype).transpose(0, 1)  # [Hkv, C, D]
        values = _gather_context(v_cache, table)[:ctx_len].to(query.dtype).transpose(0, 1)

        # Query j sits at context position ctx_len - q_len + j and sees every position up to it.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]  # [q, C]
        mask = mask.repeat(group, 1)  # rows follow q's (group, token) order below

        q = query[start:end].reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * q_len, head_dim)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        out[start:end] = (
            o.view(num_kv_heads, group, q_len, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(q_len, num_q_heads, head_dim)
        )
    return out


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy whole blocks (src -> dst) in every layer's K and V (copy-on-write). In place."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.long)
    # The right-hand side is gathered before any write, so a dst that is also a src reads the old data.
    kv_cache[:, :, mapping[:, 1]] = kv_cache[:, :, mapping[:, 0]]


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy blocks between two pools on different devices (swap out / swap in). In place on dst."""
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(device=src.device, dtype=torch.long)
    dst_ids = block_mapping[:, 1].to(device=dst.device, dtype=torch.long)
    dst[:, :, dst_ids] = src[:, :, src_ids].to(dst.device)
