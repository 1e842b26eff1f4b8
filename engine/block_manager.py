"""Block tables and the policies' questions about memory.

The block manager is accounting only: it answers "can allocate / cannot" and returns the
block copies a change needs as plans (lists of ``(src, dst)`` block ids) for the runner to
execute on tensors. It never fails halfway: a call that cannot be completed changes nothing.

A sequence's table lives on the device pool while it runs or waits to resume, and on the CPU
pool while its group is swapped out. Refcount of a block = number of tables (and pins) that
hold it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.block_pool import BlockPool, hash_block
from engine.request import CacheSalt, Sequence, SequenceGroup

BlockPlan = list[tuple[int, int]]


class BlockManager:
    def __init__(self, block_size: int, num_device_blocks: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, extra_key: bytes = b"") -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.device = BlockPool(num_device_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks, enable_caching=False)
        self._tables: dict[int, list[int]] = {}
        self._on_cpu: set[int] = set()
        # Tokens that have a slot in the table (what the KV of the sequence may cover).
        self._num_slots: dict[int, int] = {}
        # Hashes of the sequence's full blocks, in order; the chain for the next block's hash.
        self._hashes: dict[int, list[bytes]] = {}
        # Leading entries of each table unchanged since ``take_table_update`` last reported it: the runner
        # keeps its own copy of every table and is sent only what changed after them.
        self._reported: dict[int, int] = {}
        self._pins: dict[str, list[int]] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # -- inspection ---------------------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables.get(seq.seq_id, [])

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def take_table_update(self, seq: Sequence) -> tuple[int, tuple[int, ...]]:
        """``(start, blocks)``: the table's entries from ``start`` on, where it differs from (or extends) the
        table as last taken. Mostly blocks appended at the end; a copy-on-write replaces the last entry, a
        swap-in or a new table all of them."""
        table = self._tables[seq.seq_id]
        start = self._reported.get(seq.seq_id, 0)
        self._reported[seq.seq_id] = len(table)
        return start, tuple(table[start:])

    def _changed(self, seq_id: int, index: int) -> None:
        if self._reported.get(seq_id, 0) > index:
            self._reported[seq_id] = index

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def _block_hash(self, parent: bytes | None, tokens: list[int], salt: CacheSalt, index: int) -> bytes:
        return hash_block(parent, tokens, self.extra_key, salt.for_block(index, self.block_size))

    def _full_block_hashes(self, token_ids: list[int], limit_tokens: int,
                           salt: CacheSalt) -> Iterable[tuple[bytes, list[int]]]:
        parent: bytes | None = None
        bs = self.block_size
        for start in range(0, limit_tokens - bs + 1, bs):
            tokens = token_ids[start : start + bs]
            parent = self._block_hash(parent, tokens, salt, start // bs)
            yield parent, tokens

    def _cached_blocks(self, token_ids: list[int], limit_tokens: int, salt: CacheSalt) -> list[int]:
        """Device blocks whose cached tokens are the leading full blocks of ``token_ids[:limit_tokens]``."""
        hits: list[int] = []
        for block_hash, tokens in self._full_block_hashes(token_ids, limit_tokens, salt):
            block_id = self.device.lookup(block_hash, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Device blocks already holding this sequence's leading full blocks (no state change).

        At least one token is always left to compute, so the last position has logits to sample
        from; a prompt that is all hits gives back its last block to be recomputed privately
        rather than rewriting a shared one.
        """
        if not self.enable_prefix_caching:
            return []
        return self._cached_blocks(seq.token_ids, seq.num_tokens - 1, seq.cache_salt)

    def prefix_chain(self, seq: Sequence) -> list[tuple[bytes, tuple[int, ...]]]:
        """``(hash, tokens)`` of every full block ``lookup_prefix`` could hit, in order: the keys of the KV
        tiers under the pool (engine.kv_tiers) too."""
        return [(h, tuple(t)) for h, t in self._full_block_hashes(seq.token_ids, seq.num_tokens - 1, seq.cache_salt)]

    def history_chain(self, token_ids: list[int], salt: CacheSalt | None = None) -> list[tuple[bytes, tuple[int, ...]]]:
        """``(hash, tokens)`` of every full block of a conversation's history, which the next message's prompt
        (salted with ``salt``, as its request will be) extends: the keys a warm brings up the tiers
        (engine.kv_tiers) before that prompt arrives."""
        if not self.enable_prefix_caching:
            return []
        return [(h, tuple(t)) for h, t in self._full_block_hashes(token_ids, len(token_ids), salt or CacheSalt())]

    # -- allocation ---------------------------------------------------------------------------
    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int, reserve_tokens: int = 0) -> int:
        table = self._tables.get(seq.seq_id, [])
        end = max(seq.num_computed_tokens + num_new_tokens, reserve_tokens)
        return max(0, self._blocks_for(end) - len(table)) + int(self._needs_cow(seq, num_new_tokens))

    def _needs_cow(self, seq: Sequence, num_new_tokens: int) -> bool:
        table = self._tables.get(seq.seq_id)
        if not table or num_new_tokens == 0:
            return False
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(table) and self.device.blocks[table[idx]].ref_count > 1

    def can_allocate(self, requests: list[tuple[Sequence, int]], prefix_blocks: list[int] | None = None,
                     reserve_tokens: int = 0, watermark: int = 0) -> bool:
        """Whether every ``(seq, num_new_tokens)`` can get its slots at once, leaving ``watermark``
        blocks free.

        ``prefix_blocks`` are prefix-cache hits for a sequence without a table yet: the ones that
        are currently free (refcount 0) stop being free when taken.
        """
        needed = 0
        taken_free = 0
        writers: dict[int, int] = {}  # shared block -> how many of these requests write into it
        for seq, num_new in requests:
            if seq.seq_id not in self._tables and prefix_blocks:
                hit_tokens = len(prefix_blocks) * self.block_size
                end = max(hit_tokens + num_new, reserve_tokens)
                needed += max(0, self._blocks_for(end) - len(prefix_blocks))
                taken_free += sum(1 for b in prefix_blocks if self.device.blocks[b].ref_count == 0)
            else:
                needed += self._new_blocks_needed(seq, num_new, reserve_tokens)
                if self._needs_cow(seq, num_new):
                    block_id = self._tables[seq.seq_id][seq.num_computed_tokens // self.block_size]
                    writers[block_id] = writers.get(block_id, 0) + 1
        # Copies happen one writer at a time; once all other holders have copied, the last one
        # writes in place, so at most refcount - 1 writers of a block need a new one.
        needed -= sum(max(0, k - (self.device.blocks[b].ref_count - 1)) for b, k in writers.items())
        return needed + taken_free + watermark <= self.device.num_free

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None,
                       reserve_tokens: int = 0) -> BlockPlan:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens; returns copy-on-write copies.

        For a sequence without a table, ``prefix_blocks`` (from ``lookup_prefix``) are shared and
        ``seq.num_computed_tokens`` is set past them. Callers check ``can_allocate`` first.
        """
        if not self.can_allocate([(seq, num_new_tokens)], prefix_blocks, reserve_tokens):
            raise RuntimeError("allocate_slots without room; call can_allocate first")
        copies: BlockPlan = []
        if seq.seq_id not in self._tables:
            prefix_blocks = prefix_blocks or []
            for block_id in prefix_blocks:
                self.device.incref(block_id)
            self._tables[seq.seq_id] = list(prefix_blocks)
            self._reported[seq.seq_id] = 0
            hit_tokens = len(prefix_blocks) * self.block_size
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += hit_tokens
            seq.num_computed_tokens = hit_tokens
            self._num_slots[seq.seq_id] = hit_tokens
            self._hashes[seq.seq_id] = [h for h, _ in self._full_block_hashes(seq.token_ids, hit_tokens,
                                                                              seq.cache_salt)]
        table = self._tables[seq.seq_id]
        if self._needs_cow(seq, num_new_tokens):
            idx = seq.num_computed_tokens // self.block_size
            old = table[idx]
            new = self.device.allocate(after=table[idx - 1] if idx else None).block_id
            self.device.decref(old)
            table[idx] = new
            self._changed(seq.seq_id, idx)
            copies.append((old, new))
        end = seq.num_computed_tokens + num_new_tokens
        while len(table) < self._blocks_for(max(end, reserve_tokens)):
            table.append(self.device.allocate(after=table[-1] if table else None).block_id)
        self._num_slots[seq.seq_id] = max(self._num_slots[seq.seq_id], end)
        self._cache_full_blocks(seq, end)
        return copies

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that the scheduled tokens fill. Their KV is written in the same
        forward pass before any attention reads it, so a hit in the same step is safe."""
        hashes = self._hashes[seq.seq_id]
        table = self._tables[seq.seq_id]
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            block_hash = self._block_hash(hashes[-1] if hashes else None, tokens, seq.cache_salt, i)
            hashes.append(block_hash)
            self.device.cache(table[i], block_hash, tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (refcount + 1 each)."""
        table = list(self._tables[parent.seq_id])
        pool = self.cpu if parent.seq_id in self._on_cpu else self.device
        for block_id in table:
            pool.incref(block_id)
        self._tables[child.seq_id] = table
        self._reported[child.seq_id] = 0
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        self._num_slots[child.seq_id] = self._num_slots[parent.seq_id]
        if parent.seq_id in self._on_cpu:
            self._on_cpu.add(child.seq_id)

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq.seq_id, None)
        if table is None:
            return
        pool = self.cpu if seq.seq_id in self._on_cpu else self.device
        # Free the tail first so that, among equally old cached blocks, prefixes outlive suffixes.
        for block_id in reversed(table):
            pool.decref(block_id)
        self._on_cpu.discard(seq.seq_id)
        self._hashes.pop(seq.seq_id, None)
        self._num_slots.pop(seq.seq_id, None)
        self._reported.pop(seq.seq_id, None)

    def abandon(self, seq: Sequence) -> None:
        """Free a table allocated in this step whose scheduled tokens will not be computed after
        all. Its blocks past ``seq.num_computed_tokens`` were registered in the prefix cache when
        allocated but will never hold their KV, so they leave the cache first."""
        for block_id in self._tables.get(seq.seq_id, [])[seq.num_computed_tokens // self.block_size :]:
            self.device.uncache(block_id)
        self.free(seq)

    def free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.free(seq)

    # -- swapping -----------------------------------------------------------------------------
    def _group_blocks(self, group: SequenceGroup) -> Counter[int]:
        """How many of the group's tables hold each of its blocks (in first-seen order)."""
        return Counter(b for seq in group.seqs for b in self._tables.get(seq.seq_id, []))

    def resident_prefix_blocks(self, group: SequenceGroup) -> int:
        """Leading blocks of the group's table that a table or pin outside the group also holds: freeing the
        group keeps them on the device, cached, so a recompute finds them as prefix hits instead of redoing
        their tokens."""
        seqs = [s for s in group.seqs if s.seq_id in self._tables and s.seq_id not in self._on_cpu]
        if not seqs or not self.enable_prefix_caching:
            return 0
        inside = self._group_blocks(group)
        count = 0
        for block_id in self._tables[seqs[0].seq_id]:
            block = self.device.blocks[block_id]
            if block.ref_count <= inside[block_id] or not self.device.is_cached(block_id):
                break
            count += 1
        return count

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._group_blocks(group)) <= self.cpu.num_free

    def can_swap_in(self, group: SequenceGroup, headroom_per_seq: int = 1) -> bool:
        seqs = [s for s in group.seqs if s.seq_id in self._tables]
        return len(self._group_blocks(group)) + headroom_per_seq * len(seqs) <= self.device.num_free

    def swap_out(self, group: SequenceGroup) -> BlockPlan:
        """Move every block of the group to the CPU pool (shared blocks once). All or nothing."""
        if not self.can_swap_out(group):
            raise RuntimeError("swap_out without room; call can_swap_out first")
        return self._move(group, self.device, self.cpu, to_cpu=True)

    def swap_in(self, group: SequenceGroup) -> BlockPlan:
        if not self.can_swap_in(group, headroom_per_seq=0):
            raise RuntimeError("swap_in without room; call can_swap_in first")
        return self._move(group, self.cpu, self.device, to_cpu=False)

    def _move(self, group: SequenceGroup, src: BlockPool, dst: BlockPool, to_cpu: bool) -> BlockPlan:
        mapping: dict[int, int] = {}
        new: int | None = None
        for block_id, count in self._group_blocks(group).items():
            new = dst.allocate(after=new).block_id
            for _ in range(count - 1):
                dst.incref(new)
            mapping[block_id] = new
        for seq in group.seqs:
            table = self._tables.get(seq.seq_id)
            if table is None:
                continue
            for block_id in reversed(table):
                src.decref(block_id)
            self._tables[seq.seq_id] = [mapping[b] for b in table]
            self._changed(seq.seq_id, 0)
            if to_cpu:
                self._on_cpu.add(seq.seq_id)
            else:
                self._on_cpu.discard(seq.seq_id)
                # The swapped-in copies hold the same full blocks: make them findable again.
                for i, block_hash in enumerate(self._hashes[seq.seq_id]):
                    tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
                    self.device.cache(self._tables[seq.seq_id][i], block_hash, tokens)
        return list(mapping.items())

    # -- pinned prefixes ----------------------------------------------------------------------
    def pin(self, key: str, token_ids: list[int], salt: CacheSalt | None = None) -> int:
        """Hold the cached full blocks of ``token_ids`` (hashed with ``salt``, as the request that computed
        them was) so they are never evicted; returns the number of tokens pinned (the leading full blocks
        that are in the cache)."""
        self.unpin(key)
        blocks = self._cached_blocks(token_ids, len(token_ids), salt or CacheSalt())
        for block_id in blocks:
            self.device.incref(block_id)
        self._pins[key] = blocks
        return len(blocks) * self.block_size

    def unpin(self, key: str) -> None:
        for block_id in reversed(self._pins.pop(key, [])):
            self.device.decref(block_id)

    def pinned_blocks(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._pins.items()}

    # -- accounting ---------------------------------------------------------------------------
    def slot_usage(self) -> tuple[int, int]:
        """(device slots holding a token, device slots allocated), shared blocks counted once."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq_id, table in self._tables.items():
            if seq_id in self._on_cpu:
                continue
            n = self._num_slots[seq_id]
            for i, block_id in enumerate(table):
                fill = min(bs, max(0, n - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), fill)
        for blocks in self._pins.values():
            for block_id in blocks:
                filled[block_id] = bs
        return sum(filled.values()), len(filled) * bs

    def holders(self) -> tuple[dict[int, int], dict[int, int]]:
        """How many tables/pins hold each (device, cpu) block: the refcount invariant's oracle."""
        device: Counter[int] = Counter(b for blocks in self._pins.values() for b in blocks)
        cpu: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            (cpu if seq_id in self._on_cpu else device).update(table)
        return device, cpu

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts disagree with the tables or a block is lost."""
        device_holders, cpu_holders = self.holders()
        for pool, holders in ((self.device, device_holders), (self.cpu, cpu_holders)):
            free = pool.free_block_ids()
            for block in pool.blocks:
                held = holders.get(block.block_id, 0)
                assert block.ref_count == held, f"{block}: held by {held} tables"
                assert (block.ref_count == 0) == (block.block_id in free), f"{block}: free-list mismatch"
            assert pool.num_free == len(free), "a block is twice on the free lists"
