"""The KV tiers under the device pool: host memory, then disk, keyed like the prefix cache.

Accounting only (no torch), beside the block manager: the host tier is a second cached ``BlockPool``, the
disk tier an ``engine.kv_disk.DiskStore``. Blocks move down when a pool evicts them and up when a prefix
lookup finds them, always as plans the engine executes on tensors (``engine.plan.TierPlan``):

* A full, cached block the device pool evicts is copied to a host block cached under the same hash and
  tokens (``offload``); a host block evicted for it goes to the disk tier first (``spill``).
* At admission, the leading blocks of a prompt that the device pool lacks but the host tier holds get fresh
  device blocks, registered in the device cache, filled from the host (``load``): the admission then sees
  them as ordinary prefix hits.
* Blocks that continue the prompt on disk are read by the disk tier's reader thread while the request waits
  aside (others pass it); once read they are installed in the host tier and the request is admitted again.
  The step never waits on the disk.
* A warm (a client opened a conversation; its next message is likely) does the same ahead of any request:
  disk blocks are read into the host tier, and host blocks go to device blocks nobody holds a hash in, so a
  warm evicts nothing from the pool and never holds a block a request could need.
* At start-up (``start_preload``), the host tier is refilled from the disk tier in the background: the disk's
  most recently used blocks first, into host blocks nobody has used yet (never evicting one), each placed
  below everything already there (it is older than all of it). A few reads at a time (``PRELOAD_IN_FLIGHT``),
  so a request's own reads queue behind at most those, and none while a request waits on the disk. A
  restarted server's first turns then restore from memory, as before the restart.

A block a plan reads or writes in the host tier is held (a reference) until the next plan is made, so no
later decision in the same step reuses it before the engine has executed the copies.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.block_pool import BlockPool
from engine.kv_disk import DiskStore
from engine.plan import TierPlan
from engine.protocol import EngineStats
from engine.request import Sequence, SequenceGroup

log = logging.getLogger("chatsvc.engine.kv_tiers")

# Preload reads queued on the disk tier's reader at once: a request's reads wait behind at most these (a few
# milliseconds), and the engine installs at most these between two steps.
PRELOAD_IN_FLIGHT = 8


@dataclass
class TierCounters:
    host_hit_blocks: int = 0  # blocks restored from the host tier
    host_offloaded_blocks: int = 0  # device evictions copied to the host tier
    disk_hit_blocks: int = 0  # blocks read from disk into the host tier
    disk_spilled_blocks: int = 0  # host evictions handed to the disk tier
    disk_failed_loads: int = 0  # reads that found no valid file (gone, corrupt, foreign): recomputed
    disk_load_seconds: float = 0.0  # read start to install, summed over disk_hit_blocks
    warm_loaded_blocks: int = 0  # host blocks a warm copied into the device pool
    warm_read_blocks: int = 0  # disk blocks a warm started reading into the host tier
    host_preloaded_blocks: int = 0  # disk blocks the start-up preload installed in the host tier


@dataclass
class _Read:
    token_ids: tuple[int, ...]
    future: Future[bytearray | None]
    started: float = field(default_factory=time.perf_counter)
    preload: bool = False  # started by the preload and wanted by nobody else (yet)


@dataclass(frozen=True)
class CompletedRead:
    block_hash: bytes
    token_ids: tuple[int, ...]
    payload: bytearray | None  # None: the file was gone or bad, the block is recomputed
    preload: bool = False  # read for the start-up preload only


class KVTiers:
    def __init__(self, block_manager: BlockManager, num_host_blocks: int, disk: DiskStore | None = None) -> None:
        self.block_manager = block_manager
        self.device = block_manager.device
        self.device.evictions = []
        self.host = BlockPool(num_host_blocks, enable_caching=True)
        self.host.evictions = []
        self.disk = disk
        self.counters = TierCounters()
        # At most half the host tier is read for one request: the chain's head must not be evicted by its tail.
        self.max_read_blocks = max(1, num_host_blocks // 2)
        self._held_host: list[int] = []
        self._held_device: list[int] = []
        self._loads: list[tuple[int, int]] = []
        self._reads: dict[bytes, _Read] = {}
        self._waiting_on: dict[str, set[bytes]] = {}
        self._tried_disk: set[str] = set()
        self._warming: dict[str, set[bytes]] = {}  # warm key -> the disk reads it started
        self._preload: deque[tuple[bytes, tuple[int, ...]]] = deque()  # disk blocks to preload, newest first
        self._preload_started = 0.0

    # -- the plan ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The previous plan has run: its host blocks may be reused."""
        for block_id in self._held_host:
            self.host.decref(block_id)
        self._held_host.clear()

    def restore(self, seq: Sequence) -> None:
        """Bring the host tier's blocks that continue ``seq``'s device prefix hits into the device pool, as
        cached blocks. The hits and restored blocks are held until ``release_admission``, so allocating for
        the admission cannot evict them. Nothing is restored unless the whole sequence then fits in the free
        blocks: loading blocks that cannot be used would only push out others."""
        device = self.device
        chain = self.block_manager.prefix_chain(seq)
        hits = 0
        for block_hash, tokens in chain:
            block_id = device.lookup(block_hash, tokens)
            if block_id is None:
                break
            device.incref(block_id)
            self._held_device.append(block_id)
            hits += 1
        run: list[tuple[int, bytes, tuple[int, ...]]] = []
        for block_hash, tokens in chain[hits:]:
            host_id = self.host.lookup(block_hash, tokens)
            if host_id is None:
                break
            run.append((host_id, block_hash, tokens))
        needed = -(-seq.num_tokens // self.block_manager.block_size) - hits
        if not run or device.num_free < needed:
            return
        for host_id, block_hash, tokens in run:
            self.host.incref(host_id)
            self._held_host.append(host_id)
            block = device.allocate(after=self._held_device[-1] if self._held_device else None)
            device.cache(block.block_id, block_hash, tokens)
            self._held_device.append(block.block_id)
            self._loads.append((host_id, block.block_id))
        self.counters.host_hit_blocks += len(run)

    def release_admission(self) -> None:
        """The admissions of this step are decided: restored blocks nobody took stay cached and free."""
        for block_id in reversed(self._held_device):
            self.device.decref(block_id)
        self._held_device.clear()

    def finish_plan(self) -> TierPlan:
        """The step's moves: the device pool's evictions offloaded to the host tier, the host blocks those
        push out spilled to disk, and the loads ``restore`` planned."""
        offloads: list[tuple[int, int]] = []
        assert self.device.evictions is not None
        for device_id, block_hash, tokens in self.device.evictions:
            host_id = self.host.lookup(block_hash, tokens)
            if host_id is not None:  # already there: only fresher
                self.host.incref(host_id)
                self.host.decref(host_id)
                continue
            if self.host.num_free == 0:  # every host block is in this plan: this one is lost
                continue
            block = self.host.allocate()
            self.host.cache(block.block_id, block_hash, tokens)
            self._held_host.append(block.block_id)
            offloads.append((device_id, block.block_id))
        self.device.evictions.clear()
        self.counters.host_offloaded_blocks += len(offloads)
        loads, self._loads = self._loads, []
        return TierPlan(spill=self._take_spills(), offload=tuple(offloads), load=tuple(loads))

    def _take_spills(self) -> tuple[tuple[int, bytes, tuple[int, ...]], ...]:
        """Host evictions the disk tier does not hold yet (the engine hands their KV to its writer)."""
        assert self.host.evictions is not None
        spills = []
        for host_id, block_hash, tokens in self.host.evictions:
            if self.disk is None:
                continue
            if self.disk.contains(block_hash, tokens):
                self.disk.index.move_to_end(block_hash)
                continue
            spills.append((host_id, block_hash, tokens))
        self.host.evictions.clear()
        self.counters.disk_spilled_blocks += len(spills)
        return tuple(spills)

    # -- warm on intent -------------------------------------------------------------------------------
    def warm(self, key: str, chain: list[tuple[bytes, tuple[int, ...]]]) -> TierPlan:
        """Bring the blocks of ``chain`` (a history, ``BlockManager.history_chain``) up one tier, as a plan the
        engine runs before its next step: host blocks are loaded into free device blocks (never more than half
        of the free ones, so a warm never takes a running request's room, and only free blocks: nothing
        pinned or in use is evicted; the cached ones it evicts are offloaded first, as a step's are); the
        blocks that continue on disk are read into the host tier by the reader thread (at most
        ``max_read_blocks``). One warm per ``key`` at a time: while its reads are in flight, another warm of
        the key does nothing."""
        self._warming = {k: hashes for k, hashes in self._warming.items() if hashes & self._reads.keys()}
        if key in self._warming:
            return TierPlan()
        device = self.device
        budget = device.num_free // 2
        held: list[int] = []  # the chain's device blocks, so that loading its tail cannot evict its head
        reads: set[bytes] = set()
        loaded = 0
        for block_hash, tokens in chain:
            block_id = device.lookup(block_hash, tokens)
            if block_id is not None:
                device.incref(block_id)
                held.append(block_id)
                continue
            host_id = self.host.lookup(block_hash, tokens)
            if host_id is not None:
                self.host.incref(host_id)  # the most recently used now; held until the plan has run
                self._held_host.append(host_id)
                if budget > 0:
                    budget -= 1
                    block = device.allocate(after=held[-1] if held else None)
                    device.cache(block.block_id, block_hash, tokens)
                    held.append(block.block_id)
                    self._loads.append((host_id, block.block_id))
                    loaded += 1
                continue
            if self.disk is None or len(reads) >= self.max_read_blocks or not self.disk.contains(block_hash, tokens):
                break
            reads.add(block_hash)
            self._want_read(block_hash, tokens)
        for block_id in reversed(held):  # free again, cached: a request takes them as prefix hits
            device.decref(block_id)
        if reads:
            self._warming[key] = reads
        self.counters.warm_loaded_blocks += loaded
        self.counters.warm_read_blocks += len(reads)
        return self.finish_plan()

    def warm_reads(self, key: str) -> set[bytes]:
        """The disk reads the warm of ``key`` is waiting for."""
        return self._warming.get(key, set()) & self._reads.keys()

    # -- disk reads -------------------------------------------------------------------------------
    def start_disk_loads(self, group: SequenceGroup) -> bool:
        """Start reading the blocks on disk that continue the group's prompts past the device and host
        tiers; True if any are being read (the group should wait for them). Once per request, so a request
        whose blocks are pushed out again while it waits is recomputed instead of waiting forever."""
        if self.disk is None or group.request_id in self._tried_disk:
            return False
        self._tried_disk.add(group.request_id)
        wanted: set[bytes] = set()
        for seq in group.unfinished_seqs():
            for block_hash, tokens in self.block_manager.prefix_chain(seq):
                if self.device.lookup(block_hash, tokens) is not None:
                    continue
                host_id = self.host.lookup(block_hash, tokens)
                if host_id is not None:
                    # Made the most recently used: the blocks read for this chain's tail are installed over
                    # the host tier's least recently used ones, which must not be this chain's own head.
                    self.host.incref(host_id)
                    self.host.decref(host_id)
                    continue
                if len(wanted) >= self.max_read_blocks or not self.disk.contains(block_hash, tokens):
                    break
                wanted.add(block_hash)
                self._want_read(block_hash, tokens)
        if wanted:
            self._waiting_on[group.request_id] = wanted
        return bool(wanted)

    def _want_read(self, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        """Read a block for a request or warm: one the preload is reading already becomes theirs."""
        assert self.disk is not None
        read = self._reads.get(block_hash)
        if read is None:
            self._reads[block_hash] = _Read(tokens, self.disk.read(block_hash, tokens))
        elif read.preload:
            read.preload = False
            self.disk.touch(block_hash)

    # -- the start-up preload ---------------------------------------------------------------------
    def start_preload(self) -> None:
        """Queue the disk tier's most recently used blocks, as many as the host tier holds, to be read into
        it in the background (``preload_more``, from every step)."""
        if self.disk is None or self.host.num_blocks == 0:
            return
        newest = reversed(self.disk.index.items())
        self._preload = deque(item for _, item in zip(range(self.host.num_blocks), newest, strict=False))
        self._preload_started = time.perf_counter()

    def preload_more(self) -> None:
        """Start preload reads up to ``PRELOAD_IN_FLIGHT``: none while a request waits on the disk (its reads
        go first), and no more once the host tier has no unused block left."""
        if self.disk is None or not self._preload or self._request_waits_on_disk():
            return
        in_flight = sum(1 for read in self._reads.values() if read.preload)
        while self._preload and in_flight < PRELOAD_IN_FLIGHT:
            if self.host.num_free_uncached <= in_flight:  # the reads in flight take the rest
                self._preload.clear()
                break
            block_hash, tokens = self._preload.popleft()
            if (block_hash in self._reads or self.host.lookup(block_hash, tokens) is not None
                    or not self.disk.contains(block_hash, tokens)):
                continue
            self._reads[block_hash] = _Read(tokens, self.disk.read(block_hash, tokens, touch=False), preload=True)
            in_flight += 1
        if not self.preloading:
            self._preload_done()

    def stop_preload(self) -> None:
        """Queue no more preload reads, cancel those not started and drop the one running once it is done
        (shutting down: its block stays on disk)."""
        self._preload.clear()
        preloads = [h for h, read in self._reads.items() if read.preload]
        running = [self._reads[h].future for h in preloads if not self._reads[h].future.cancel()]
        wait(running)
        for block_hash in preloads:
            del self._reads[block_hash]

    @property
    def preloading(self) -> bool:
        return bool(self._preload) or any(read.preload for read in self._reads.values())

    def _request_waits_on_disk(self) -> bool:
        return any(h in self._reads for wanted in self._waiting_on.values() for h in wanted)

    def _preload_done(self) -> None:
        if self._preload_started:
            log.info("preloaded %d KV blocks from the disk tier into the host tier in %.1f s",
                     self.counters.host_preloaded_blocks, time.perf_counter() - self._preload_started)
            self._preload_started = 0.0

    def loads_done(self, request_id: str) -> bool:
        """Whether every block the request waits for has been read and installed (or failed)."""
        return not any(h in self._reads for h in self._waiting_on.get(request_id, ()))

    @property
    def reading(self) -> bool:
        """Reads a request or warm waits for (the preload's are background work: ``preloading``)."""
        return any(not read.preload for read in self._reads.values())

    def reads_in_flight(self) -> list[Future[bytearray | None]]:
        return [read.future for read in self._reads.values()]

    def take_completed_reads(self) -> list[CompletedRead]:
        completed = []
        for block_hash in [h for h, read in self._reads.items() if read.future.done()]:
            read = self._reads.pop(block_hash)
            try:
                payload = read.future.result()
            except Exception:  # noqa: BLE001 - a read that broke is a miss: the tokens are recomputed
                payload = None
            if payload is None:
                assert self.disk is not None
                self.disk.forget(block_hash)
                self.counters.disk_failed_loads += 1
            elif not read.preload:
                self.counters.disk_hit_blocks += 1
                self.counters.disk_load_seconds += time.perf_counter() - read.started
            completed.append(CompletedRead(block_hash, read.token_ids, payload, read.preload))
        return completed

    def install(self, block_hash: bytes, token_ids: tuple[int, ...], preload: bool = False
                ) -> tuple[int, tuple[tuple[int, bytes, tuple[int, ...]], ...]] | None:
        """A host block for a block read from disk, cached and free (least evictable), and the host blocks
        its allocation pushed out to spill first; None if the host tier has it already or has no room.
        A ``preload`` block only takes an unused host block, and is the first to be evicted (it is older than
        everything the host tier held before it)."""
        if self.host.lookup(block_hash, token_ids) is not None or self.host.num_free == 0:
            return None
        if preload and self.host.num_free_uncached == 0:
            self._preload.clear()
            return None
        block = self.host.allocate()
        self.host.cache(block.block_id, block_hash, token_ids)
        self.host.decref(block.block_id)
        if preload:
            self.host.make_coldest(block.block_id)
            self.counters.host_preloaded_blocks += 1
        return block.block_id, self._take_spills()

    def stats(self, base: EngineStats, block_bytes: int) -> EngineStats:
        """``base`` with the tiers' fields filled in, for blocks of ``block_bytes``."""
        c, disk = self.counters, self.disk
        if disk is not None:
            disk.take_failed()  # writes that failed since the last step are not on disk: not counted as there
        return dataclasses.replace(
            base, kv_host_blocks_total=self.host.num_blocks, kv_host_blocks_cached=self.host.num_cached_free,
            kv_host_bytes=self.host.num_blocks * block_bytes, kv_host_hit_blocks=c.host_hit_blocks,
            kv_host_offloaded_blocks=c.host_offloaded_blocks,
            kv_disk_blocks=disk.num_blocks if disk else 0, kv_disk_bytes=disk.num_bytes if disk else 0,
            kv_disk_hit_blocks=c.disk_hit_blocks, kv_disk_spilled_blocks=c.disk_spilled_blocks,
            kv_disk_failed_loads=c.disk_failed_loads, kv_disk_dropped_files=disk.dropped_files if disk else 0,
            kv_disk_write_failures=disk.write_failures if disk else 0, kv_disk_load_seconds=c.disk_load_seconds,
            kv_warm_loaded_blocks=c.warm_loaded_blocks, kv_warm_read_blocks=c.warm_read_blocks,
            kv_host_preloaded_blocks=c.host_preloaded_blocks)

    def host_only_blocks(self) -> tuple[tuple[int, bytes, tuple[int, ...]], ...]:
        """Cached host blocks the disk tier lacks, oldest first (as ``spill`` entries)."""
        if self.disk is None:
            return ()
        cached = [b for b in self.host.blocks if b.block_hash is not None]
        return tuple((b.block_id, b.block_hash, b.token_ids) for b in cached
                     if b.block_hash is not None and not self.disk.contains(b.block_hash, b.token_ids))

    def device_only_blocks(self) -> tuple[tuple[int, bytes, tuple[int, ...]], ...]:
        """Cached device blocks the disk tier lacks, least recently used first (as ``spill`` entries, with
        device block ids): the conversations active last, which no eviction has moved down yet."""
        if self.disk is None:
            return ()
        blocks = [self.device.blocks[i] for i in self.device.cached_block_ids()]
        return tuple((b.block_id, b.block_hash, b.token_ids) for b in blocks
                     if b.block_hash is not None and not self.disk.contains(b.block_hash, b.token_ids))

    def forget(self, request_id: str) -> None:
        """The request is finished or aborted; blocks still being read for it are installed all the same."""
        self._waiting_on.pop(request_id, None)
        self._tried_disk.discard(request_id)


__all__ = ["CompletedRead", "KVTiers", "TierCounters"]
