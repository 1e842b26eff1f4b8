"""The kernel contract: what a backend gives the model (``AttentionBackend``) and its elementwise ops (``ModelOps``).

Tensor dtypes are part of the contract, so no kernel converts its inputs per call: block tables, context
lengths and query starts are int32, slot mappings and block mappings int64, K/V in the cache's dtype. The
engine's runner builds them that way once per step; a kernel may reject anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class DecodeWeight:
    """A projection's weight packed for a backend's decode GEMM (``run(x, packed)``), which a decode's rows (up
    to ``max_rows``) run on instead of oneDNN's: see kernels/csrc/cpu_kernels.cpp, amx_linear and
    bf16_linear (bf16), f32_linear (float32)."""

    packed: Tensor
    run: Callable[[Tensor, Tensor], Tensor]
    max_rows: int

    def __call__(self, x: Tensor) -> Tensor:
        return self.run(x, self.packed)


@dataclass(frozen=True)
class ModelOps:
    """The elementwise ops of a decoder layer, fused (one pass over the rows, no temporaries) where the
    backend has kernels for them. Same semantics in every backend (float32 math inside for half types):

    - ``fused_add_rms_norm(x, residual, weight, eps) -> None``, in place (vLLM semantics): residual += x,
      then x = rms_norm(residual) * weight; x, residual ``[..., N]``, weight ``[N]``.
    - ``silu_and_mul(gate_up) -> Tensor``: ``[..., 2I] -> [..., I]``, silu(first half) * second half.
    - ``rotary_embedding(qk, cos, sin) -> None``, in place on ``qk [T, H, D]`` (may be a strided view of the
      fused QKV output), "rotate_half" layout; cos, sin ``[T, D/2]`` or ``[T, 1, D/2]`` in qk's dtype.
    """

    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], None]
    silu_and_mul: Callable[[Tensor], Tensor]
    rotary_embedding: Callable[[Tensor, Tensor, Tensor], None]


@dataclass(frozen=True)
class StackedLayer:
    """One Llama-layout decoder layer's weights for ``AttentionBackend.layer_stack``: the two norms' weights
    and the four projections packed for oneDNN (``engine.model.linear.pack_weight``), Q/K/V and gate/up
    fused as the model holds them, each with its bias or None."""

    input_norm: Tensor
    qkv: Tensor
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    qkv_decode: Tensor | None = None  # packed for the backend's decode GEMM too (DecodeWeight.packed)
    o_decode: Tensor | None = None
    gate_up_decode: Tensor | None = None
    down_decode: Tensor | None = None


@dataclass(frozen=True)
class StackShape:
    """What the layers of a ``layer_stack`` share: the norms' epsilon and the attention heads' shape."""

    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class LayerStack(Protocol):
    """A model's decoder layers and final norm as one kernel call: the same ops in the same order as the
    layer modules, so the same output, without the Python between them."""

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                block_tables: Tensor, query_start_loc: Tensor | None, context_lens: Tensor,
                num_tokens: int) -> Tensor:
        """``h``: the step's embeddings ``[T, hidden]``; cos, sin ``[T, D/2]``; ``kv_cache`` ``[layers, 2, ...]``;
        ``query_start_loc`` None when every sequence is a one-token decode; ``num_tokens``: the real rows
        when T is padded (attention neither stores nor attends from the rest). Returns the final-normed
        hidden states ``[T, hidden]``; writes each layer's K/V into the cache."""
        ...


def no_layer_stack(layers: Sequence[StackedLayer], final_norm: Tensor, shape: StackShape) -> LayerStack | None:
    """``layer_stack`` of a backend without such a kernel: the model runs its layers module by module."""
    del layers, final_norm, shape
    return None


class AttentionBackend(Protocol):
    """Paged attention over a KV cache of ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer and
    K/V, the block moves the scheduler plans, and the model's elementwise ops. Caches are addressed through
    their strides (the head dimension contiguous, each block one dense run of memory): the engine's pools
    are that shape's view of head-major blocks (``engine.runner.kv_pool``), tests also pass contiguous ones."""

    @property
    def name(self) -> str: ...

    @property
    def ops(self) -> ModelOps: ...

    @property
    def mixed_batches(self) -> bool:
        """Whether ``paged_attention_prefill`` also takes decode rows (one query each), so a step mixing
        decodes and prefill chunks is one call instead of a call per kind plus two copies."""

    def argmax(self, logits: Tensor) -> Tensor:
        """Each row's greedy token ``[rows, vocab] -> int64 [rows]``: torch.argmax's answer (the first index of
        the maximum, the first NaN if the row has one) in any floating dtype."""

    def write_kv_cache(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor) -> None:
        """Store each token's K/V ``[T, Hkv, D]`` at its slot (``block * block_size + offset``; -1: skip).
        In place; key/value may be strided views (of the fused QKV projection)."""

    def paged_attention_decode(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               context_lens: Tensor, scale: float, max_context_len: int | None = None) -> Tensor:
        """One query token per sequence ``[B, Hq, D]`` attends to its whole context through its block table."""

    def paged_attention_prefill(self, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                query_start_loc: Tensor, context_lens: Tensor, scale: float,
                                max_query_len: int | None = None, max_context_len: int | None = None) -> Tensor:
        """Each sequence's queries (the last ``query_start_loc[i+1] - query_start_loc[i]`` tokens of its context,
        ``[T, Hq, D]`` for all) attend causally to its context, cached prefix included."""

    def copy_blocks(self, kv_cache: Tensor, block_mapping: Tensor) -> None:
        """Copy whole blocks ``(src, dst)`` in every layer's K and V (copy-on-write). In place."""

    def swap_blocks(self, src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
        """Copy blocks ``(src, dst)`` between the device and the CPU pool (swap out / in). In place on dst."""

    def layer_stack(self, layers: Sequence[StackedLayer], final_norm: Tensor, shape: StackShape) -> LayerStack | None:
        """The decoder layers (in order) and the final norm as one call, or None where this backend has no
        such kernel (``no_layer_stack``)."""


__all__ = ["AttentionBackend", "DecodeWeight", "LayerStack", "ModelOps", "StackShape", "StackedLayer", "no_layer_stack"]
