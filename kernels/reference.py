"""Plain-torch paged-KV kernels: the test oracle for the Triton kernels and the engine's CPU path.

Shapes (see kernels/__init__.py): a layer's cache is ``[num_blocks, block_size, Hkv, D]``; a slot is
``block_id * block_size + offset``. Written for speed on CPU, where decode attention is memory-bound
and small strided ops cost more than arithmetic:

- the context is gathered with ``index_select`` over whole blocks (one contiguous copy per block);
- decode runs in buckets of sequences with similar context lengths, so padding stays small;
- decode scores every query head against every (token, KV head) column of the gathered K in one
  ``bmm`` and masks the columns of other KV heads: three times the (cheap) FLOPs of exact GQA, but
  no transposed copy of K/V and no per-head small matmuls, which make ``scaled_dot_product_attention``
  slower here;
- prefill runs ``scaled_dot_product_attention`` with ``enable_gqa`` on 4-D inputs, which takes the
  fused flash kernel (float32 softmax accumulation for half types) instead of the math fallback.
"""

from __future__ import annotations

import functools

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
    (``cache[table]``) goes element-strided, several times slower on CPU, where this gather is most of
    decode attention's cost.
    """
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    flat = block_table.reshape(-1)
    if cache.is_contiguous():
        rows = cache.view(num_blocks, -1).index_select(0, flat)
        return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, *cache.shape[2:])
    head_major = cache.transpose(1, 2)  # the engine's pools (engine.runner.kv_pool): [blocks, Hkv, block_size, D]
    if head_major.is_contiguous():
        rows = head_major.reshape(num_blocks, -1).index_select(0, flat).view(-1, *head_major.shape[1:])
        return rows.transpose(1, 2).contiguous().view(*block_table.shape[:-1], block_table.shape[-1] * block_size,
                                                      *cache.shape[2:])
    return cache[block_table].flatten(-4, -3)  # any other strides: reshape would copy the whole pool


@functools.lru_cache(maxsize=16)  # one per decode bucket of a step
def _decode_bias(lens: tuple[int, ...], tokens: int, num_kv_heads: int, group: int, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
    """Additive mask [B, Hq, tokens * Hkv] for decode scores laid out (token, KV head): 0 where query head
    h may look (KV head h // group, token < its context length), -inf elsewhere.

    Every layer of a step asks for the same one, hence the cache; it is a pure function of its key and
    never written to by the callers.
    """
    batch = len(lens)
    len_ok = torch.arange(tokens, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    head_ok = torch.eye(num_kv_heads, dtype=torch.bool, device=device)  # [query's KV head, column's KV head]
    ok = len_ok[:, None, None, :, None] & head_ok[None, :, None, None, :]  # [B, Hkv, 1, S, Hkv]
    bias = torch.zeros(batch, num_kv_heads, group, tokens, num_kv_heads, dtype=dtype, device=device)
    return bias.masked_fill_(~ok, float("-inf")).view(batch, num_kv_heads * group, tokens * num_kv_heads)


# Decode sequences are attended in buckets of this many, shortest contexts together, so each bucket is
# padded only to its own longest context (a batch mixing 50- and 600-token contexts would otherwise
# gather and score 600 tokens for every sequence).
DECODE_BUCKET = 16


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
    del max_context_len  # each bucket's own longest context is the tighter bound
    lens = context_lens.tolist()
    if len(lens) <= DECODE_BUCKET:
        return _decode_bucket(query, k_cache, v_cache, block_tables, lens, scale)
    order = sorted(range(len(lens)), key=lens.__getitem__)
    out = torch.empty_like(query)
    for i in range(0, len(order), DECODE_BUCKET):
        rows = order[i : i + DECODE_BUCKET]
        idx = torch.tensor(rows, device=query.device)
        out[idx] = _decode_bucket(query[idx], k_cache, v_cache, block_tables[idx.to(block_tables.device)],
                                  [lens[r] for r in rows], scale)
    return out


def _decode_bucket(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, lens: list[int],
                   scale: float) -> Tensor:
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # Never past the table, whatever the lengths claim.
    num_blocks = min(-(-max(lens) // block_size), block_tables.shape[1])
    tokens = num_blocks * block_size

    # Padding entries of a block table may hold anything: replace those past each context with block 0.
    table = block_tables[:, :num_blocks].to(device=k_cache.device, dtype=torch.long)
    lens_t = torch.tensor(lens, device=table.device)
    needed = torch.arange(num_blocks, device=table.device) * block_size < lens_t[:, None]
    table = torch.where(needed, table, torch.zeros_like(table))

    # [B, S * Hkv, D]: row s * Hkv + j is token s of KV head j. Unwritten slots hold finite values
    # (the cache is zero-initialized) and their -inf bias gives them weight exactly 0.
    keys = _gather_context(k_cache, table).to(query.dtype).view(num_seqs, tokens * num_kv_heads, head_dim)
    values = _gather_context(v_cache, table).to(query.dtype).view(num_seqs, tokens * num_kv_heads, head_dim)
    bias = _decode_bias(tuple(lens), tokens, num_kv_heads, group, query.dtype, query.device)
    scores = torch.baddbmm(bias, query * scale, keys.transpose(1, 2))  # [B, Hq, S * Hkv]
    # The CPU softmax accumulates in float32 for half types.
    return torch.bmm(torch.softmax(scores, dim=-1), values)


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
    block_size = k_cache.shape[1]
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
        keys = _gather_context(k_cache, table)[:ctx_len].to(query.dtype).transpose(0, 1)[None]  # [1, Hkv, C, D]
        values = _gather_context(v_cache, table)[:ctx_len].to(query.dtype).transpose(0, 1)[None]
        q = query[start:end].transpose(0, 1)[None]  # [1, Hq, q, D]
        if q_len == ctx_len:  # nothing cached before these queries: the plain causal mask
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at context position ctx_len - q_len + j and sees every position up to it.
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]  # [q, C]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


# ---- elementwise ops around attention (see kernels.ModelOps) -------------------------------------


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight`` (x, residual [..., N])."""
    residual.add_(x)
    x.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``[..., 2I] -> [..., I]``: silu of the first half times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(qk: Tensor, cos: Tensor, sin: Tensor) -> None:
    """In place on ``qk [T, H, D]`` (may be a strided view), "rotate_half" layout: with x1, x2 the two
    halves of each head, x1 <- x1 cos - x2 sin and x2 <- x2 cos + x1 sin; cos, sin ``[T, D/2]`` (or
    ``[T, 1, D/2]``) for each token's position."""
    half = qk.shape[-1] // 2
    cos, sin = cos.reshape(qk.shape[0], 1, half), sin.reshape(qk.shape[0], 1, half)
    x1, x2 = qk[..., :half], qk[..., half:]
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # both from the inputs, before any write
    x1.copy_(out1)
    x2.copy_(out2)


def argmax(logits: Tensor) -> Tensor:
    """Each row's greedy token: the first index of its maximum (the first NaN if it has one)."""
    return logits.argmax(dim=-1)


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
