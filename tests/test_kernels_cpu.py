"""The C++ CPU decode kernel against a float64 oracle and the torch reference.

Caches are filled with NaN wherever no token was written and block tables are padded with a poison
block: the kernel walks each sequence's own context through its table, so a NaN in the output means
it read a slot it should not have. The reference needs finite garbage there, so it gets a copy.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_kernels, reference
from kernels.testing import PagedProblem, make_problem, naive_attention

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed} ({request.node.name})")
    return torch.Generator().manual_seed(seed)


def _decode(p: PagedProblem, query: torch.Tensor | None = None) -> torch.Tensor:
    return cpu_kernels.paged_attention_decode(query if query is not None else p.query, p.k_cache, p.v_cache,
                                              p.block_tables, p.context_lens, p.scale)


def _reference(p: PagedProblem) -> torch.Tensor:
    k, v = p.k_cache.nan_to_num(nan=3.0), p.v_cache.nan_to_num(nan=3.0)
    return reference.paged_attention_decode(p.query, k, v, p.block_tables, p.context_lens, p.scale)


# (block_size, group, head_dim, context_lens, dtype, shared_blocks): contexts of 1 token, one block exactly,
# one block + 1, many blocks; GQA groups 1/3/4; head sizes on the vector path (64, 128) and off it (24).
CASES = [
    (16, 3, 64, [1, 16, 17, 300], torch.float32, 0),
    (8, 1, 128, [9, 8, 1, 64], torch.float32, 1),
    (16, 3, 64, [40, 1, 130], torch.bfloat16, 2),
    (32, 4, 64, [33, 100, 2], torch.float16, 1),
    (4, 2, 24, [5, 13, 1], torch.float32, 0),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "context_lens", "dtype", "shared"), CASES)
def test_decode_matches_oracle_and_reference(gen: torch.Generator, block_size: int, group: int, head_dim: int,
                                             context_lens: list[int], dtype: torch.dtype, shared: int) -> None:
    p = make_problem(context_lens, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                     shared_blocks=shared, generator=gen)
    out = _decode(p)
    assert out.dtype == dtype and out.shape == p.query.shape
    assert not out.isnan().any(), "a slot past a context (NaN) was read"
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), naive_attention(p), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _reference(p).float(), atol=tol, rtol=tol)


def test_decode_reads_strided_query_rows(gen: torch.Generator) -> None:
    """The model hands over q as a view of the fused Q/K projection (rows further apart than Hq * D)."""
    p = make_problem([20, 7], group=3, num_kv_heads=2, generator=gen)
    wide = torch.cat([p.query, torch.randn(2, 2, 64, generator=gen)], dim=1)  # [B, Hq + Hkv, D]
    view = wide[:, : p.query.shape[1]]
    assert not view.is_contiguous()
    torch.testing.assert_close(_decode(p, view), _decode(p), atol=0, rtol=0)


def test_decode_rejects_block_ids_outside_the_cache(gen: torch.Generator) -> None:
    p = make_problem([20, 7], generator=gen)
    p.block_tables[1, 0] = p.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        _decode(p)


def test_decode_rejects_unsupported_dtype(gen: torch.Generator) -> None:
    p = make_problem([5], generator=gen)
    p.query, p.k_cache, p.v_cache = p.query.double(), p.k_cache.double(), p.v_cache.double()
    with pytest.raises(RuntimeError, match="not supported"):
        _decode(p)


def test_auto_backend_is_cpu_and_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.get_backend("auto", "cpu").name == "cpu"
    builds = []

    def broken() -> None:
        builds.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    monkeypatch.setattr(cpu_kernels, "_build_failure", [])
    assert kernels.get_backend("auto", "cpu").name == "torch"
    assert kernels.get_backend("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="no compiler"):
        kernels.get_backend("cpu", "cpu")
    assert len(builds) == 1, "a failed build must not be retried by every new engine"
