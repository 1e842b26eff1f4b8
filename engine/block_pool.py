"""Physical KV blocks: reference counts, the free list and the prefix-cache index.

Plain Python (no torch): the pool only does accounting. A block is either free (refcount 0)
or referenced. Free blocks that hold a full, hashed block of tokens stay findable by hash
until the pool needs a fresh block and evicts the least recently freed of them.

Where a block lies in the pool decides how fast a decode step reads it: a sequence whose blocks follow
one another is read in long runs the hardware prefetchers follow, one whose blocks lie at random is read
slower (``benchmarks/kv_layout.py`` measures by how much). So a sequence's next block is one next to its
last where that one is free and holds nothing likely to be hit again (never cached, or in the older half
of the cached free blocks once no never-cached block is free); otherwise the free lists' order decides.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"",
               salt: bytes = b"") -> bytes:
    """Collision-resistant hash of a full block chained over its parent, so equal hashes mean
    equal prefixes (not just equal blocks). ``salt`` (a request's ``cache_salt``) goes in with its length, so
    no salt and tokens can pass for another's; an unsalted block hashes as it always has."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\x00" * 16)
    h.update(extra_key)
    if salt:
        h.update(b"salt" + len(salt).to_bytes(4, "big") + salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        # Kept with the hash so a hit is verified against the tokens, not only the digest.
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    """``num_blocks`` blocks with ids ``0..num_blocks-1``.

    Allocation takes never-cached free blocks first (lowest id first), and only then evicts
    cached free blocks in least-recently-freed order, so reusable prefixes live as long as possible.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Both free lists are ordered (first out first) and give up any member in O(1): a placement takes a
        # block next to a sequence's last one out of either.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # When each cached free block was freed, counted in frees: how old it is among the cached free ones.
        self._freed_at = [0] * num_blocks
        self._frees = 0
        self._hash_to_block: dict[bytes, int] = {}
        # Cached blocks that ``allocate`` evicted, as (block id, hash, tokens), when a lower tier wants to keep
        # their KV (engine.kv_tiers drains it); None: nobody does, and nothing is recorded.
        self.evictions: list[tuple[int, bytes, tuple[int, ...]]] | None = None

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._free_cached)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, after: int | None = None) -> Block:
        """A free block, referenced once. ``after``: the block it follows in a sequence's table; a block next to
        that one is taken where one is free and cold (see the module's docstring)."""
        nxt = self._next_to(after)
        if nxt is not None:
            block = self.blocks[nxt]
            if nxt in self._free_uncached:
                del self._free_uncached[nxt]
            else:
                del self._free_cached[nxt]
                self._record_eviction(block)
                self._evict(block)
        elif self._free_uncached:
            block = self.blocks[self._free_uncached.popitem(last=False)[0]]
        elif self._free_cached:
            block = self.blocks[self._free_cached.popitem(last=False)[0]]
            self._record_eviction(block)
            self._evict(block)
        else:
            raise RuntimeError("block pool exhausted; callers must check num_free first")
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def _next_to(self, after: int | None) -> int | None:
        """A block next to ``after`` (above it, else below: the attention kernels read a run either way) that is
        free and cold: never cached, or, when no never-cached block is free, ``_is_cold``. A freed table enters
        the free lists last block first, so a table that starts on one follows it downwards."""
        if after is None:
            return None
        for nxt in (after + 1, after - 1):
            if not 0 <= nxt < self.num_blocks or self.blocks[nxt].ref_count != 0:
                continue
            if nxt in self._free_uncached or (not self._free_uncached and self._is_cold(nxt)):
                return nxt
        return None

    def _is_cold(self, block_id: int) -> bool:
        """Freed before at least half of the cached free blocks (their order of eviction, give or take the ones
        taken out of it since): evicting it out of turn costs little."""
        return self._frees - self._freed_at[block_id] >= len(self._free_cached) // 2

    def _record_eviction(self, block: Block) -> None:
        if self.evictions is not None and block.block_hash is not None:
            self.evictions.append((block.block_id, block.block_hash, block.token_ids))

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # A free block taken back into use: normally a cached block found by a prefix hit.
            if block_id in self._free_cached:
                del self._free_cached[block_id]
            else:
                del self._free_uncached[block_id]
        block.ref_count += 1

    def decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._free_cached[block_id] = None
                self._frees += 1
                self._freed_at[block_id] = self._frees
            else:
                self._free_uncached[block_id] = None

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Make a full, referenced block findable. The first block registered for a hash wins."""
        if not self.enable_caching or block_hash in self._hash_to_block:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._hash_to_block[block_hash] = block_id

    def uncache(self, block_id: int) -> None:
        """Forget a block's hash: its KV will not be written after all, so it must never be a hit."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        self._evict(block)
        if block_id in self._free_cached:
            del self._free_cached[block_id]
            self._free_uncached[block_id] = None

    def make_coldest(self, block_id: int) -> None:
        """Put a free cached block first in line for eviction (a block older than every other one)."""
        if block_id in self._free_cached:
            self._free_cached.move_to_end(block_id, last=False)
            self._freed_at[block_id] = 0

    @property
    def num_free_uncached(self) -> int:
        """Free blocks that hold no cached block: allocating one evicts nothing."""
        return len(self._free_uncached)

    def is_cached(self, block_id: int) -> bool:
        return self.blocks[block_id].block_hash is not None

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()

    def cached_block_ids(self) -> list[int]:
        """Every block findable by its hash, least recently used first: the free ones in the order eviction
        would take them, then those in use."""
        in_use = [b.block_id for b in self.blocks if b.block_hash is not None and b.ref_count > 0]
        return [*self._free_cached, *in_use]

    def free_block_ids(self) -> set[int]:
        return set(self._free_uncached) | set(self._free_cached)
