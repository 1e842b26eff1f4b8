"""Build a model + tokenizer from an HF directory (config.json + safetensors) or a GGUF file.

Where the files are, the config and the tokenizer come from ``engine.model_files`` (no torch); this module
reads the weights into tensors.

Models are built with uninitialized parameters, so no time goes into random initialization of
weights that are overwritten right after; load_weights checks that every parameter was filled.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize
from torch import Tensor

from engine.model import ModelConfig, get_model_class
from engine.model.linear import resolve_linear_backend
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel import TensorParallel
from engine.model.quant import QUANTIZATIONS, int8_kernel
from engine.model_files import GGUFFile, open_model_files
from engine.tokenizer import Tokenizer, cache_dir
from kernels import AttentionBackend, get_backend

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


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
    files = open_model_files(model)
    config = files.config
    weights = _gguf_weights_cached(files.gguf, config) if files.gguf is not None else _safetensors_weights(files.safetensors)
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
    return LoadedModel(model=net, tokenizer=files.tokenizer, config=config, path=files.path)


# ---- HF directories ------------------------------------------------------------------------------


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, st.get_tensor(name)
        except Exception as e:  # safetensors reports corrupt headers as its own error type
            if isinstance(e, OSError | RuntimeError) or type(e).__name__ == "SafetensorError":
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


# A GGUF's tensors as float32, after dequantizing and unpermuting: what ``_gguf_weights`` yields, kept in the
# cache directory so that later loads of the same file read them instead. Dequantizing (numpy, one thread)
# is most of a load's CPU time besides packing, and a server, its workers and engine processes load the
# same file again and again. Bump the version when ``_gguf_weights`` changes what it yields.
_DEQUANTIZED_FORMAT = "1"


def _dequantized_cache(path: Path) -> tuple[Path, dict[str, str]]:
    stat = path.stat()
    source = {"format": _DEQUANTIZED_FORMAT, "gguf": str(path.resolve()), "size": str(stat.st_size),
              "mtime_ns": str(stat.st_mtime_ns)}
    digest = hashlib.blake2b(repr(sorted(source.items())).encode(), digest_size=12).hexdigest()
    return cache_dir() / "dequantized" / f"{path.stem}-{digest}.safetensors", source


def _gguf_weights_cached(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """``_gguf_weights``, read from the dequantized copy when one made from this very file (path, size,
    modification time) is there and whole; else dequantized and the copy written for the next load. A copy
    that cannot be read is made anew; one that cannot be written is only logged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cached, source = _dequantized_cache(gf.path)
    tensors: list[tuple[str, Tensor]] | None = None
    try:
        with safe_open(str(cached), framework="pt") as st:
            if st.metadata() == source:  # all read before any is used: a bad file fails before the model has any
                tensors = [(name, st.get_tensor(name)) for name in st.keys()]  # noqa: SIM118
    except Exception as e:  # absent (FileNotFoundError), truncated or corrupt (SafetensorError): dequantize
        if not isinstance(e, FileNotFoundError):
            log.warning("dequantized weights at %s unreadable (%s): dequantizing %s again", cached, e, gf.path)
    if tensors is not None:
        yield from tensors
        return
    made: dict[str, Tensor] = {}
    for name, tensor in _gguf_weights(gf, config):
        made[name] = tensor
        yield name, tensor
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in made.items()}, str(tmp), metadata=source)
        os.replace(tmp, cached)  # atomic: a concurrent load reads a whole file or none
    except OSError as e:
        log.warning("cannot keep dequantized weights at %s: %s", cached, e)
