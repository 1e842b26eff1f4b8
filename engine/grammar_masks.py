"""Token masks for the rows under a grammar: filled off the step's critical path, applied in the sampler.

A step's grammar rows are known once the scheduler has chosen them, and their states do not move until the
step's tokens are accepted, so ``MaskFiller`` computes the masks on a thread of its own while the model runs
its forward; the sampler only waits for them (usually done by then) and applies them.

The masks reach the sampler as *ceilings*: a float per token, ``+inf`` where the grammar allows it and
``-inf`` where it does not (nor past the grammar's vocabulary: a model may pad its LM head beyond it).
``min(logit, ceiling)`` leaves an allowed logit bit for bit and makes a blocked one ``-inf``; an elementwise
minimum is a streaming pass, where a ``masked_fill_`` from a boolean mask measured 20-30x slower here (a
branch per element). The ceilings are made from llguidance's bitmask with a byte -> 8 floats table
(``numpy.take`` releases the GIL and is ~1.5 ms for 32 rows of 49,152 tokens).

On a machine with idle cores the filler's thread runs beside the forward at no cost. Where the forward
already uses every core (torch's threads), the filler runs at a lower priority (nice + 10): it takes the cycles
the forward leaves idle (its Python dispatch, its serial parts) instead of preempting its threads, whose
barriers stall when one of them is descheduled; and if the forward finishes first, the engine thread waits and
the filler gets the core.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from engine.grammar import GrammarState, check_bitmask

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["MaskFiller", "PendingMasks", "allocate_bitmask", "apply_bitmask", "apply_ceilings", "token_ceilings"]

# Bit j of int32 word w is token 32 * w + j; read as bytes, that holds little-endian only.
assert sys.byteorder == "little", "engine.grammar_masks reads int32 bitmasks as little-endian bytes"
_FILLER_NICENESS = 10
# Row b: the ceilings of the 8 tokens whose bits byte b holds, lowest bit first.
_BYTE_CEILINGS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.inf, -np.inf).astype(np.float32)


def allocate_bitmask(rows: int, vocab_size: int) -> Tensor:
    """``[rows, ceil(vocab_size / 32)]`` int32, every token allowed: bit ``t % 32`` of word ``t // 32`` is
    token ``t``. ``vocab_size``: the compiler's (llguidance refuses a mask of another width with a
    ValueError)."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def token_ceilings(bitmask: Tensor, vocab_size: int) -> Tensor:
    """``[rows, 32 * words]`` float32 ceilings (``+inf`` allowed, ``-inf`` blocked) of ``bitmask``'s rows; the
    tokens from ``vocab_size`` on are blocked whatever their bits say."""
    import torch

    check_bitmask(bitmask)
    rows, words = bitmask.shape
    ceilings = np.empty((rows, words * 4, 8), dtype=np.float32)
    np.take(_BYTE_CEILINGS, bitmask.numpy().view(np.uint8), axis=0, out=ceilings)
    flat = ceilings.reshape(rows, words * 32)
    flat[:, vocab_size:] = -np.inf
    return torch.from_numpy(flat)


def apply_ceilings(logits: Tensor, ceilings: Tensor, rows: Sequence[int]) -> None:
    """In place: row ``rows[i]`` of ``logits`` capped by ``ceilings[i]``, and every logit past the ceilings'
    width (a padded LM head) set to ``-inf``. Other rows are left untouched, bit for bit."""
    if not rows:
        return
    import torch

    if ceilings.shape[0] != len(rows):
        raise ValueError(f"{ceilings.shape[0]} rows of ceilings for {len(rows)} grammar rows")
    n = min(logits.shape[1], ceilings.shape[1])
    caps = ceilings[:, :n].to(device=logits.device, dtype=logits.dtype)
    if list(rows) == list(range(logits.shape[0])):
        every = logits[:, :n]
        torch.minimum(every, caps, out=every)
    else:
        index = torch.tensor(list(rows), device=logits.device)
        logits[index, :n] = torch.minimum(logits[index, :n], caps)
    if logits.shape[1] > n:
        logits[torch.tensor(list(rows), device=logits.device), n:] = float("-inf")


def apply_bitmask(logits: Tensor, bitmask: Tensor, rows: Sequence[int], vocab_size: int) -> None:
    """``apply_ceilings`` from a bitmask with a row per row of ``logits`` (only ``rows`` are read)."""
    if rows:
        apply_ceilings(logits, token_ceilings(bitmask[list(rows)].contiguous(), vocab_size), rows)


@dataclass(frozen=True)
class PendingMasks:
    """Ceilings being filled for a step's sequences: row ``i`` of the result is ``seq_ids[i]``'s."""

    seq_ids: tuple[int, ...]
    ceilings: Future[Tensor]


class MaskFiller:
    """Fills grammar rows' masks on one thread of its own (see the module's docstring), with llguidance's
    executor made on that thread so that its workers run at the thread's priority too."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._llg: llguidance.LLExecutor | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks",
                                        initializer=self._start_thread)

    def _start_thread(self) -> None:
        # Linux: a thread id names the thread alone, and the threads it starts inherit its niceness. Where it
        # is not permitted the masks still come, at the forward's priority.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _FILLER_NICENESS)
        self._llg = llguidance.LLExecutor()

    def ceilings(self, states: Sequence[GrammarState]) -> Future[Tensor]:
        """The ceilings of ``states``' next tokens, a row per state in order, computed on the filler's thread.
        The states must not move until the future is done."""
        return self._pool.submit(self._ceilings, tuple(states))

    def fill_bitmask(self, bitmask: Tensor, rows: Mapping[int, GrammarState]) -> None:
        """Fills ``bitmask[row]`` for every ``row: state`` (the rows in parallel where llguidance has several
        threads) and returns when done. Other rows are not written."""
        self._pool.submit(self._fill, bitmask, dict(rows)).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _ceilings(self, states: tuple[GrammarState, ...]) -> Tensor:
        bitmask = allocate_bitmask(len(states), self.vocab_size)
        self._fill(bitmask, dict(enumerate(states)))
        return token_ceilings(bitmask, self.vocab_size)

    def _fill(self, bitmask: Tensor, rows: dict[int, GrammarState]) -> None:
        check_bitmask(bitmask)
        if rows:
            assert self._llg is not None
            words = bitmask.shape[1]
            pairs = [(state.matcher, row) for row, state in rows.items()]
            self._llg.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, bitmask.shape[0])
