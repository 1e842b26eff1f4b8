# The @triton.jit kernels take Triton values (pointers, tl.constexpr), not Python-typed arguments: Triton reads
# their annotations to specialize them, so they stay unannotated and strict mypy is told so here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton paged-KV kernels with the same signatures as kernels.reference.

Every kernel gathers K/V token by token through the block table (physical block = table[pos // block_size],
row = pos % block_size), so a tile of BLOCK_N tokens may span several KV blocks and any block size works;
tiles are powers of two >= 16 because tl.dot needs that on a GPU. Loads past a context are masked, so
slots that were never written (NaN garbage included) and block-table padding are never read.

Softmax runs online in float32 (exp2 with log2(e) folded into the scale). On a GPU half-precision K/V go
straight into tl.dot with a float32 accumulator; under TRITON_INTERPRET=1 everything is cast to float32
first because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import REFERENCE_OPS, reference
from kernels.backend import no_layer_stack

LOG2E = 1.4426950408889634

# Launch shapes by head-dim bucket (64: D <= 64, 128: larger); benchmarks/kernels_gpu.py sweeps them. Decode's
# come from ptxas register counts for sm_90 (8 warps keep its tiles at 104-228 registers without spills).
DECODE_CONFIG: dict[int, tuple[int, int]] = {64: (64, 8), 128: (32, 8)}  # (BLOCK_N, num_warps)
# Prefill's are the fastest of the sweep's five on an H200 at 8 x 2k tokens (benchmarks/results/kernels_gpu/).
PREFILL_CONFIG: dict[int, tuple[int, int, int]] = {
    64: (128, 64, 8),
    128: (64, 32, 4),
}  # (BLOCK_M, BLOCK_N, warps)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, int(triton.next_power_of_2(n)))


def _unit_last_stride(x: Tensor) -> Tensor:
    """Kernels address the head dim as contiguous; other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------- cache write


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        # The last dim of every operand is contiguous (checked by the wrapper).
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        dst = block * stride_cb + offset * stride_co + h * stride_ch + d
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Store each token's K/V at its slot; slot -1 is skipped. In place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ------------------------------------------------------------------------------------------------ decode


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, head_off, stride_cb, stride_co,
                  KV_BLOCK: tl.constexpr, CAST_FP32: tl.constexpr):
    """K and V rows of context positions ``pos`` ([BLOCK_N]), found through the block table; masked rows are 0."""
    block = tl.load(table + pos // KV_BLOCK, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % KV_BLOCK) * stride_co + head_off
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if CAST_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,  # [B, Hq, D] unless SPLIT, else float32 [B, Hq, num_splits, D] unnormalized
    m_ptr,  # float32 [B, Hq, num_splits]: running max (log2 domain) per split
    l_ptr,  # float32 [B, Hq, num_splits]: sum of exp2 per split
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    KV_BLOCK: tl.constexpr,  # tokens per KV block; constexpr so // and % are cheap
    group,
    head_dim,
    partition_size,
    SPLIT: tl.constexpr,  # the split count is the grid's 3rd dim; a runtime value, so no recompiles
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAST_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    # All g query heads of this KV head are the rows of one tile, so K/V are read once per group.
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    q_heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if CAST_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_ch
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, head_off, stride_cb,
                             stride_co, KV_BLOCK, CAST_FP32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]
        dst = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # An empty split (start >= context_len) stores m = -inf, l = 0, acc = 0: weight 0 in the reduction.
        dst = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(dst, acc, mask=out_mask)
        stat = (seq * tl.num_programs(1) * group + q_heads) * tl.num_programs(2) + split
        tl.store(m_ptr + stat, m_i, mask=g_mask)
        tl.store(l_ptr + stat, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_ptr,  # float32 [B, Hq, num_splits, D]
    m_ptr,
    l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    m = tl.load(m_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(l_ptr + row * num_splits + s, mask=s_mask, other=0.0)
    part = tl.load(
        part_ptr + (row * num_splits + s[:, None]) * head_dim + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    # Split 0 is never empty (context_len >= 1), so the max is finite and empty splits weigh exp2(-inf) = 0.
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(part * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_splits(query: Tensor, num_kv_heads: int, max_context_len: int, block_n: int) -> int:
    """Split the context only when the batch leaves SMs idle, and never below 256 tokens a split."""
    if query.device.type != "cuda":
        return 1
    programs = query.shape[0] * num_kv_heads
    wanted = math.ceil(2 * _num_sms(query.device.index or 0) / programs)
    by_length = math.ceil(max_context_len / max(256, block_n))
    return max(1, min(wanted, by_length, 64))


def paged_attention_decode(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    num_splits: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """One query token per sequence attends to its context; split-K over the context for small batches.

    Extras beyond the reference: ``num_splits`` forces the number of context partitions (by default it is
    chosen from the batch size, context length and SM count; 1 off-GPU); ``out`` is a preallocated result.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    query = _unit_last_stride(query)
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if out is None:
        out = torch.empty(num_seqs, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_n, num_warps = DECODE_CONFIG[64 if head_dim <= 64 else 128]
    if num_splits is None:
        num_splits = _choose_splits(query, num_kv_heads, max_context_len, block_n)
    # Each split covers a whole number of tiles.
    partition = math.ceil(math.ceil(max_context_len / num_splits) / block_n) * block_n
    num_splits = max(1, math.ceil(max_context_len / partition))
    common = dict(
        SPLIT=num_splits > 1,
        BLOCK_G=_pow2(group),
        BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim),
        CAST_FP32=_interpreting() or query.dtype == torch.float32,
        num_warps=num_warps,
    )
    grid = (num_seqs, num_kv_heads, num_splits)
    args = (
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
    )
    strides = (
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    qk_scale = scale * LOG2E
    if num_splits == 1:
        _decode_kernel[grid](
            *args,
            out,
            out,
            out,
            qk_scale,
            *strides,
            out.stride(0),
            out.stride(1),
            0,
            k_cache.shape[1],
            group,
            head_dim,
            partition,
            **common,
        )
        return out
    part = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    m = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    _decode_kernel[grid](
        *args,
        part,
        m,
        l_sum,
        qk_scale,
        *strides,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        k_cache.shape[1],
        group,
        head_dim,
        partition,
        **common,
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        part,
        m,
        l_sum,
        out,
        out.stride(0),
        out.stride(1),
        head_dim,
        num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=_pow2(head_dim),
    )
    return out


# ----------------------------------------------------------------------------------------------- prefill


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    KV_BLOCK: tl.constexpr,  # tokens per KV block; constexpr so // and % are cheap
    group,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAST_FP32: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        prefix = context_len - q_len  # tokens cached before this chunk
        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        m_mask = m < q_len
        d_mask = d < head_dim
        q = tl.load(
            q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if CAST_FP32:
            q = q.to(tl.float32)
        q_pos = prefix + m  # context position of each query row

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + seq * stride_bt
        head_off = (head // group) * stride_ch
        # Keys after this tile's last query are masked for every row: stop before them.
        end = tl.minimum(context_len, prefix + (m_tile + 1) * BLOCK_M)
        for tile in range(0, end, BLOCK_N):
            pos = tile + n
            valid = pos < end
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, d, d_mask, head_off, stride_cb,
                                 stride_co, KV_BLOCK, CAST_FP32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            # Position 0 is visible to every row, so each row's max is finite after the first tile.
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / l_i[:, None]
        dst = out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


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
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Each sequence's query rows (the last q_i tokens of its context) attend causally through the table."""
    del max_context_len  # each program finds its own context length
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    query = _unit_last_stride(query)
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m, block_n, num_warps = PREFILL_CONFIG[64 if head_dim <= 64 else 128]
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.shape[1],
        num_q_heads // num_kv_heads,
        head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim),
        CAST_FP32=_interpreting() or query.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out


# ------------------------------------------------------------------------------------------- block copies


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = (plane // 2).to(tl.int64) * stride_layer + (plane % 2) * stride_kv
    for start in range(0, block_numel, BLOCK):
        i = start + tl.arange(0, BLOCK)
        mask = i < block_numel
        x = tl.load(cache_ptr + base + src * stride_block + i, mask=mask)
        tl.store(cache_ptr + base + dst * stride_block + i, x, mask=mask)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy (src, dst) blocks in every layer's K and V in one launch (copy-on-write). In place.

    Unlike the reference, the pairs run concurrently: a dst must not also be a src in the same call.
    """
    if block_mapping.numel() == 0:
        return
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_numel = block_size * num_kv_heads * head_dim
    block = kv_cache[0, 0, 0]
    # Whole blocks are copied as runs of memory: any order of a block's dims (engine.runner.kv_pool stores
    # them head-major), as long as the block is dense.
    assert block.permute(sorted(range(block.dim()), key=block.stride, reverse=True)).is_contiguous(), \
        "each block must be one dense run of memory"
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    _copy_blocks_kernel[(mapping.shape[0], num_layers * 2)](
        kv_cache,
        mapping,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_numel,
        BLOCK=min(1024, triton.next_power_of_2(block_numel)),
    )


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Device <-> host block copies are plain torch copies (bandwidth-bound on the bus, not on a kernel)."""
    reference.swap_blocks(src, dst, block_mapping)


class TritonBackend:
    """The Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1), with torch's own CUDA kernels for the
    elementwise ops (no Triton versions of them)."""

    name = "triton"
    ops = REFERENCE_OPS
    mixed_batches = False
    argmax = staticmethod(reference.argmax)
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention_decode = staticmethod(paged_attention_decode)
    paged_attention_prefill = staticmethod(paged_attention_prefill)
    copy_blocks = staticmethod(copy_blocks)
    swap_blocks = staticmethod(swap_blocks)
    layer_stack = staticmethod(no_layer_stack)
