"""Llama-family decoder (SmolLM2, Llama 2/3, Qwen2) over a paged KV cache.

Tokens of all sequences in a step are flattened into one [T] batch with no padding; the only
per-sequence structure lives in the attention metadata. Q/K/V are one matmul and gate/up another,
because on CPU a few large matmuls beat many small ones.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import ModelConfig
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.linear import Linear, pack_weight, packed_linear
from engine.model.parallel import TensorParallel, row_linear
from engine.model.quant import Int8Weight, make_int8_weight
from kernels import AttentionBackend, DecodeWeight, LayerStack, ModelOps, StackedLayer, StackShape


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: Tensor) -> Tensor:
        # torch's fused kernel normalizes half types in float32 internally, as the HF reference does.
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Rotation frequency per dimension pair, with linear or llama3-style context extension."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        orig_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond orig_ctx / low) are slowed by `factor`, short ones (below
        # orig_ctx / high) kept, and the band between blends the two linearly in orig_ctx / wavelen.
        slowed = torch.where(wavelen > orig_ctx / low, inv_freq / factor, inv_freq)
        blend = (orig_ctx / wavelen - low) / (high - low)
        blended = (1 - blend) * slowed / factor + blend * slowed
        in_band = (wavelen >= orig_ctx / high) & (wavelen <= orig_ctx / low)
        return torch.where(in_band, blended, slowed)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """The per-position angles that rotate the two halves of each head (the HF "rotate_half" layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Angles in float32, then rounded to the model dtype once, like the reference implementation.
        # Plain attributes, not buffers: derived from the config, never part of a checkpoint.
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, D/2] for the step's positions: gathered once per step, used by every layer (the
        backend's ``rotary_embedding`` applies them)."""
        return self.cos[positions], self.sin[positions]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, device: torch.device | str,
                 dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, device, dtype)
        self.o_proj = row_linear(cfg.q_size, cfg.hidden_size, cfg.attention_out_bias, device, dtype, tp)
        self.attn = PagedAttention(layer_idx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend)
        self.ops = backend.ops

    def forward(self, x: Tensor, kv_cache: Tensor, meta: AttentionMetadata, cos: Tensor, sin: Tensor) -> Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Q and K are rotated together, in place in the projection's output: one pass, no copies.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        self.ops.rotary_embedding(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        projected: Tensor = self.o_proj(out.reshape(t, self.q_size))
        return projected


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelOps, device: torch.device | str, dtype: torch.dtype,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, device, dtype)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, device, dtype, tp)
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, device: torch.device | str,
                 dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, backend, device, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(cfg, backend.ops, device, dtype, tp)
        self.ops = backend.ops

    def forward(self, h: Tensor, residual: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor]:
        """``h``: the previous layer's output before its residual add; ``residual``: the running sum (None
        at the first layer). Each residual add is fused with the norm after it, in place (vLLM's layout)."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            self.ops.fused_add_rms_norm(h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn(h, kv_cache, meta, cos, sin)
        self.ops.fused_add_rms_norm(h, residual, self.post_attention_layernorm.weight,
                                    self.post_attention_layernorm.eps)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str,
                 dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, backend, device, dtype, tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)


def _bias(linear: Linear) -> Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _packed(linear: Linear) -> Tensor:
    assert linear.packed is not None, "fuse_layers checks every projection is packed first"
    return linear.packed


def _decode(linear: Linear) -> Tensor | None:
    return None if linear.decode is None else linear.decode.packed


# HF checkpoint names that land in one of our fused weights: suffix -> (fused suffix, shard index).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None) -> None:
        """Parameters are allocated uninitialized: call load_weights before use. ``tp``: build this rank's
        shard of a tensor-parallel model (see engine.model.parallel); ``layer_config`` is then its share."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.layer_config = config if tp is None else tp.local_config(config)
        self.dtype = dtype
        self.model = LlamaModel(self.layer_config, backend, device, dtype, tp)
        self.ops = backend.ops
        vocab = config.vocab_size if tp is None else tp.vocab_shard_size(config.vocab_size)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab, False, device, dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, device, dtype)
        self.lm_head_packed: Tensor | None = None
        self.lm_head_decode: DecodeWeight | None = None
        self.lm_head_int8: Int8Weight | None = None
        self.backend = backend
        # The layer loop in one kernel call (fuse_layers), or None: the modules below, layer by layer.
        self.stack: LayerStack | None = None

    def pack_linears(self) -> None:
        """Pack every projection and the LM head (the tied embedding gets a packed copy) for oneDNN.

        Call after load_weights, once the weights are final.
        """
        self.stack = None  # built on the packs it replaces: fuse_layers again after
        # The backend's decode GEMM for a decode's rows, where it has one that runs here (bf16 in the AVX512-BF16
        # build, float32 in the AVX2 build).
        decode_weight = typing.cast("typing.Callable[[Tensor], DecodeWeight | None] | None",
                                    getattr(self.backend, "decode_weight", None))
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
                module.decode = decode_weight(module.weight) if decode_weight and module.bias is None else None
        self.lm_head_packed = pack_weight(self._lm_head_weight())
        self.lm_head_decode = decode_weight(self._lm_head_weight()) if decode_weight else None

    def fuse_layers(self) -> bool:
        """Run the decoder layers as one call into the kernels from now on (the backend's ``layer_stack``:
        the same ops in the same order, so the same output, without the Python between them), where every
        piece has that form: a backend with such a kernel (the C++ one), every projection packed for
        oneDNN, no int8, no tensor parallelism. Call after pack_linears. Returns whether it did;
        ``stack = None`` goes back."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if self.tp is not None or any(m.packed is None or m.int8 is not None for m in linears):
            return False
        layers = []
        for layer in typing.cast(list[LlamaDecoderLayer], list(self.model.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(StackedLayer(
                input_norm=layer.input_layernorm.weight.detach(), qkv=_packed(attn.qkv_proj), o=_packed(attn.o_proj),
                post_norm=layer.post_attention_layernorm.weight.detach(), gate_up=_packed(mlp.gate_up_proj),
                down=_packed(mlp.down_proj), qkv_bias=_bias(attn.qkv_proj), o_bias=_bias(attn.o_proj),
                gate_up_bias=_bias(mlp.gate_up_proj), down_bias=_bias(mlp.down_proj), qkv_decode=_decode(attn.qkv_proj),
                o_decode=_decode(attn.o_proj), gate_up_decode=_decode(mlp.gate_up_proj), down_decode=_decode(mlp.down_proj)))
        c = self.layer_config
        shape = StackShape(eps=self.model.norm.eps, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, scale=c.head_dim**-0.5)
        self.stack = self.backend.layer_stack(layers, self.model.norm.weight.detach(), shape)
        return self.stack is not None

    def run_linears(self, rows: int) -> None:
        """Every projection and the LM head once on ``rows`` zero rows (timing probes; no other work)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul(torch.zeros(rows, module.weight.shape[1], dtype=self.dtype), None)
        if self.lm_head_packed is not None and self.tp is None:
            self.compute_logits(torch.zeros(rows, self.config.hidden_size, dtype=self.dtype), widen=False)

    def quantize_linears(self, kernel: str, head: bool = False) -> None:
        """Run every projection in int8 with ``kernel`` (see engine.model.quant); the LM head too with
        ``head``. Call after load_weights (and after pack_linears, whose projection packs this drops).

        The head stays in the model's dtype by default: int8 there moves the next-token distributions
        further from float32's (benchmarks/quantization_accuracy.py measures int8 with and without it).
        """
        self.stack = None  # its packed projections are dropped: int8 runs module by module
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize(kernel)
        if head:
            self.lm_head_int8 = make_int8_weight(self._lm_head_weight(), kernel)
            self.lm_head_packed = self.lm_head_decode = None

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                attn_metadata: AttentionMetadata) -> Tensor:
        """Flattened tokens (decodes first, then prefill chunks) -> final-normed hidden states [T, hidden]."""
        h: Tensor = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)
        if self.stack is not None:
            meta = attn_metadata
            starts = None if meta.num_decodes == meta.num_seqs else meta.query_start_loc
            num_tokens = h.shape[0] if meta.num_tokens is None else meta.num_tokens
            out: Tensor = self.stack.forward(h, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, starts,
                                             meta.context_lens, num_tokens)
            return out
        residual: Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, kv_cache, attn_metadata, cos, sin)
        assert residual is not None, "a model has at least one layer"
        norm = self.model.norm
        self.ops.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        return h

    def _lm_head_weight(self) -> Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        tied = self.model.embed_tokens.weight  # whole on every rank: the LM head is its vocabulary slice
        return tied if self.tp is None else self.tp.vocab_shard(tied)

    def compute_logits(self, hidden: Tensor, widen: bool = True) -> Tensor:
        """Logits of the whole vocabulary (under tensor parallelism: on rank 0; the other ranks get their own
        slice), float32 unless ``widen`` is False: then in the model's dtype, for the engine's sampler, which
        picks greedy tokens from half-precision logits as they are and widens them only where it computes
        (a [64, 49152] float32 copy every decode step saved)."""
        if self.lm_head_int8 is not None:
            logits = self.lm_head_int8(hidden, None)
        elif self.lm_head_decode is not None and hidden.shape[0] <= self.lm_head_decode.max_rows:
            logits = self.lm_head_decode(hidden)
        elif self.lm_head_packed is not None:
            logits = packed_linear(hidden, self.lm_head_packed, None)
        else:
            logits = F.linear(hidden, self._lm_head_weight())
        if widen or self.tp is not None:  # the ranks gather float32 slices
            logits = logits.float()
        return logits if self.tp is None else self.tp.gather_logits(logits, self.config.vocab_size)

    # ---- weights -------------------------------------------------------------------------------

    def shard_slices(self, fused: str) -> list[slice]:
        c = self.layer_config
        if fused.endswith("qkv_proj"):
            q, kv = c.q_size, c.kv_size
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)]
        i = c.intermediate_size
        return [slice(0, i), slice(i, 2 * i)]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors (q/k/v and gate/up separate) into our fused parameters.

        Raises ValueError for an unknown name, a shape mismatch or any parameter left unfilled.
        """
        params = dict(self.named_parameters())
        shards = {"qkv_proj": 3, "gate_up_proj": 2}  # checkpoint tensors per fused parameter; others take one
        missing = {name: set(range(shards.get(name.split(".")[-2], 1))) for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            if self.tp is not None:
                tensor = self.tp.shard_weight(hf_name, tensor)
            stem, _, leaf = hf_name.rpartition(".")
            target, shard, rows = hf_name, 0, None
            for suffix, (fused, idx) in _FUSED.items():
                if stem.endswith(suffix):
                    target = f"{stem[: -len(suffix)]}{fused}.{leaf}"
                    shard, rows = idx, self.shard_slices(fused)[idx]
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture} model")
            dest = params[target].data
            if rows is not None:
                dest = dest[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            missing[target].discard(shard)
        unfilled = sorted(n for n, s in missing.items() if s)
        if unfilled:
            raise ValueError(f"checkpoint is missing weights: {', '.join(unfilled[:8])}"
                             + (f" (+{len(unfilled) - 8} more)" if len(unfilled) > 8 else ""))
