"""Triton kernels against the torch reference.

On CPU they run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before imports), so
shapes stay small. Caches are filled with NaN wherever no token was written and outputs are poisoned with
NaN first: a kernel that reads past a context or leaves an element unwritten fails. The reference gets
the same cache with the NaNs replaced by finite garbage (it requires finite unwritten slots).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import kernels
from kernels import reference
from kernels import triton_kernels as tk
from kernels.testing import PagedProblem, head_major, make_problem

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed} ({request.node.name})")  # shown by pytest when the test fails
    return torch.Generator().manual_seed(seed)


def _finite(p: PagedProblem) -> tuple[torch.Tensor, torch.Tensor]:
    return p.k_cache.nan_to_num(nan=3.0), p.v_cache.nan_to_num(nan=3.0)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert not actual.isnan().any(), "an output element was not written (or a NaN slot was read)"
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _decode_both(p: PagedProblem, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = _poisoned(p.query)
    got = tk.paged_attention_decode(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, num_splits=num_splits, out=out
    )
    assert got is out
    k, v = _finite(p)
    return got, reference.paged_attention_decode(p.query, k, v, p.block_tables, p.context_lens, p.scale)


def _prefill_both(p: PagedProblem) -> tuple[torch.Tensor, torch.Tensor]:
    out = _poisoned(p.query)
    got = tk.paged_attention_prefill(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens, p.scale, out=out
    )
    assert got is out
    k, v = _finite(p)
    expected = reference.paged_attention_prefill(
        p.query, k, v, p.block_tables, p.query_start_loc, p.context_lens, p.scale
    )
    return got, expected


# (block_size, group, head_dim, context_lens, dtype, shared_blocks, num_splits): not the full cross product
# but every value of each axis: contexts of 1 token, exactly one block, one block + 1 and several blocks.
DECODE_CASES = [
    (8, 1, 64, [1, 8, 9, 30], torch.float32, 0, None),
    (16, 3, 64, [16, 1, 17, 70], torch.float16, 1, None),
    (32, 4, 128, [33, 32, 1], torch.float32, 1, None),
    (16, 3, 64, [1, 200, 65], torch.float16, 2, 4),  # split-K with empty partitions for short contexts
    (32, 4, 128, [100, 96], torch.float32, 2, 3),
]


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "context_lens", "dtype", "shared", "splits"), DECODE_CASES
)
def test_decode_matches_reference(
    gen: torch.Generator,
    block_size: int,
    group: int,
    head_dim: int,
    context_lens: list[int],
    dtype: torch.dtype,
    shared: int,
    splits: int | None,
) -> None:
    p = make_problem(
        context_lens,
        block_size=block_size,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        shared_blocks=shared,
        device=DEVICE,
        generator=gen,
    )
    if shared:
        sharing = [i for i, c in enumerate(context_lens) if c >= shared * block_size]
        assert (
            len(sharing) >= 2
            and (p.block_tables[sharing, :shared] == p.block_tables[sharing[0], :shared]).all()
        )
    _check(*_decode_both(p, splits))


PREFILL_CASES = [
    # Whole prompts, chunks after a cached prefix, single-token rows and blocks shared between sequences.
    (8, 3, 64, [20, 37, 1, 16, 50], [20, 5, 1, 1, 34], torch.float32, 2),
    (32, 4, 128, [65, 32, 33], [65, 3, 33], torch.float16, 1),
    (16, 1, 64, [100, 9], [80, 9], torch.float16, 0),  # more query rows than one BLOCK_M tile
]


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "context_lens", "query_lens", "dtype", "shared"), PREFILL_CASES
)
def test_prefill_matches_reference(
    gen: torch.Generator,
    block_size: int,
    group: int,
    head_dim: int,
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    shared: int,
) -> None:
    p = make_problem(
        context_lens,
        query_lens,
        block_size=block_size,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        shared_blocks=shared,
        device=DEVICE,
        generator=gen,
    )
    _check(*_prefill_both(p))


def test_write_kv_cache_matches_reference(gen: torch.Generator) -> None:
    layers, blocks, bs, hkv, d = 2, 6, 8, 3, 64
    pool = torch.full((layers, 2, blocks, bs, hkv, d), float("nan"), dtype=torch.float16, device=DEVICE)
    expected = pool.clone()
    key = torch.randn(7, hkv, d, generator=gen).to(DEVICE)  # float32 into a float16 cache
    value = torch.randn(7, hkv, d, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 8, 47, 0, -1, 20], device=DEVICE)
    tk.write_kv_cache(key, value, pool[1, 0], pool[1, 1], slots)
    reference.write_kv_cache(key, value, expected[1, 0], expected[1, 1], slots)
    torch.testing.assert_close(pool, expected, atol=0, rtol=0, equal_nan=True)
    assert (~pool.isnan()).sum() == 2 * 5 * hkv * d  # exactly the 5 real tokens, K and V


def test_write_kv_cache_from_strided_qkv(gen: torch.Generator) -> None:
    # Keys and values as slices of one fused projection output (row stride > Hkv * D).
    hkv, d = 2, 16
    qkv = torch.randn(5, 3 * hkv * d, generator=gen).to(DEVICE)
    key = qkv[:, hkv * d : 2 * hkv * d].view(5, hkv, d)
    value = qkv[:, 2 * hkv * d :].view(5, hkv, d)
    k_cache = torch.zeros(3, 4, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([11, 2, -1, 5, 4], device=DEVICE)
    tk.write_kv_cache(key, value, k_cache, v_cache, slots)
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # A head dim that is not contiguous is accepted too.
    key_t = torch.randn(5, d, hkv, generator=gen).to(DEVICE).transpose(1, 2)
    tk.write_kv_cache(key_t, value, k_cache, v_cache, slots)
    reference.write_kv_cache(key_t, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k)


def test_decode_and_prefill_with_strided_query(gen: torch.Generator) -> None:
    # Queries as a column slice of a fused QKV output: row stride larger than Hq * D.
    p = make_problem([5, 40], [2, 3], block_size=16, group=2, head_dim=16, device=DEVICE, generator=gen)
    fused = torch.randn(5, 2 * p.query[0].numel(), generator=gen).to(DEVICE)
    p.query = fused[:, : p.query[0].numel()].view_as(p.query)
    assert not p.query.is_contiguous()
    _check(*_prefill_both(p))
    # Decode: one (strided) query row per sequence; both implementations get the same rows.
    p.query = fused[:2, : p.query[0].numel()].view(2, *p.query.shape[1:])
    assert not p.query.is_contiguous()
    _check(*_decode_both(p))


def test_copy_blocks_matches_reference(gen: torch.Generator) -> None:
    kv = torch.randn(3, 2, 7, 8, 3, 64, generator=gen).to(DEVICE)
    expected = kv.clone()
    mapping = torch.tensor([[1, 4], [1, 5], [6, 0]], device=DEVICE)
    tk.copy_blocks(kv, mapping)
    reference.copy_blocks(expected, mapping)
    assert torch.equal(kv, expected)
    assert torch.equal(kv[:, :, 5], kv[:, :, 1]) and torch.equal(kv[:, :, 0], kv[:, :, 6])
    hm = head_major(kv)  # the engine's pools (engine.runner.kv_pool)
    again = torch.tensor([[2, 3]], device=DEVICE)
    tk.copy_blocks(hm, again)
    reference.copy_blocks(kv, again)
    assert torch.equal(hm, kv)
    with pytest.raises(AssertionError, match="dense"):
        tk.copy_blocks(kv[:, :, :, :, :2], again)  # two of three heads: a block with holes


def test_swap_blocks_roundtrip(gen: torch.Generator) -> None:
    device_pool = torch.randn(2, 2, 4, 8, 1, 16, generator=gen).to(DEVICE)
    cpu_pool = torch.zeros(2, 2, 3, 8, 1, 16)
    tk.swap_blocks(device_pool, cpu_pool, torch.tensor([[3, 1], [0, 2]]))
    assert torch.equal(cpu_pool[:, :, 1], device_pool[:, :, 3].cpu())
    assert torch.equal(cpu_pool[:, :, 2], device_pool[:, :, 0].cpu())


def test_get_backend_triton() -> None:
    backend = kernels.get_backend("triton", "cpu")
    assert backend.name == "triton" and backend.copy_blocks is tk.copy_blocks
    assert kernels.get_backend("auto", "cuda").name == "triton"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_realistic_sizes(gen: torch.Generator, dtype: torch.dtype) -> None:
    lens = torch.randint(1, 3000, (24,), generator=gen).tolist()
    p = make_problem(lens, block_size=16, num_kv_heads=3, group=3, dtype=dtype, device="cuda", generator=gen)
    _check(*_decode_both(p))  # split count chosen by the heuristic
    q_lens = [max(1, c // 3) for c in lens]
    p = make_problem(
        lens,
        q_lens,
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=128,
        dtype=dtype,
        device="cuda",
        generator=gen,
    )
    _check(*_prefill_both(p))


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_gpu() -> None:
    # The interpreter accepts tiles a GPU compiler rejects; compile the launched variants to cubin for real.
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("the triton wheel has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "kernels.aot_check", "--dtypes", "bf16,fp32"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "0 failed" in run.stdout
