"""The transformers reference's copy (tests/model_fixtures.py): made once from its source, then read in its
place with the same weights and config, and made again when the source changes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from model_fixtures import reference_copy
from tiny_model import make_tiny_model_dir
from transformers import AutoModelForCausalLM


def _loader(model_dir: Path, calls: list[int]) -> Any:
    def load() -> Any:
        calls.append(1)
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    return load


def _config(model: Any) -> dict[str, Any]:
    """The model's config but for where it was read from."""
    return {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}


def test_the_copy_is_read_in_place_of_the_source_with_the_same_model(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path)
    source, root = model_dir / "model.safetensors", tmp_path / "copies"
    calls: list[int] = []
    first = reference_copy(source, _loader(model_dir, calls), root)
    again = reference_copy(source, _loader(model_dir, calls), root)
    assert calls == [1]  # the second came from the copy
    assert [p.name.startswith(f"{source.stem}-") for p in root.iterdir()] == [True]  # one copy, no leftovers
    want, got = first.state_dict(), again.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert _config(again) == _config(first)
    assert again.generation_config.to_dict() == first.generation_config.to_dict()
    ids = torch.tensor([[1, 5, 9, 30]])
    with torch.inference_mode():
        assert torch.equal(again.eval()(ids).logits, first.eval()(ids).logits)


def test_a_changed_source_is_loaded_and_copied_again(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path)
    source, root = model_dir / "model.safetensors", tmp_path / "copies"
    calls: list[int] = []
    reference_copy(source, _loader(model_dir, calls), root)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    reference_copy(source, _loader(model_dir, calls), root)
    reference_copy(source, _loader(model_dir, calls), root)
    assert calls == [1, 1]
    assert len(list(root.iterdir())) == 2


def test_a_copy_that_cannot_be_saved_leaves_the_loaded_model_and_nothing_else(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path)
    source = model_dir / "model.safetensors"
    calls: list[int] = []
    root = tmp_path / "copies"
    root.write_text("not a directory")  # where the copy would go cannot hold one
    model = reference_copy(source, _loader(model_dir, calls), root)
    assert calls == [1] and isinstance(model, torch.nn.Module)
    assert root.read_text() == "not a directory"


def test_two_asking_at_once_make_one_copy(tmp_path: Path) -> None:
    """A second asker waits for the first one's copy instead of loading the source again."""
    model_dir = make_tiny_model_dir(tmp_path)
    source, root = model_dir / "model.safetensors", tmp_path / "copies"
    calls: list[int] = []
    slow = _loader(model_dir, calls)

    def load() -> Any:
        time.sleep(0.5)  # long enough for the other thread to arrive while this one loads
        return slow()

    models: list[Any] = []
    askers = [threading.Thread(target=lambda: models.append(reference_copy(source, load, root))) for _ in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert calls == [1] and len(models) == 2
    want, got = models[0].state_dict(), models[1].state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)

