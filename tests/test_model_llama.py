"""Our Llama/Qwen2 forward on the paged cache against transformers' own implementation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import hf_reference  # noqa: F401
from tiny_model import make_tiny_model_dir
from transformers import AutoModelForCausalLM

from engine.loader import LoadedModel, load_model
from engine.model.attention import AttentionMetadata, prefill_metadata
from engine.model.linear import Linear
from engine.model.quant import has_vnni

BLOCK = 4  # small blocks so short prompts span several blocks and the block tables matter


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model_dir(base, arch) for arch in ("llama", "qwen2")}  # type: ignore[arg-type]


def empty_cache(lm: LoadedModel, num_blocks: int = 32, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    c = lm.config
    # Large finite garbage, not zeros: attending to a slot never written would swamp the output.
    return torch.full((c.num_layers, 2, num_blocks, BLOCK, c.num_kv_heads, c.head_dim), 50.0, dtype=dtype)


def reference_logits(model_dir: Path, ids: list[int], **kwargs: object) -> torch.Tensor:
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs)
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0]


def run(lm: LoadedModel, ids: list[int], positions: torch.Tensor, kv: torch.Tensor,
        meta: AttentionMetadata) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model.compute_logits(lm.model(torch.tensor(ids), positions, kv, meta))


def prompt_ids(lm: LoadedModel, n: int) -> list[int]:
    ids = lm.tokenizer.encode("The quick brown fox asked the lazy dog: what is the capital of France?")
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_matches_transformers(tiny_dirs: dict[str, Path], arch: str) -> None:
    lm = load_model(str(tiny_dirs[arch]))
    ids = prompt_ids(lm, 11)
    meta, pos = prefill_metadata([len(ids)], BLOCK)
    ours = run(lm, ids, pos, empty_cache(lm), meta)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference_logits(tiny_dirs[arch], ids), atol=1e-4, rtol=1e-4)


def test_llama_with_attention_and_mlp_bias(tmp_path: Path) -> None:
    d = make_tiny_model_dir(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    lm = load_model(str(d))
    assert lm.config.attention_bias and lm.config.attention_out_bias and lm.config.mlp_bias
    ids = prompt_ids(lm, 7)
    meta, pos = prefill_metadata([len(ids)], BLOCK)
    torch.testing.assert_close(run(lm, ids, pos, empty_cache(lm), meta), reference_logits(d, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_then_decode_reads_paged_cache(tiny_dirs: dict[str, Path], arch: str) -> None:
    lm = load_model(str(tiny_dirs[arch]))
    ids = prompt_ids(lm, 6)
    kv = empty_cache(lm)
    # Non-consecutive physical blocks, so a kernel ignoring the block table reads the wrong place.
    table = torch.tensor([[7, 2]], dtype=torch.int32)
    slots = [int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(6)]
    prefill = AttentionMetadata(
        slot_mapping=torch.tensor(slots[:5]), block_tables=table, context_lens=torch.tensor([5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32), num_decodes=0, max_query_len=5, max_context_len=5)
    run(lm, ids[:5], torch.arange(5), kv, prefill)
    decode = AttentionMetadata(
        slot_mapping=torch.tensor(slots[5:]), block_tables=table, context_lens=torch.tensor([6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), num_decodes=1, max_query_len=1, max_context_len=6)
    ours = run(lm, ids[5:], torch.tensor([5]), kv, decode)
    torch.testing.assert_close(ours[0], reference_logits(tiny_dirs[arch], ids)[5], atol=1e-4, rtol=1e-4)


def test_mixed_decode_and_chunked_prefill_step(tiny_dirs: dict[str, Path]) -> None:
    """One step holding a decode of seq A, the 2nd chunk of seq B and a fresh prefill of seq C."""
    lm = load_model(str(tiny_dirs["llama"]))
    all_ids = lm.tokenizer.encode("Hello! How are you today? The quick brown fox jumps over the lazy dog again.")
    a, b, c = all_ids[:7], all_ids[3:13], all_ids[5:10]
    kv = empty_cache(lm)
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 6, 0]], dtype=torch.int32)

    def slot(seq: int, p: int) -> int:
        return int(tables[seq, p // BLOCK]) * BLOCK + p % BLOCK

    # Step 1: A's first 6 tokens and B's first 4 (a chunk), both prefills.
    step1 = AttentionMetadata(
        slot_mapping=torch.tensor([slot(0, p) for p in range(6)] + [slot(1, p) for p in range(4)]),
        block_tables=tables[:2], context_lens=torch.tensor([6, 4], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 6, 10], dtype=torch.int32), num_decodes=0, max_query_len=6,
        max_context_len=6)
    first = run(lm, a[:6] + b[:4], torch.cat([torch.arange(6), torch.arange(4)]), kv, step1)
    # Step 2: A decodes its 7th token, B prefills its remaining 6, C prefills all 5.
    step2 = AttentionMetadata(
        slot_mapping=torch.tensor([slot(0, 6)] + [slot(1, p) for p in range(4, 10)] + [slot(2, p) for p in range(5)]),
        block_tables=tables, context_lens=torch.tensor([7, 10, 5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 7, 12], dtype=torch.int32), num_decodes=1, max_query_len=6,
        max_context_len=10)
    second = run(lm, a[6:] + b[4:] + c, torch.cat([torch.tensor([6]), torch.arange(4, 10), torch.arange(5)]),
                 kv, step2)

    d = tiny_dirs["llama"]
    ref_a, ref_b, ref_c = (reference_logits(d, s) for s in (a, b, c))
    tol = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(first[:6], ref_a[:6], **tol)
    torch.testing.assert_close(first[6:], ref_b[:4], **tol)
    torch.testing.assert_close(second[0], ref_a[6], **tol)
    torch.testing.assert_close(second[1:7], ref_b[4:], **tol)
    torch.testing.assert_close(second[7:], ref_c, **tol)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    d = make_tiny_model_dir(tmp_path, "llama", rope_scaling=scaling, rope_theta=500000.0)
    lm = load_model(str(d))
    assert lm.config.rope_scaling is not None and lm.config.rope_scaling["rope_type"] == "llama3"
    ids = prompt_ids(lm, 20)  # well past the "original" context, so the scaled frequencies matter
    meta, pos = prefill_metadata([len(ids)], BLOCK)
    torch.testing.assert_close(run(lm, ids, pos, empty_cache(lm), meta), reference_logits(d, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tiny_dirs: dict[str, Path], dtype: torch.dtype) -> None:
    d = tiny_dirs["qwen2"]
    lm16, lm32 = load_model(str(d), dtype=dtype), load_model(str(d))
    assert all(p.dtype == dtype for p in lm16.model.parameters())
    ids = prompt_ids(lm32, 9)
    meta, pos = prefill_metadata([len(ids)], BLOCK)
    low = run(lm16, ids, pos, empty_cache(lm16, dtype=dtype), meta)
    full = run(lm32, ids, pos, empty_cache(lm32), meta)
    assert low.dtype == torch.float32
    # Rounding error only: small next to the logits' spread, not equal (that would mean no conversion).
    err = (low - full).abs().max().item()
    assert 0 < err < 0.05 * full.abs().max().item()
    # Unwidened (what the engine's runner asks for): the same values, in the model's dtype.
    with torch.inference_mode():
        hidden = lm16.model(torch.tensor(ids), pos, empty_cache(lm16, dtype=dtype), meta)
        narrow = lm16.model.compute_logits(hidden, widen=False)
        assert narrow.dtype == dtype
        assert torch.equal(narrow.float(), lm16.model.compute_logits(hidden))


def test_triton_backend_matches_torch_backend(tiny_dirs: dict[str, Path]) -> None:
    """The model runs unchanged on the Triton kernels (interpreted on CPU here, see conftest)."""
    results = []
    for backend in ("torch", "triton"):
        lm = load_model(str(tiny_dirs["qwen2"]), attention_backend=backend)
        ids = prompt_ids(lm, 9)
        kv = empty_cache(lm)
        meta, pos = prefill_metadata([8], BLOCK)
        prefill = run(lm, ids[:8], pos, kv, meta)
        decode_meta = AttentionMetadata(
            slot_mapping=torch.tensor([2 * BLOCK]), block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
            context_lens=torch.tensor([9], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            num_decodes=1, max_query_len=1, max_context_len=9)
        results.append((prefill, run(lm, ids[8:], torch.tensor([8]), kv, decode_meta)))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# ---- the real default model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_model() -> LoadedModel:
    return load_model(None)


@pytest.mark.integration
def test_real_gguf_model_matches_transformers(real_model: LoadedModel, hf_reference: Any) -> None:  # noqa: F811
    lm = real_model
    # Through the C++ layer loop where it builds (packed linears, the C++ kernels), as the engine runs it.
    assert (lm.model.stack is not None) == (lm.model.backend.name == "cpu"
                                            and all(m.packed is not None for m in lm.model.modules()
                                                    if isinstance(m, Linear)))
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors, briefly."}])
    meta, pos = prefill_metadata([len(ids)], 16)
    kv = torch.zeros(lm.config.num_layers, 2, 8, 16, lm.config.num_kv_heads, lm.config.head_dim)
    ours = run(lm, ids, pos, kv, meta)
    # transformers' own load of the same GGUF (its converted copy, kept in the cache directory)
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---- the C++ layer loop (LlamaForCausalLM.fuse_layers) ------------------------------------------------

def three_steps(lm: LoadedModel, pad: int) -> list[tuple[list[int], torch.Tensor, AttentionMetadata]]:
    """A prefill of two sequences (one a first chunk), a step mixing a decode, B's next chunk and C's whole
    prompt, and a decode of all three; the last padded with ``pad`` rows past its real tokens, as the runner
    pads a step's GEMM rows (token 0 at position 0, no slot, AttentionMetadata.num_tokens)."""
    ids = lm.tokenizer.encode("Hello! How are you today? The quick brown fox jumps over the lazy dog again.")
    tables = torch.tensor([[0, 1, 8], [2, 3, 4], [5, 6, 7]], dtype=torch.int32)

    def slots(seq: int, ps: range) -> list[int]:
        return [int(tables[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in ps]

    def meta(slot: list[int], n: int, lens: list[int], starts: list[int], decodes: int,
             num_tokens: int | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot), block_tables=tables[:n], context_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32), num_decodes=decodes,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:], strict=False)), max_context_len=max(lens),
            num_tokens=num_tokens)

    return [
        (ids[:6] + ids[3:7], torch.cat([torch.arange(6), torch.arange(4)]),
         meta(slots(0, range(6)) + slots(1, range(4)), 2, [6, 4], [0, 6, 10], 0)),
        (ids[6:7] + ids[7:13] + ids[5:10], torch.cat([torch.tensor([6]), torch.arange(4, 10), torch.arange(5)]),
         meta(slots(0, range(6, 7)) + slots(1, range(4, 10)) + slots(2, range(5)), 3, [7, 10, 5], [0, 1, 7, 12], 1)),
        (ids[7:8] + ids[13:14] + ids[10:11] + [0] * pad, torch.tensor([7, 10, 5] + [0] * pad),
         meta(slots(0, range(7, 8)) + slots(1, range(10, 11)) + slots(2, range(5, 6)), 3, [8, 11, 6], [0, 1, 2, 3], 3,
              3 if pad else None)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pad", [0, 2])
def test_the_cpp_layer_loop_gives_the_bits_of_the_modules(tiny_dirs: dict[str, Path], arch: str,
                                                          dtype: torch.dtype, pad: int) -> None:
    """Prefill, a mixed step and a (padded) decode: the same hidden states and the same KV cache, bit for
    bit, from the one C++ call as from the modules (qwen2: the Q/K/V projection has a bias)."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no native bf16 here: the linears are not packed, so there is no C++ loop")
    lm = load_model(str(tiny_dirs[arch]), dtype=dtype)
    model = lm.model
    assert model.stack is not None, "packed linears and the C++ kernels: the layers run as one call"
    stack = model.stack
    caches = {"stack": empty_cache(lm, dtype=dtype), "modules": empty_cache(lm, dtype=dtype)}
    with torch.inference_mode():
        for ids, pos, meta in three_steps(lm, pad):
            out = {}
            for name, kv in caches.items():
                model.stack = stack if name == "stack" else None
                out[name] = model(torch.tensor(ids), pos, kv, meta)
            real = len(ids) - pad
            assert torch.equal(out["stack"][:real], out["modules"][:real])
            assert torch.equal(caches["stack"], caches["modules"])


def test_the_cpp_layer_loop_refuses_a_bad_batch_before_any_layer_stores(tiny_dirs: dict[str, Path]) -> None:
    """The batch is checked once, before the first layer: a block id or slot outside the pool, more real rows
    than the step has, or a cache of another dtype is refused with nothing written to any layer's cache."""
    lm = load_model(str(tiny_dirs["llama"]))
    assert lm.model.stack is not None
    ids, pos, meta = three_steps(lm, 0)[0]
    kv = empty_cache(lm)
    bad_table = meta.block_tables.clone()
    bad_table[1, 0] = kv.shape[2]  # one past the last block
    bad_slots = meta.slot_mapping.clone()
    bad_slots[-1] = kv.shape[2] * BLOCK
    cases = [
        (dataclasses.replace(meta, block_tables=bad_table), kv, "outside the cache"),
        (dataclasses.replace(meta, slot_mapping=bad_slots), kv, "outside the cache"),
        (dataclasses.replace(meta, num_tokens=len(ids) + 1), kv, "num_tokens"),
        (meta, empty_cache(lm, dtype=torch.bfloat16), "kv_cache"),
    ]
    with torch.inference_mode():
        for bad, cache, message in cases:
            before = cache.clone()
            with pytest.raises(RuntimeError, match=message):
                lm.model(torch.tensor(ids), pos, cache, bad)
            assert torch.equal(cache, before), f"{message}: a layer stored K/V before the batch was refused"
        before = kv.clone()
        lm.model(torch.tensor(ids), pos, kv, meta)  # the same step, unbroken, runs and stores
        assert not torch.equal(kv, before)


def test_the_layers_stay_modules_where_a_piece_has_no_cpp_form(tiny_dirs: dict[str, Path]) -> None:
    for kw in ({"attention_backend": "torch"}, {"linear_backend": "torch"}):
        assert load_model(str(tiny_dirs["llama"]), **kw).model.stack is None  # type: ignore[arg-type]
    lm = load_model(str(tiny_dirs["llama"]))
    lm.model.model.layers[1].mlp.down_proj.packed = None  # one projection left on F.linear
    assert not lm.model.fuse_layers()
    lm = load_model(str(tiny_dirs["llama"]))
    assert lm.model.stack is not None
    lm.model.pack_linears()  # new packs: the loop built on the old ones is dropped, not kept stale
    assert lm.model.stack is None and lm.model.fuse_layers()
    if has_vnni():
        assert load_model(str(tiny_dirs["llama"]), quantization="int8").model.stack is None


def test_projections_take_the_decode_gemm_of_the_build_where_it_runs_here(tiny_dirs: dict[str, Path]) -> None:
    """Every bias-free projection and the LM head get a second pack in bf16 in the AVX512-BF16 build (AMX tiles
    or vdpbf16ps), and in float32 only in the AVX2 build; a projection with a bias (qwen2's Q/K/V) stays on
    oneDNN."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no native bf16 here: the linears are not packed")
    for arch in ("llama", "qwen2"):
        model = load_model(str(tiny_dirs[arch]), dtype=torch.bfloat16).model
        ext = getattr(model.backend, "ext", None)
        bf16 = ext is not None and bool(ext.amx_linear_supported() or ext.bf16_linear_supported())
        for module in model.modules():
            if isinstance(module, Linear):
                assert (module.decode is not None) == (bf16 and module.bias is None)
        assert (model.lm_head_decode is not None) == bf16
    model = load_model(str(tiny_dirs["llama"]), dtype=torch.float32).model
    ext = getattr(model.backend, "ext", None)
    f32 = ext is not None and bool(ext.f32_linear_supported())  # the AVX2 build's float32 decode GEMM
    assert (model.lm_head_decode is not None) == f32
    assert all((m.decode is not None) == f32 for m in model.modules() if isinstance(m, Linear))
