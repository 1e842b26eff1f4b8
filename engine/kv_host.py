"""The tensor side of the KV tiers (engine.kv_tiers): host blocks handed to the disk tier and blocks read from
disk written into the host tier, on the engine thread, between the step's plan and its copies.

A spilled block is cloned out of the host tier (a memcpy) before the step's offloads overwrite it; the disk
tier's writer thread hashes and writes the clone. A block read from disk is copied into its host block
before the next plan can load it.

Both copies go through numpy views of the pools' bytes, not torch: a block is ~60 strided runs of a few KiB,
and torch's ``copy_`` opens an OpenMP parallel region for each, which on a busy 2-core machine waited for the
other core at every block (7 ms a bf16 block on two threads against 0.08 ms on one: most of a restored 2k
history's time). numpy copies on the calling thread.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from engine.kv_disk import BlockFormat, DiskStore
from engine.kv_tiers import KVTiers

# The payload's axis order: each block's storage in the host tier (engine.runner.kv_pool stores head-major).
LAYOUT = "layer,kv,head,token,dim"


def block_format(host_cache: Tensor, model: str, dtype: torch.dtype) -> BlockFormat:
    """What a disk block of this host tier holds; ``model`` names the weights the KV came from."""
    storage = host_cache.transpose(3, 4)
    shape = (storage.shape[0], storage.shape[1], *storage.shape[3:])
    elem = torch.empty((), dtype=dtype).element_size()
    return BlockFormat(model=model, dtype=str(dtype).removeprefix("torch."), block_size=host_cache.shape[3],
                       layout=LAYOUT, shape=tuple(shape), payload_bytes=int(torch.Size(shape).numel()) * elem)


class TierIO:
    def __init__(self, host_cache: Tensor, tiers: KVTiers, disk: DiskStore | None,
                 device_cache: Tensor | None = None) -> None:
        self.storage = host_cache.transpose(3, 4)  # [layers, 2, blocks, heads, block_size, dim], contiguous
        host_bytes = _bytes_view(self.storage)
        assert host_bytes is not None  # the host tier is in host memory
        self.host_bytes: np.ndarray = host_bytes
        # The device pool in the same layout: read only when the engine closes.
        self.device_storage = None if device_cache is None else device_cache.transpose(3, 4)
        self.tiers = tiers
        self.disk = disk

    def spill(self, spills: tuple[tuple[int, bytes, tuple[int, ...]], ...], storage: Tensor | None = None) -> None:
        """Hand blocks of ``storage`` (the host tier's unless given) to the disk tier."""
        if self.disk is None:
            return
        source = self.storage if storage is None else storage
        raw = self.host_bytes if storage is None else _bytes_view(storage)
        for block_id, block_hash, tokens in spills:
            # Copied out now (bytes of its own): this step's offloads reuse the host block.
            if raw is not None:
                payload = raw[:, :, block_id].tobytes()
            else:  # a device pool off the host (closing a GPU engine): once, at shutdown
                payload = source[:, :, block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()
            self.disk.write(block_hash, tokens, payload)

    def close(self) -> None:
        """Put every cached block the disk tier lacks on disk and wait for the writes: the host tier's, then
        the device pool's (the conversations active last, written last so the disk's LRU keeps them longest).
        The threads stay: an engine whose loop ends may be driven again (and its tiers keep working)."""
        if self.disk is None:
            return
        self.tiers.stop_preload()
        self.spill(self.tiers.host_only_blocks())
        if self.device_storage is not None:
            self.spill(self.tiers.device_only_blocks(), self.device_storage)
        self.disk.flush()

    def install_reads(self) -> None:
        """Put the blocks the disk tier has read into the host tier (and drop the writes that failed)."""
        if self.disk is None:
            return
        self.disk.take_failed()
        for read in self.tiers.take_completed_reads():
            if read.payload is None:
                continue
            placed = self.tiers.install(read.block_hash, read.token_ids, read.preload)
            if placed is None:
                continue
            host_id, spills = placed
            self.spill(spills)
            target = self.host_bytes[:, :, host_id]
            np.copyto(target, np.frombuffer(read.payload, dtype=np.uint8).reshape(target.shape))
        self.tiers.preload_more()


def _bytes_view(storage: Tensor) -> np.ndarray | None:
    """``storage``'s bytes as a numpy array sharing its memory (the last axis in bytes); None off the host."""
    if storage.device.type != "cpu":
        return None
    return storage.view(torch.uint8).numpy()


__all__ = ["LAYOUT", "TierIO", "block_format"]
