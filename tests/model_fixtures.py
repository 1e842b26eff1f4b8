"""The default model in transformers: the oracle the engine's tokens are compared with.

Loading it dequantizes the GGUF to float32, which takes seconds, and several modules compare against it,
so it is loaded once per test process (``hf_reference``), and a greedy continuation asked for twice is
generated once (``hf_greedy``). Modules take them with ``from model_fixtures import ...``.

Transformers' GGUF conversion itself (reading the file's metadata twice, mapping every tensor's name) costs
more than a dozen seconds of one core, in every process that loads the reference: the converted model is
kept in the cache directory (``reference_copy``) and later processes load that copy, the same float32
weights and config, in a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model_files import default_model_path
from engine.tokenizer import cache_dir
from kernels.build_lock import build_lock


def reference_copy(source: Path, load: Callable[[], Any], root: Path) -> Any:
    """``load()``'s model, or the copy of it under ``root`` made from this very ``source`` (path, size,
    modification time) by this transformers version, if there is one; else ``load()``'s model, its copy
    saved for the next process. The copy appears whole or not at all (a rename), so a process that dies
    while saving, or two saving at once, leave no half copy to be read."""
    import transformers
    from transformers import AutoModelForCausalLM

    stat = source.stat()
    key = repr((str(source.resolve()), stat.st_size, stat.st_mtime_ns, transformers.__version__))
    copy = root / f"{source.stem}-{hashlib.blake2b(key.encode(), digest_size=12).hexdigest()}"
    with _one_maker(root):
        if copy.is_dir():
            return AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32)
        model = load()
        tmp = root / f".{copy.name}.{os.getpid()}.tmp"
        try:
            _save(model, tmp)
            os.replace(tmp, copy)
        except OSError:  # no room, read-only, or another process's copy got there first: this run loaded anyway
            shutil.rmtree(tmp, ignore_errors=True)
        return model


@contextlib.contextmanager
def _one_maker(root: Path) -> Iterator[None]:
    """Held while a copy under ``root`` is looked for and made: the xdist workers of a cold run ask for the
    reference at about the same time, and each converted it (a dozen seconds of a core) where the second can
    wait, within the kernels' build bound, and read the first one's copy. Where the lock cannot be made,
    nothing is held (the copy's rename still keeps it whole)."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):
            held.enter_context(build_lock(root.parent / f".{root.name}-lock"))  # beside root: root holds copies only
        yield


def _save(model: Any, directory: Path) -> None:
    """``save_pretrained`` without its refusal of a model loaded from a GGUF (which it counts as quantized,
    though the weights are plain float32 by then): the config without that mark, and the weights."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = reference_copy(path, lambda: AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32), cache_dir() / "hf-reference")
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_reference: Any) -> Callable[[list[int], int], list[int]]:
    """``greedy(prompt_ids, max_new_tokens)``: the reference's greedy continuation (remembered)."""
    done: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in done:
            # On one thread: on a machine shared with other work, torch's OpenMP threads wait on each other at
            # every small matmul, and two of them generate several times slower than one.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with torch.inference_mode():
                    gen = hf_reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            finally:
                torch.set_num_threads(threads)
            done[key] = gen[0, len(ids):].tolist()
        return list(done[key])

    return greedy
