"""The torch reference kernels against a naive dense per-token loop (kernels.testing.naive_attention)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.testing import as_head_major, head_major, make_problem, naive_attention

# Unwritten slots hold a large finite value: any unmasked read of one changes the result visibly.
GARBAGE = 50.0
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed} ({request.node.name})")  # shown by pytest when the test fails
    return torch.Generator().manual_seed(seed)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all()
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


def _decode(p: kernels.testing.PagedProblem, **kw: int | None) -> torch.Tensor:
    return reference.paged_attention_decode(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, **kw
    )


def _prefill(p: kernels.testing.PagedProblem) -> torch.Tensor:
    return reference.paged_attention_prefill(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale
    )


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "context_lens"),
    [
        (8, 1, 64, [1, 8, 9, 30]),
        (16, 3, 64, [16, 1, 17, 70, 5]),
        (32, 4, 128, [33, 1, 32, 100]),
        (16, 3, 64, [1]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_matches_naive(
    gen: torch.Generator,
    block_size: int,
    group: int,
    head_dim: int,
    context_lens: list[int],
    dtype: torch.dtype,
) -> None:
    p = make_problem(
        context_lens,
        block_size=block_size,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        fill=GARBAGE,
        generator=gen,
    )
    _close(_decode(p), naive_attention(p), dtype)
    # max_context_len is only a bound for the gather: a larger one must not change anything.
    _close(_decode(p, max_context_len=max(context_lens) + 10 * block_size), naive_attention(p), dtype)


def test_decode_shared_blocks_and_garbage_padding(gen: torch.Generator) -> None:
    p = make_problem([40, 33, 64, 7], block_size=16, group=3, shared_blocks=2, fill=GARBAGE, generator=gen)
    assert (p.block_tables[0, :2] == p.block_tables[2, :2]).all()
    # Padding entries may be anything, even invalid block ids.
    p.block_tables[:, 5:] = -1
    p.block_tables[3, 1:] = 10**6
    _close(_decode(p), naive_attention(p), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_with_cached_prefix_matches_naive(gen: torch.Generator, dtype: torch.dtype) -> None:
    # Whole prompts, chunks after a cached prefix, single-token rows and a shared prefix block.
    p = make_problem(
        [20, 37, 1, 16, 50],
        [20, 5, 1, 1, 34],
        block_size=8,
        group=3,
        head_dim=64,
        dtype=dtype,
        shared_blocks=2,
        fill=GARBAGE,
        generator=gen,
    )
    _close(_prefill(p), naive_attention(p), dtype)


def test_prefill_gqa4_d128_block32(gen: torch.Generator) -> None:
    p = make_problem(
        [65, 32, 33], [65, 3, 33], block_size=32, group=4, head_dim=128, fill=GARBAGE, generator=gen
    )
    _close(_prefill(p), naive_attention(p), torch.float32)


def test_prefill_single_token_rows_equal_decode(gen: torch.Generator) -> None:
    p = make_problem([9, 40, 17], block_size=16, group=3, fill=GARBAGE, generator=gen)
    torch.testing.assert_close(_prefill(p), _decode(p))


def test_write_kv_cache_skips_negative_slots_and_writes_views(gen: torch.Generator) -> None:
    layers, blocks, bs, hkv, d = 2, 5, 4, 2, 8
    kv = torch.zeros(layers, 2, blocks, bs, hkv, d)
    key, value = torch.randn(6, hkv, d, generator=gen), torch.randn(6, hkv, d, generator=gen)
    slots = torch.tensor([0, 7, -1, 19, 5, -1])
    reference.write_kv_cache(key, value, kv[1, 0], kv[1, 1], slots)
    expect = torch.zeros_like(kv)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[1, 0, s // bs, s % bs] = key[t]
            expect[1, 1, s // bs, s % bs] = value[t]
    assert torch.equal(kv, expect)


def test_write_kv_cache_casts_to_cache_dtype(gen: torch.Generator) -> None:
    cache_k = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    key = torch.randn(3, 1, 8, generator=gen)
    reference.write_kv_cache(key, -key, cache_k, cache_v, torch.tensor([6, 1, 2]))
    assert torch.equal(cache_k[1, 2], key[0].bfloat16())
    assert torch.equal(cache_v[0, 1], (-key[1]).bfloat16())


def test_copy_blocks_every_layer_and_reads_before_writes(gen: torch.Generator) -> None:
    kv = torch.randn(3, 2, 6, 4, 2, 8, generator=gen)
    before = kv.clone()
    # Block 2 is both a destination and (later in the list) a source: the copy must read its old data.
    reference.copy_blocks(kv, torch.tensor([[1, 2], [2, 4], [0, 5]]))
    expect = before.clone()
    expect[:, :, 2], expect[:, :, 4], expect[:, :, 5] = before[:, :, 1], before[:, :, 2], before[:, :, 0]
    assert torch.equal(kv, expect)
    reference.copy_blocks(kv, torch.empty(0, 2, dtype=torch.long))
    assert torch.equal(kv, expect)


def test_swap_blocks_between_pools(gen: torch.Generator) -> None:
    device_pool = torch.randn(2, 2, 5, 4, 1, 8, generator=gen)
    cpu_pool = torch.zeros(2, 2, 3, 4, 1, 8)
    reference.swap_blocks(device_pool, cpu_pool, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(cpu_pool[:, :, 0], device_pool[:, :, 4])
    assert torch.equal(cpu_pool[:, :, 2], device_pool[:, :, 1])
    assert torch.equal(cpu_pool[:, :, 1], torch.zeros_like(cpu_pool[:, :, 1]))
    back = torch.zeros_like(device_pool)
    reference.swap_blocks(cpu_pool, back, torch.tensor([[0, 3]]))
    assert torch.equal(back[:, :, 3], device_pool[:, :, 4])


def test_head_major_pools_read_write_and_move_as_token_major(gen: torch.Generator) -> None:
    """The engine's pools are views of head-major blocks (engine.runner.kv_pool); the reference reads, writes,
    copies and swaps them through that view with the same results as on token-major pools."""
    p = make_problem([1, 40, 17], [1, 12, 17], num_kv_heads=3, group=3, fill=0.0, generator=gen)
    assert torch.equal(_prefill(as_head_major(p)), _prefill(p))
    d = make_problem([1, 16, 33], num_kv_heads=3, group=3, fill=0.0, generator=gen)
    assert torch.equal(_decode(as_head_major(d)), _decode(d))
    pool = torch.randn(2, 2, 6, 4, 3, 8, generator=gen)
    hm = head_major(pool)
    mapping = torch.tensor([[1, 2], [2, 4], [0, 5]])
    reference.copy_blocks(pool, mapping)
    reference.copy_blocks(hm, mapping)
    assert torch.equal(hm, pool)
    host = head_major(torch.zeros(2, 2, 3, 4, 3, 8))
    reference.swap_blocks(hm, host, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(host[:, :, 0], pool[:, :, 4]) and torch.equal(host[:, :, 2], pool[:, :, 1])
    key = torch.randn(3, 3, 8, generator=gen)
    reference.write_kv_cache(key, -key, hm[1, 0], hm[1, 1], torch.tensor([0, 9, 23]))
    assert torch.equal(hm[1, 0].reshape(-1, 3, 8)[[0, 9, 23]], key)
    assert torch.equal(hm[1, 1].reshape(-1, 3, 8)[[0, 9, 23]], -key)


def test_get_backend() -> None:
    # "auto" on CPU picks the C++ kernels (tests/test_kernels_cpu.py); "torch" forces this module.
    assert kernels.get_backend("torch", torch.device("cpu")).name == "torch"
    backend = kernels.get_backend("torch", "cuda")
    assert backend.paged_attention_decode is reference.paged_attention_decode
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.get_backend("flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_many_sequences_of_mixed_lengths(gen: torch.Generator, dtype: torch.dtype) -> None:
    """More sequences than one decode bucket, in no particular length order: the bucketing by context
    length must put every output row back where its sequence was."""
    lens = torch.randint(1, 200, (41,), generator=gen).tolist()
    lens[7] = 1
    lens[20] = 199
    p = make_problem(lens, block_size=16, group=3, head_dim=64, dtype=dtype, fill=GARBAGE, generator=gen)
    _close(_decode(p), naive_attention(p), dtype)


def test_reference_model_ops_against_float64(gen: torch.Generator) -> None:
    """The torch versions of ModelOps (used by the torch and Triton backends) do what they document. They
    compute in float32, so each is held to float32's tolerance around the float64 formula: a few roundings
    apart, as float64's own tolerance would not allow for some seeds."""
    x, residual, weight = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen), torch.rand(40)
    x64, r64 = x.double(), residual.double()
    reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    s = x64 + r64
    torch.testing.assert_close(residual, s.float())
    torch.testing.assert_close(x, (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()).float())

    gate_up = torch.randn(4, 2, 30, generator=gen)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(reference.silu_and_mul(gate_up), (g * torch.sigmoid(g) * u).float())

    qk = torch.randn(6, 3, 8, generator=gen)
    angles = torch.rand(6, 4, generator=gen) * 10
    rotated = qk.double().clone()
    x1, x2 = rotated[..., :4].clone(), rotated[..., 4:].clone()
    c, s_ = angles.cos().double()[:, None], angles.sin().double()[:, None]
    rotated[..., :4], rotated[..., 4:] = x1 * c - x2 * s_, x2 * c + x1 * s_
    reference.rotary_embedding(qk, angles.cos(), angles.sin())
    torch.testing.assert_close(qk, rotated.float())
