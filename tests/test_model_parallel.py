"""Sharding a model for tensor parallelism: which sizes are valid, how weights split, and a sharded forward pass
over real gloo ranks that gives the unsharded model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from tiny_model import make_tiny_model_dir

from engine.loader import load_model
from engine.model import ModelConfig
from engine.model.attention import prefill_metadata
from engine.model.linear import Linear
from engine.model.parallel import RowParallelLinear, TensorParallel, check_tp_size, valid_tp_sizes
from engine.model_files import load_tokenizer

BLOCK = 4


def _config(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=64, num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                       vocab_size=100, intermediate_size=intermediate)


def test_valid_sizes_divide_the_kv_heads_and_the_mlp() -> None:
    assert valid_tp_sizes(_config(8, 4)) == [1, 2, 4]
    assert valid_tp_sizes(_config(8, 8, intermediate=96)) == [1, 2, 4, 8]
    assert valid_tp_sizes(_config(8, 4, intermediate=130)) == [1, 2]
    with pytest.raises(ValueError, match="valid sizes: 1, 2, 4"):
        check_tp_size(_config(8, 4), 3)


def test_smollm2_takes_three_ranks_and_refuses_two() -> None:
    _, config = load_tokenizer()  # the real SmolLM2-135M: 9 query heads, 3 KV heads
    assert (config.num_heads, config.num_kv_heads) == (9, 3)
    assert valid_tp_sizes(config) == [1, 3]
    with pytest.raises(ValueError, match=r"9 query heads, 3 KV heads .* valid sizes: 1, 3"):
        check_tp_size(config, 2)
    local = TensorParallel(1, 3).local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, config.intermediate_size // 3)


def test_rank_slices_put_back_together_are_the_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(12, 8)
    ranks = [TensorParallel(r, 2) for r in range(2)]
    column = [tp.shard_weight("model.layers.0.self_attn.k_proj.weight", weight) for tp in ranks]
    torch.testing.assert_close(torch.cat(column, dim=0), weight)
    row = [tp.shard_weight("model.layers.0.mlp.down_proj.weight", weight) for tp in ranks]
    torch.testing.assert_close(torch.cat(row, dim=1), weight)
    bias = torch.randn(12)  # a row-parallel bias stays whole (rank 0 adds it)
    assert ranks[1].shard_weight("model.layers.0.self_attn.o_proj.bias", bias) is bias
    norm = torch.randn(8)
    assert ranks[1].shard_weight("model.layers.0.input_layernorm.weight", norm) is norm


def test_vocab_shards_are_padded_to_equal_size() -> None:
    weight = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 2)
    shards = [TensorParallel(r, 3).vocab_shard(weight) for r in range(3)]
    assert [s.shape[0] for s in shards] == [4, 4, 4]
    torch.testing.assert_close(torch.cat(shards)[:10], weight)
    assert shards[2][2:].abs().sum() == 0  # padding rows give logits that the gather cuts off


def _sharded_logits(rank: int, size: int, store: str, cases: list[tuple[str, str, str]]) -> None:
    """One rank: for each (model, linear backend, output) load its shard and prefill two prompts into its own
    KV cache; rank 0 saves the logits."""
    torch.set_num_threads(1)
    # A file rendezvous: a port picked free and bound later by rank 0 can be taken meanwhile.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        for model_dir, linear_backend, out in cases:
            lm = load_model(model_dir, linear_backend=linear_backend, tp=TensorParallel(rank, size))
            assert all(isinstance(m, RowParallelLinear) for name, m in lm.model.named_modules()
                       if name.endswith(("o_proj", "down_proj")))
            c = lm.model.layer_config
            kv = torch.full((c.num_layers, 2, 16, BLOCK, c.num_kv_heads, c.head_dim), 50.0)
            ids = [lm.tokenizer.encode("The quick brown fox jumps over the lazy dog."),
                   lm.tokenizer.encode("what is the capital of France?")]
            meta, pos = prefill_metadata([len(i) for i in ids], BLOCK)
            with torch.inference_mode():
                logits = lm.model.compute_logits(lm.model(torch.tensor(ids[0] + ids[1]), pos, kv, meta))
            if rank == 0:
                torch.save({"ids": ids, "logits": logits}, out)
        # Both ranks past their last collective before either tears gloo down: a rank destroying the group
        # while its peer is still in one aborted ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_forward_gives_the_whole_models_logits(tmp_path: Path) -> None:
    # llama with every bias (row-parallel biases must be added once) on packed oneDNN linears; qwen2 (Q/K/V
    # biases, an untied LM head) on F.linear. One pair of ranks runs both.
    cases = [(make_tiny_model_dir(tmp_path, "llama", attention_bias=True, mlp_bias=True), "onednn"),
             (make_tiny_model_dir(tmp_path, "qwen2"), "torch")]
    outs = [tmp_path / f"logits-{i}.pt" for i in range(len(cases))]
    args = [(str(d), backend, str(out)) for (d, backend), out in zip(cases, outs, strict=True)]
    torch_mp.spawn(_sharded_logits, args=(2, str(tmp_path / "rendezvous"), args), nprocs=2)
    for (model_dir, linear_backend), out in zip(cases, outs, strict=True):
        saved = torch.load(out)
        whole = load_model(str(model_dir), linear_backend=linear_backend)
        assert type(whole.model.get_submodule("model.layers.0.self_attn.o_proj")) is Linear  # TP=1: no collective
        c = whole.config
        kv = torch.full((c.num_layers, 2, 16, BLOCK, c.num_kv_heads, c.head_dim), 50.0)
        meta, pos = prefill_metadata([len(i) for i in saved["ids"]], BLOCK)
        with torch.inference_mode():
            expected = whole.model.compute_logits(whole.model(torch.tensor(saved["ids"][0] + saved["ids"][1]), pos,
                                                              kv, meta))
        assert saved["logits"].shape == expected.shape == (pos.shape[0], c.vocab_size)
        torch.testing.assert_close(saved["logits"], expected, atol=1e-4, rtol=1e-4)
