"""Megatron-style tensor-parallel sharding of a Llama-family model: which slice of each weight a rank holds,
and the two collectives the sharded forward pass needs.

Each of ``size`` ranks holds ``1/size`` of the attention heads (query and KV heads alike, so each rank's KV
cache holds its own KV heads) and of the MLP's intermediate features:

- column-parallel (output features split): the fused QKV projection (its Q, K and V rows each split by
  heads) and the fused gate/up projection (gate and up rows each split), with their biases;
- row-parallel (input features split): ``o_proj`` and ``down_proj``, whose partial outputs are summed by one
  all-reduce each (the bias is added by rank 0 only, so it is counted once);
- vocab-parallel LM head: each rank computes the logits of its slice of the vocabulary (padded to equal
  slices), and rank 0 gathers them; sampling happens there. The input embedding stays whole on every rank.

The collectives run on torch.distributed's default process group, which ``engine.distributed`` sets up (gloo
on CPU, NCCL on CUDA) before the first forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from engine.model import ModelConfig
from engine.model.linear import Linear

# HF weight-name suffixes by how they are split.
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes that split this model evenly: divisors of its KV heads (and so of its query
    heads) that also divide its intermediate size."""
    return [n for n in range(1, config.num_kv_heads + 1)
            if config.num_kv_heads % n == 0 and config.intermediate_size % n == 0]


def check_tp_size(config: ModelConfig, size: int) -> None:
    """ValueError naming the valid sizes when ``size`` does not split the model's heads evenly.

    KV heads are never replicated: a rank holds whole KV heads and the query heads that read them, so the
    size must divide the KV heads (SmolLM2-135M: 9 query / 3 KV heads, so 1 or 3; 2 is refused).
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size not in valid_tp_sizes(config):
        raise ValueError(
            f"tensor_parallel_size {size} does not split this model evenly: it has {config.num_heads} query "
            f"heads, {config.num_kv_heads} KV heads and {config.intermediate_size} intermediate features, and "
            f"each rank must hold whole KV heads; valid sizes: {', '.join(map(str, valid_tp_sizes(config)))}")


class CollectiveError(RuntimeError):
    """A collective of the sharded forward pass failed: a peer rank died, hung past the group's timeout, or
    the group broke. The ranks are out of step after it; no retry can help."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    # -- shapes -------------------------------------------------------------------------------------
    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's layers: its share of the heads and intermediate features."""
        check_tp_size(config, self.size)
        return dataclasses.replace(config, num_heads=config.num_heads // self.size,
                                   num_kv_heads=config.num_kv_heads // self.size,
                                   intermediate_size=config.intermediate_size // self.size)

    def vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    # -- weights ------------------------------------------------------------------------------------
    def _part(self, tensor: Tensor, dim: int) -> Tensor:
        step = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * step, step)

    def vocab_shard(self, weight: Tensor) -> Tensor:
        """This rank's rows of an LM-head weight ``[vocab, hidden]``, zero-padded to the shard size (padded
        logits are cut off after the gather)."""
        per = self.vocab_shard_size(weight.shape[0])
        part = weight[self.rank * per : (self.rank + 1) * per]
        return F.pad(part, (0, 0, 0, per - part.shape[0])) if part.shape[0] < per else part

    def shard_weight(self, hf_name: str, tensor: Tensor) -> Tensor:
        """This rank's slice of a checkpoint tensor (HF name), before it is copied into the model."""
        stem, _, leaf = hf_name.rpartition(".")
        if stem.endswith(_COLUMN):
            return self._part(tensor, 0)  # heads and features are contiguous rows, in order
        if stem.endswith(_ROW):
            return self._part(tensor, 1) if leaf == "weight" else tensor  # the bias: see RowParallelLinear
        if stem == "lm_head":
            return self.vocab_shard(tensor)
        return tensor

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: Tensor) -> None:
        """Sum ``x`` over the ranks, in place."""
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise CollectiveError(f"all-reduce failed: {exc}") from exc

    def gather_logits(self, local: Tensor, vocab_size: int) -> Tensor:
        """Rank 0: the whole ``[rows, vocab]`` logits from every rank's slice; other ranks: their own slice
        (unused: only rank 0 samples)."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0)
        except RuntimeError as exc:
            raise CollectiveError(f"logits gather failed: {exc}") from exc
        return local if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]


class RowParallelLinear(Linear):
    """A linear whose input features are split over the ranks: each computes a partial sum, one all-reduce
    adds them up. Still one packed oneDNN (or int8) GEMM per rank (``pack`` and ``quantize`` are the base
    class's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str,
                 dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias if self.tp.rank == 0 else None  # added once, not once per rank
        out = self.matmul(x, bias)
        self.tp.all_reduce(out)
        return out


def row_linear(in_features: int, out_features: int, bias: bool, device: torch.device | str, dtype: torch.dtype,
               tp: TensorParallel | None) -> Linear:
    """A row-parallel linear under tensor parallelism, else the plain one (no collective, no extra call)."""
    if tp is None:
        return Linear(in_features, out_features, bias, device, dtype)
    return RowParallelLinear(in_features, out_features, bias, device, dtype, tp)


__all__ = ["CollectiveError", "RowParallelLinear", "TensorParallel", "check_tp_size", "row_linear", "valid_tp_sizes"]
