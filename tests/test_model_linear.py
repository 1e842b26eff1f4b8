"""Packed oneDNN linears against F.linear, backend resolution, and dtype="auto"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_model import make_tiny_model_dir

from engine.engine import resolve_dtype
from engine.loader import load_model
from engine.model import linear
from engine.model.linear import Linear, onednn_supports, resolve_linear_backend

# (out, in) of every projection of SmolLM2-135M: qkv, o, gate_up, down, and the tied LM head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if onednn_supports(d, "cpu")]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 96])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, out_features: int, in_features: int, rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(in_features, out_features, bias=True, device="cpu", dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        assert layer.bias is not None
        layer.bias.normal_(0, 0.05)
    # A strided view, as the model passes (attention output reshaped, qkv slices).
    x = torch.randn(rows, 2 * in_features, dtype=dtype)[:, :in_features]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    layer.pack()
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale


def test_resolve_linear_backend() -> None:
    assert resolve_linear_backend("torch", torch.float32, "cpu") == "torch"
    assert resolve_linear_backend("auto", torch.float32, "cpu") == ("onednn" if onednn_supports(torch.float32, "cpu")
                                                                   else "torch")
    with pytest.raises(ValueError, match="linear_backend"):
        resolve_linear_backend("mkl", torch.float32, "cpu")


def test_auto_falls_back_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: bf16 GEMMs are emulated there, so "auto" means float32 and F.linear for bf16."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_linear_backend("auto", torch.bfloat16, "cpu") == "torch"
    with pytest.raises(ValueError, match="natively"):
        resolve_linear_backend("onednn", torch.bfloat16, "cpu")


def test_auto_takes_bf16_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_loaded_model_packs_every_linear(tmp_path: Path, backend: str) -> None:
    if backend == "onednn" and not onednn_supports(torch.float32, "cpu"):
        pytest.skip("no oneDNN on this build")
    lm = load_model(str(make_tiny_model_dir(tmp_path)), linear_backend=backend)
    layers = [m for m in lm.model.modules() if isinstance(m, linear.Linear)]
    assert layers
    assert all((m.packed is not None) == (backend == "onednn") for m in layers)
    assert (lm.model.lm_head_packed is not None) == (backend == "onednn")


def test_gemm_rows_keeps_few_shapes_at_a_small_padding_cost() -> None:
    assert [linear.gemm_rows(t) for t in (1, 7, 64)] == [1, 7, 64]  # decode batches stay exact
    padded = {t: linear.gemm_rows(t) for t in range(65, 4097)}
    assert all(p >= t for t, p in padded.items())
    assert max((p - t) / t for t, p in padded.items()) < 0.25
    assert max((p - t) / t for t, p in padded.items() if t >= 512) < 1 / 16
    assert len(set(padded.values())) <= 80  # vs 4032 row counts, each a new oneDNN primitive per weight
    assert linear.gemm_rows(2048) == 2048 and linear.gemm_rows(4096) == 4096


def test_a_probe_is_remembered_per_key_and_an_unreadable_file_probed_over(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "gemm_probes.json"
    calls: list[str] = []

    def probe(found: range | None, name: str) -> Callable[[], range | None]:
        def run() -> range | None:
            calls.append(name)
            return found
        return run

    key = {"cpu": "x", "threads": 2}
    assert linear.remembered_probe(path, key, probe(linear.SLOW_ROWS, "first")) == linear.SLOW_ROWS
    assert linear.remembered_probe(path, key, probe(None, "again")) == linear.SLOW_ROWS  # remembered
    assert linear.remembered_probe(path, {**key, "threads": 1}, probe(None, "other")) is None  # a new key
    assert linear.remembered_probe(path, {**key, "threads": 1}, probe(linear.SLOW_ROWS, "other")) is None
    assert calls == ["first", "other"]
    path.write_text("{not json")
    assert linear.remembered_probe(path, key, probe(None, "corrupt")) is None
    assert calls[-1] == "corrupt"
    assert linear.remembered_probe(path, key, probe(linear.SLOW_ROWS, "x")) is None  # rewritten whole


def test_a_probe_that_cannot_be_written_down_still_answers(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    # A cache directory under a regular file cannot be created: the decision stands, unremembered.
    assert linear.remembered_probe(blocker / "sub" / "p.json", {"k": 1}, lambda: linear.SLOW_ROWS) == linear.SLOW_ROWS
