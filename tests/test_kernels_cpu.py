"""The C++ CPU kernels against a float64 oracle and the torch reference, in every ISA build this CPU runs.

Caches are filled with NaN wherever no token was written and block tables are padded with a poison
block: the kernel walks each sequence's own context through its table, so a NaN in the output means
it read a slot it should not have. The reference needs finite garbage there, so it gets a copy.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_kernels, reference
from kernels.testing import PagedProblem, as_head_major, head_major, make_problem, naive_attention

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(params=cpu_kernels.testable_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test on one ISA build, chosen the way a deployment would force it."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, request.param)
    assert cpu_kernels.selected_isa() == request.param
    return str(request.param)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed={seed} ({request.node.name})")
    return torch.Generator().manual_seed(seed)


def _decode(p: PagedProblem, query: torch.Tensor | None = None) -> torch.Tensor:
    return cpu_kernels.CpuKernels().paged_attention_decode(query if query is not None else p.query, p.k_cache, p.v_cache,
                                              p.block_tables, p.context_lens, p.scale)


def _prefill(p: PagedProblem, query: torch.Tensor | None = None) -> torch.Tensor:
    return cpu_kernels.CpuKernels().paged_attention_prefill(query if query is not None else p.query, p.k_cache, p.v_cache,
                                               p.block_tables, p.query_start_loc, p.context_lens, p.scale)


def _reference(p: PagedProblem) -> torch.Tensor:
    k, v = p.k_cache.nan_to_num(nan=3.0), p.v_cache.nan_to_num(nan=3.0)
    return reference.paged_attention_prefill(p.query, k, v, p.block_tables, p.query_start_loc, p.context_lens,
                                             p.scale)


def _check(p: PagedProblem, out: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == p.query.shape
    assert not out.isnan().any(), "a slot past a context (NaN) was read"
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), naive_attention(p), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _reference(p).float(), atol=tol, rtol=tol)


# (block_size, group, head_dim, context_lens, dtype, shared_blocks): contexts of 1 token, one block exactly,
# one block + 1, many blocks; GQA groups 1/3/4; head sizes on the vector path (64, 128) and off it (24).
DECODE_CASES = [
    (16, 3, 64, [1, 16, 17, 300], torch.float32, 0),
    (8, 1, 128, [9, 8, 1, 64], torch.float32, 1),
    (16, 3, 64, [40, 1, 130], torch.bfloat16, 2),
    (16, 4, 128, [70, 5, 300], torch.bfloat16, 1),  # bf16 pair scores: four rows, scale not a power of 2
    (8, 1, 80, [20, 3], torch.bfloat16, 0),  # a head size off the pair vectors: float32 scores
    (16, 3, 96, [45, 2, 77], torch.bfloat16, 1),  # bf16 pairs for PV one 32-dim block at a time
    (32, 4, 64, [33, 100, 2], torch.float16, 1),
    (4, 2, 24, [5, 13, 1], torch.float32, 0),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "context_lens", "dtype", "shared"), DECODE_CASES)
def test_decode_matches_oracle_and_reference(isa: str, gen: torch.Generator, block_size: int, group: int,
                                             head_dim: int, context_lens: list[int], dtype: torch.dtype,
                                             shared: int) -> None:
    p = make_problem(context_lens, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                     shared_blocks=shared, generator=gen)
    _check(p, _decode(p), dtype)


# Mixed batches: a decode-like single query, a chunk over a cached prefix, a whole prompt (no prefix),
# contexts ending mid-block and on a block edge, query tiles (16 tokens) cut mid-sequence.
PREFILL_CASES = [
    (8, 1, 64, [40, 17, 8, 1], [40, 3, 1, 1], torch.float32, 0),
    (16, 3, 64, [70, 33, 20], [35, 33, 1], torch.float32, 1),
    (32, 4, 128, [50, 64, 9], [17, 64, 9], torch.float32, 1),
    (16, 3, 64, [45, 30, 2], [45, 12, 2], torch.bfloat16, 1),
    (8, 4, 128, [70, 20, 9], [37, 20, 5], torch.bfloat16, 1),  # bf16 pair scores, scale not a power of 2
    (16, 1, 64, [50, 13], [50, 13], torch.bfloat16, 0),  # tiles whose last row group is short
    (16, 3, 96, [60, 19], [41, 19], torch.bfloat16, 0),  # bf16 PV pairs one 32-dim block at a time
    (32, 4, 64, [40, 80], [23, 40], torch.float16, 0),
    (8, 3, 24, [29, 7, 16], [10, 7, 1], torch.float32, 0),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "context_lens", "query_lens", "dtype", "shared"),
                         PREFILL_CASES)
def test_prefill_matches_oracle_and_reference(isa: str, gen: torch.Generator, block_size: int, group: int,
                                              head_dim: int, context_lens: list[int], query_lens: list[int],
                                              dtype: torch.dtype, shared: int) -> None:
    p = make_problem(context_lens, query_lens, block_size=block_size, group=group, head_dim=head_dim,
                     dtype=dtype, shared_blocks=shared, generator=gen)
    _check(p, _prefill(p), dtype)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_sequences_with_their_kv_heads_handed_out_together(isa: str, gen: torch.Generator,
                                                                dtype: torch.dtype) -> None:
    """Batches with many (sequence, KV head) items: a thread takes one tile's KV heads together, so a
    decode batch and a mixed batch of many short prompts must still give every head its own answer."""
    threads = torch.get_num_threads()
    n = 8 * threads + 5  # enough tiles for the grouped hand-out at this thread count, and an odd tail
    lens = torch.randint(1, 200, (n,), generator=gen).tolist()
    p = make_problem(lens, block_size=16, num_kv_heads=3, group=3, dtype=dtype, shared_blocks=2, generator=gen)
    _check(p, _decode(p), dtype)
    queries = [max(1, length // 2) for length in lens]
    p = make_problem(lens, queries, block_size=16, num_kv_heads=3, group=3, dtype=dtype, generator=gen)
    _check(p, _prefill(p), dtype)


def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif("avx512bf16" not in cpu_kernels.testable_isas(), reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize(("block_size", "group", "head_dim", "context_lens", "query_lens", "dtype", "shared"),
                         [c for c in PREFILL_CASES if c[5] == torch.bfloat16])
def test_bf16_prefill_with_and_without_amx_tiles(monkeypatch: pytest.MonkeyPatch, gen: torch.Generator,
                                                  block_size: int, group: int, head_dim: int,
                                                  context_lens: list[int], query_lens: list[int], dtype: torch.dtype,
                                                  shared: int) -> None:
    """The AVX512-BF16 build scores bf16 prefill tiles on AMX where the CPU has it, else with vdpbf16ps: both
    paths against the oracle. Where the CPU has AMX-BF16 the tiles must be used (Linux grants the tile state
    to any process that asks), so the tile code cannot go untested there; elsewhere both calls take vdpbf16ps."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512bf16")
    ext = cpu_kernels.load_extension("avx512bf16")
    p = make_problem(context_lens, query_lens, block_size=block_size, group=group, head_dim=head_dim,
                     dtype=dtype, shared_blocks=shared, generator=gen)
    try:
        assert not ext.set_amx(False)
        without = _prefill(p)
        used = ext.set_amx(True)
        with_tiles = _prefill(p)
    finally:
        ext.set_amx(True)
    assert used == _cpu_has_amx_bf16()
    _check(p, without, dtype)
    _check(p, with_tiles, dtype)


def _assert_bf16_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out`` is ``x weight^T`` in bf16: each output within a bf16 rounding of the float64 product, and of
    oneDNN's (the same products, float32 sums in another order)."""
    from engine.model.linear import pack_weight, packed_linear

    assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    ulp = exact.abs() * 2.0**-8 + 1e-4 * x.shape[1] ** 0.5  # half a bf16 step of the result, and float32 sums' error
    assert ((out.double() - exact).abs() <= ulp).all()
    onednn = packed_linear(x.contiguous(), pack_weight(weight), None)
    assert ((out.double() - onednn.double()).abs() <= 2 * ulp).all()


@pytest.mark.skipif("avx512bf16" not in cpu_kernels.testable_isas(), reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("kernel", ["amx", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 13, 15, 16, 17, 25, 32, 33, 64, 100, 128])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (3072, 576), (64, 32), (32, 6)])
def test_bf16_decode_gemms_match_the_oracle_and_onednn(gen: torch.Generator, kernel: str, rows: int, n: int,
                                                       k: int) -> None:
    """A decode's rows on AMX tiles (amx_linear) or on vdpbf16ps (bf16_linear): row counts past whole tiles
    (16 rows for AMX, 1-12 and their mixes for vdpbf16ps) and strided inputs, against float64 and oneDNN."""
    if kernel == "amx" and (not _cpu_has_amx_bf16() or k % 32):
        pytest.skip("amx_linear needs a CPU with AMX-BF16 and K a multiple of 32")
    ext = cpu_kernels.load_extension("avx512bf16")
    assert getattr(ext, f"{kernel}_linear_supported")()
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 2 * k, generator=gen).to(torch.bfloat16)[:, ::2]  # strided rows
    out = getattr(ext, f"{kernel}_linear")(x, getattr(ext, f"{kernel}_pack_weight")(weight))
    _assert_bf16_product(out, x, weight)


@pytest.mark.skipif("avx2" not in cpu_kernels.testable_isas(), reason="needs a CPU with AVX2")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 64, 100, 128])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (3072, 576), (16, 3), (48, 1)])
def test_f32_linear_matches_the_oracle_and_onednn(gen: torch.Generator, rows: int, n: int, k: int) -> None:
    """A decode's rows on the AVX2 build's float32 GEMM: every row-tile height (1-6 rows, and their mixes), each
    output within float32 sums' error of the float64 product and of oneDNN's, strided inputs too."""
    from engine.model.linear import pack_weight, packed_linear

    ext = cpu_kernels.load_extension("avx2")
    assert ext.f32_linear_supported()
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, 2 * k, generator=gen)[:, ::2]  # strided rows
    out = ext.f32_linear(x, ext.f32_pack_weight(weight))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    exact = x.double() @ weight.double().T
    bound = 2.0**-22 * k * (x.double().abs() @ weight.double().abs().T) + 1e-30  # k roundings of float32 sums
    assert ((out.double() - exact).abs() <= bound).all()
    onednn = packed_linear(x.contiguous(), pack_weight(weight), None)
    assert ((out.double() - onednn.double()).abs() <= 2 * bound).all()


def test_f32_linear_only_in_the_avx2_build() -> None:
    """The float32 decode GEMM is the AVX2 build's: decode_weight packs float32 for it there and nowhere else
    (the AVX-512 builds keep float32 on oneDNN), never bf16 or a weight whose outputs are not whole blocks."""
    for isa in cpu_kernels.testable_isas():
        backend = cpu_kernels.CpuKernels(isa)
        assert backend.ext.f32_linear_supported() == (isa == "avx2")
        packed = backend.decode_weight(torch.zeros(32, 24))
        assert (packed is not None) == (isa == "avx2")
        assert backend.decode_weight(torch.zeros(24, 32)) is None
        if isa != "avx2":
            with pytest.raises(RuntimeError, match="only the AVX2 build"):
                backend.ext.f32_linear(torch.zeros(2, 24), backend.ext.f32_pack_weight(torch.zeros(32, 24)))
    if "avx2" in cpu_kernels.testable_isas():
        ext = cpu_kernels.load_extension("avx2")
        with pytest.raises(RuntimeError, match="multiple of 16"):
            ext.f32_pack_weight(torch.zeros(24, 32))
        with pytest.raises(RuntimeError, match="K inputs"):
            ext.f32_linear(torch.zeros(2, 16), ext.f32_pack_weight(torch.zeros(32, 24)))


@pytest.mark.skipif("avx512bf16" not in cpu_kernels.testable_isas(), reason="needs a CPU with AVX512-BF16")
def test_amx_linear_refuses_what_it_cannot_run() -> None:
    ext = cpu_kernels.load_extension("avx512bf16")
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ext.amx_pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K inputs"):
        ext.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16),
                       ext.amx_pack_weight(torch.zeros(32, 32, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match="multiple of 32 and K even"):
        ext.bf16_pack_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K inputs"):
        ext.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16),
                        ext.bf16_pack_weight(torch.zeros(32, 32, dtype=torch.bfloat16)))
    backend = cpu_kernels.CpuKernels("avx512bf16")
    assert backend.decode_weight(torch.zeros(32, 32)) is None  # float32 stays on oneDNN
    amx = _cpu_has_amx_bf16() and cpu_kernels.amx_allowed()
    packed = backend.decode_weight(torch.zeros(32, 32, dtype=torch.bfloat16))
    assert packed is not None and packed.run is (backend.ext.amx_linear if amx else backend.ext.bf16_linear)
    odd = backend.decode_weight(torch.zeros(32, 48, dtype=torch.bfloat16))  # K not a whole AMX tile
    assert odd is not None and odd.run is backend.ext.bf16_linear


@pytest.mark.parametrize(("cap", "allowed"), [(None, True), ("AVX512_CORE_AMX", True), ("avx512_core_amx_fp16", True),
                                              ("ALL", True), ("AVX512_CORE_BF16", False), ("AVX2", False)])
def test_amx_follows_the_onednn_isa_cap(monkeypatch: pytest.MonkeyPatch, cap: str | None, allowed: bool) -> None:
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu_kernels.amx_allowed() is allowed


@pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="needs a CPU with AMX-BF16")
def test_a_cap_below_amx_keeps_linears_and_prefill_off_the_tiles(monkeypatch: pytest.MonkeyPatch,
                                                                  gen: torch.Generator) -> None:
    """An AVX-512 CPU without AMX, emulated on one with it: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps oneDNN
    off the tiles, and the backend follows it (a decode's linears and prefill scores on vdpbf16ps)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    backend = cpu_kernels.CpuKernels("avx512bf16")
    try:
        packed = backend.decode_weight(torch.zeros(32, 32, dtype=torch.bfloat16))
        assert packed is not None and packed.run is backend.ext.bf16_linear  # vdpbf16ps, not the tiles
        assert not backend.ext.amx_in_use()
        p = make_problem([40, 300], [40, 8], block_size=16, group=3, dtype=torch.bfloat16, generator=gen)
        _check(p, _prefill(p), torch.bfloat16)
    finally:
        assert backend.ext.set_amx(True)
    assert backend.ext.amx_in_use()


@pytest.mark.parametrize("block_size", [1, 2, 64, 128, 256])
def test_every_block_size_the_paper_sweeps(isa: str, gen: torch.Generator, block_size: int) -> None:
    """The block sizes benchmarks/paper/block_size.py runs beyond the cases above: one token per block, and
    blocks larger than every context (one partly filled block per sequence), for decode and a mixed step."""
    p = make_problem([1, 37, 300], block_size=block_size, group=3, dtype=torch.bfloat16, shared_blocks=1,
                     generator=gen)
    _check(p, _decode(p), torch.bfloat16)
    p = make_problem([40, 17, 300], [40, 3, 1], block_size=block_size, group=3, dtype=torch.bfloat16,
                     shared_blocks=1, generator=gen)
    _check(p, _prefill(p), torch.bfloat16)

@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_every_cached_prefix_length(isa: str, gen: torch.Generator, block_size: int) -> None:
    """One sequence per prefix length 0..N-1 of the same N-token context, all in one batch."""
    n = 37
    p = make_problem([n] * n, [n - prefix for prefix in range(n)], block_size=block_size, group=3,
                     num_kv_heads=1, generator=gen)
    _check(p, _prefill(p), torch.float32)


def test_long_context_split_across_threads(isa: str, gen: torch.Generator) -> None:
    """Fewer (sequence, KV head) items than threads: each context is cut into parts run in parallel,
    then merged; the merge must weigh the parts by their own softmax maxima."""
    p = make_problem([1500, 700], [1, 20], num_kv_heads=1, group=4, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        out = _prefill(p)
    finally:
        torch.set_num_threads(threads)
    _check(p, out, torch.float32)


def test_reads_strided_query_rows(isa: str, gen: torch.Generator) -> None:
    """The model hands over q as a view of the fused Q/K projection (rows further apart than Hq * D)."""
    p = make_problem([20, 7], [5, 1], group=3, num_kv_heads=2, generator=gen)
    wide = torch.cat([p.query, torch.randn(6, 2, 64, generator=gen)], dim=1)  # [T, Hq + Hkv, D]
    view = wide[:, : p.query.shape[1]]
    assert not view.is_contiguous()
    torch.testing.assert_close(_prefill(p, view), _prefill(p), atol=0, rtol=0)


def test_rejects_block_ids_outside_the_cache(isa: str, gen: torch.Generator) -> None:
    p = make_problem([20, 7], generator=gen)
    p.block_tables[1, 0] = p.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        _decode(p)
    p.block_tables[1, 0] = -1
    with pytest.raises(RuntimeError, match="outside the cache"):
        _prefill(p)


def test_rejects_inconsistent_lengths(isa: str, gen: torch.Generator) -> None:
    p = make_problem([20, 7], [3, 2], generator=gen)
    p.context_lens[1] = 1  # two queries cannot be the last tokens of a 1-token context
    with pytest.raises(RuntimeError, match="queries but a context of"):
        _prefill(p)
    p.context_lens[1] = p.block_tables.shape[1] * p.k_cache.shape[1] + 1
    with pytest.raises(RuntimeError, match="longer than its block table"):
        _prefill(p)


def test_rejects_unsupported_dtype(isa: str, gen: torch.Generator) -> None:
    p = make_problem([5], generator=gen)
    p.query, p.k_cache, p.v_cache = p.query.double(), p.k_cache.double(), p.v_cache.double()
    with pytest.raises(RuntimeError, match="not supported"):
        _decode(p)


def test_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    supported = cpu_kernels.supported_isas()
    assert supported[-1] == "generic"
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.selected_isa() == supported[0]
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx3000")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_kernels.selected_isa()
    unsupported = [isa for isa in cpu_kernels.ISAS if isa not in supported]
    if unsupported:
        monkeypatch.setenv(cpu_kernels.ISA_ENV, unsupported[0])
        with pytest.raises(RuntimeError, match="this CPU lacks"):
            cpu_kernels.selected_isa()


def test_auto_backend_is_cpu_and_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.get_backend("auto", "cpu").name == "cpu"
    builds = []

    def broken(isa: str) -> None:
        builds.append(isa)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    monkeypatch.setattr(cpu_kernels, "_build_failure", {})
    monkeypatch.setattr(cpu_kernels, "_resolved", {})  # as in a fresh process
    assert kernels.get_backend("auto", "cpu").name == "torch"
    assert kernels.get_backend("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="no compiler"):
        kernels.get_backend("cpu", "cpu")
    assert len(builds) == 1, "a failed build must not be retried by every new engine"


# ---- KV-cache write and the elementwise ops -----------------------------------------------------------

OPS_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_major_caches_give_the_same_bits(isa: str, gen: torch.Generator, dtype: torch.dtype) -> None:
    """The engine's pools are views of head-major blocks (engine.runner.kv_pool): decode and prefill read them
    through their strides, with the same output, bit for bit, as from token-major caches."""
    p = make_problem([1, 37, 300], [1, 20, 64], block_size=16, num_kv_heads=3, group=3, dtype=dtype,
                     generator=gen)
    hm = as_head_major(p)
    assert not hm.k_cache.is_contiguous() and hm.k_cache.transpose(1, 2).is_contiguous()
    assert torch.equal(_prefill(hm), _prefill(p))
    d = make_problem([1, 16, 17, 300], block_size=16, num_kv_heads=3, group=3, dtype=dtype, generator=gen)
    d_hm = as_head_major(d)
    out = _decode(d_hm)
    assert torch.equal(out, _decode(d))
    _check(d_hm, out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(isa: str, gen: torch.Generator, dtype: torch.dtype) -> None:
    """K/V arrive as strided views of the fused QKV output; slot -1 (padding) is not stored."""
    num_blocks, block_size, heads, dim, tokens = 6, 8, 3, 64, 11
    qkv = torch.randn(tokens, 3 * heads, dim, generator=gen).to(dtype)
    key, value = qkv[:, heads: 2 * heads], qkv[:, 2 * heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    kv = torch.randn(2, 2, num_blocks, block_size, heads, dim, generator=gen).to(dtype)  # [layers, K|V, ...]
    expected = kv.clone()
    reference.write_kv_cache(key, value, expected[1, 0], expected[1, 1], slots)
    cpu_kernels.CpuKernels().write_kv_cache(key, value, kv[1, 0], kv[1, 1], slots)
    torch.testing.assert_close(kv, expected, atol=0, rtol=0)
    hm = head_major(kv)  # the engine's pools (engine.runner.kv_pool)
    cpu_kernels.CpuKernels().write_kv_cache(key * 2, value * 2, hm[0, 0], hm[0, 1], slots)
    reference.write_kv_cache(key * 2, value * 2, expected[0, 0], expected[0, 1], slots)
    torch.testing.assert_close(hm, expected, atol=0, rtol=0)
    slots[0] = num_blocks * block_size
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.CpuKernels().write_kv_cache(key, value, kv[1, 0], kv[1, 1], slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_matches_reference(isa: str, gen: torch.Generator, dtype: torch.dtype) -> None:
    rows, hidden = 37, 576 + 3  # a scalar tail after the vectors
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.rand(hidden, generator=gen).to(dtype)
    x_ref, res_ref = x.clone(), residual.clone()
    reference.fused_add_rms_norm(x_ref, res_ref, weight, 1e-5)
    cpu_kernels.CpuKernels().fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, res_ref, atol=0, rtol=0)  # one rounded add either way
    tol = OPS_TOL[dtype]
    torch.testing.assert_close(x, x_ref, atol=tol, rtol=tol)
    # and against float64 math on the stored residual
    r = res_ref.double()
    expected = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(x.double(), expected, atol=tol * 2, rtol=tol * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_reference(isa: str, gen: torch.Generator, dtype: torch.dtype) -> None:
    rows, inter = 9, 1536 + 5
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # e^-g at and past float's range
    out = cpu_kernels.CpuKernels().silu_and_mul(gate_up)
    assert out.shape == (rows, inter) and out.dtype == dtype
    tol = OPS_TOL[dtype]
    torch.testing.assert_close(out, reference.silu_and_mul(gate_up), atol=tol, rtol=tol)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), g * torch.sigmoid(g) * u, atol=tol * 2, rtol=tol * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotary_embedding_matches_reference(isa: str, gen: torch.Generator, dtype: torch.dtype,
                                            head_dim: int) -> None:
    """In place on the Q and K heads of a fused QKV output (a strided view); V must stay untouched."""
    tokens, q_heads, kv_heads = 13, 9, 3
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = qkv.clone()
    reference.rotary_embedding(expected[:, : q_heads + kv_heads], cos, sin)
    qk = qkv[:, : q_heads + kv_heads]
    assert not qk.is_contiguous()
    cpu_kernels.CpuKernels().rotary_embedding(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    # float32: the same two products and one add per element, so bit for bit; half types round once less.
    tol = 0.0 if dtype == torch.float32 else OPS_TOL[dtype]
    torch.testing.assert_close(qkv, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 1000])
def test_argmax_rows_matches_torch(isa: str, gen: torch.Generator, dtype: torch.dtype, n: int) -> None:
    """Greedy sampling's argmax: torch's answer on every row, ties (first index), NaN and infinities included."""
    x = torch.randn(12, n, generator=gen).to(dtype)
    x[1] = 1.0  # all tied
    x[2] = float("-inf")
    x[3, -1] = float("inf")
    x[4, n // 2 :] = float("nan")
    if n > 3:
        x[5, 1] = x[5, 3] = 100.0  # a tie for the maximum
    wide = torch.zeros(12, n + 5, dtype=dtype)
    wide[:, :n] = x  # rows with a stride longer than their length
    kern = cpu_kernels.CpuKernels()
    assert torch.equal(kern.argmax(x), x.argmax(dim=-1))
    assert torch.equal(kern.argmax(wide[:, :n]), x.argmax(dim=-1))


def test_cpu_backend_exposes_the_cpu_ops() -> None:
    backend = kernels.get_backend("cpu", "cpu")
    assert isinstance(backend, cpu_kernels.CpuKernels)
    assert backend.ops.silu_and_mul == backend.silu_and_mul
    assert backend.ext is cpu_kernels.load_extension(), "the extension is loaded once, by the backend"
    assert kernels.get_backend("torch", "cpu").ops is kernels.REFERENCE_OPS
    # One varlen kernel takes a mixed decode + prefill step in one call; the torch reference splits it.
    assert backend.mixed_batches and not kernels.get_backend("torch", "cpu").mixed_batches


def test_a_given_extension_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """CpuKernels(ext=...) (how benchmarks/cpu_attention.py --base runs another commit's build) loads nothing."""
    ext = cpu_kernels.load_extension()
    monkeypatch.setattr(cpu_kernels, "load_extension", lambda isa=None: pytest.fail("loaded an extension"))
    kern = cpu_kernels.CpuKernels(ext=ext)
    assert kern.ext is ext and kern.ops.silu_and_mul == kern.silu_and_mul


def test_build_all_builds_each_isa_in_its_own_process(capsys: pytest.CaptureFixture[str]) -> None:
    """What scripts/setup.sh runs (``--testable``): a ``built`` line per ISA in the order given, and a count of
    the builds that failed, here an ISA no build has."""
    isas = cpu_kernels.testable_isas()
    assert cpu_kernels.build_all(isas) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("/")[-1] for line in lines] == [f"chatsvc_cpu_kernels_{isa}.so" for isa in isas]
    assert all(line.startswith("built /") for line in lines)
    assert cpu_kernels.build_all(["no-such-isa"]) == 1
