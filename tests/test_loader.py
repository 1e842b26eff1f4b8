"""load_model: HF directories, GGUF files, and clear errors for everything unusable."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import make_tiny_model_dir

from engine.loader import load_model, unpermute_rotary
from engine.model import ModelConfig
from engine.model_files import GGUFFile, default_model_path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama")


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # What llama.cpp's converter does to Q/K rows: each head's halves are interleaved row by row.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_rotary_inverts_llama_cpp_permutation(n_head: int) -> None:
    w = torch.randn(n_head * 64, 576)
    permuted = llama_cpp_permute(w, n_head)
    assert not torch.equal(permuted, w)
    assert torch.equal(permuted[1], w[32])  # row 1 of head 0 came from the second half's first row
    assert torch.equal(unpermute_rotary(permuted, n_head), w)


def test_hf_dir_config_and_weights(tiny_llama: Path) -> None:
    lm = load_model(str(tiny_llama))
    cfg = json.loads((tiny_llama / "config.json").read_text())
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["hidden_size"] // cfg["num_attention_heads"], cfg["vocab_size"])
    assert c.architecture == "llama" and not c.attention_bias and c.name == tiny_llama.name
    assert lm.path == tiny_llama
    assert c.eos_token_ids == lm.tokenizer.eos_token_ids == frozenset({cfg["eos_token_id"]})
    # The fused QKV weight is the three HF projections stacked.
    sd = load_file(str(tiny_llama / "model.safetensors"))
    qkv = lm.model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    assert not any(p.requires_grad for p in lm.model.parameters())


def test_qwen2_dir_has_biases_and_untied_head(tmp_path: Path) -> None:
    lm = load_model(str(make_tiny_model_dir(tmp_path, "qwen2")))
    c = lm.config
    assert c.architecture == "qwen2" and c.attention_bias and not c.attention_out_bias and not c.tie_word_embeddings
    attn = lm.model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert lm.model.lm_head is not None


def test_dtype_is_applied_at_load(tiny_llama: Path) -> None:
    lm = load_model(str(tiny_llama), dtype=torch.bfloat16)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny_llama), dtype=torch.int8)


def test_missing_path_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model not found"):
        load_model(str(tmp_path / "nope"))


def test_dir_without_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_hf_architecture_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_dir(tiny_llama, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        load_model(str(d))


def test_missing_and_corrupt_weights(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_dir(tiny_llama, tmp_path / "missing")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(str(d))

    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="cannot read weights"):
        load_model(str(d))

    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(d))


def test_wrong_weight_shape_is_a_value_error(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_dir(tiny_llama, tmp_path / "shape")
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_model(str(d))


def test_corrupt_or_foreign_files(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="corrupt or not GGUF"):
        load_model(str(bad))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="unsupported model file"):
        load_model(str(other))


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(str(path))


def reader_scalars(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items()
            if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not k.startswith("GGUF.")}


def test_gguf_header_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_float32("llama.rope.freq_base", 12345.5)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "<|im_end|>", ""])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, -2.0, 0.0])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((6, 64), dtype=np.float32)
    q8 = rng.standard_normal((4, 64), dtype=np.float32)
    w.add_tensor("a.weight", f32)
    w.add_tensor("b.weight", f32[:3].astype(np.float16))
    w.add_tensor("c.weight", gguf.quants.quantize(q8, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    scalars = reader_scalars(ref)
    assert scalars["llama.rope.freq_base"] == 12345.5 and scalars["general.name"] == "tiny ünïcode"
    assert {k: v for k, v in ours.metadata.items() if v is not None} == scalars
    assert ours.metadata["tokenizer.ggml.tokens"] is None  # arrays are skipped, not parsed
    assert [(t.name, t.dims, t.qtype) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        np.testing.assert_array_equal(gguf.quants.dequantize(ours.tensor_bytes(mine), mine.qtype),
                                      gguf.quants.dequantize(theirs.data, theirs.tensor_type))
    np.testing.assert_allclose(gguf.quants.dequantize(ours.tensor_bytes(ours.tensors[2]), ours.tensors[2].qtype),
                               q8, atol=0.05)


@pytest.mark.integration
def test_gguf_header_reader_on_default_model() -> None:
    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert {k: v for k, v in ours.metadata.items() if v is not None} == reader_scalars(ref)
    assert [(t.name, t.dims, t.qtype, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset)) for t in ref.tensors]


@pytest.mark.integration
def test_truncated_default_gguf_is_a_value_error(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or not GGUF"):
        load_model(str(cut))


@pytest.mark.integration
def test_default_model_config() -> None:
    lm = load_model(None)
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.architecture == "llama" and c.name == "SmolLM2-135M-Instruct"
    assert lm.path == default_model_path()
    assert lm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>") in c.eos_token_ids


def test_config_parsing_accepts_transformers_4_and_5_rope_keys() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8, "eos_token_id": [3, 4]}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {**scaling, "rope_type": "llama3"}})
    v4_old_key = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {**scaling, "type": "llama3"}})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 5e5}})
    assert v4 == v4_old_key == v5
    assert v5.rope_theta == 5e5 and v5.rope_scaling is not None and v5.rope_scaling["rope_type"] == "llama3"
    assert v5.num_kv_heads == 4 and v5.head_dim == 16 and v5.eos_token_ids == frozenset({3, 4})
    default = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None and default.rope_theta == 1e4
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="supported: llama, qwen2"):
        ModelConfig.from_hf_dict({**base, "architectures": ["PhiForCausalLM"], "model_type": "phi"})


@pytest.mark.integration
def test_a_gguf_is_dequantized_once_and_a_bad_copy_made_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The second load of a GGUF reads the dequantized copy in the cache directory (no tensor is dequantized)
    and gets the same weights; a truncated copy is noticed before any weight is used and made again."""
    from engine import loader

    monkeypatch.setenv("CHATSVC_CACHE_DIR", str(tmp_path))
    dequantized: list[object] = []
    real = loader.dequantize

    def counted(data: object, qtype: object) -> object:
        dequantized.append(qtype)
        return real(data, qtype)

    monkeypatch.setattr(loader, "dequantize", counted)
    first = load_model(None, linear_backend="torch")
    made = len(dequantized)
    (copy,) = (tmp_path / "dequantized").glob("*.safetensors")
    second = load_model(None, linear_backend="torch")
    assert made > 200 and len(dequantized) == made
    want, got = first.model.state_dict(), second.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    copy.write_bytes(copy.read_bytes()[: copy.stat().st_size // 2])
    third = load_model(None, linear_backend="torch")
    assert len(dequantized) == 2 * made and "unreadable" in caplog.text
    assert all(torch.equal(third.model.state_dict()[k], want[k]) for k in want)
    assert copy.stat().st_size > 2 * 10**8  # written whole again
