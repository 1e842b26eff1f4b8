"""BlockPool: refcounts, free lists, eviction order and the verified hash index (no torch, no model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_pool import BlockPool, hash_block


def _cache_and_free(
    pool: BlockPool, block_id: int, tokens: tuple[int, ...], parent: bytes | None = None
) -> bytes:
    """Register an allocated block under the hash of ``tokens`` and release it into the cached free list."""
    block_hash = hash_block(parent, tokens)
    pool.cache(block_id, block_hash, tokens)
    pool.decref(block_id)
    return block_hash


def _check(pool: BlockPool) -> None:
    free = pool.free_block_ids()
    held = {b.block_id for b in pool.blocks if b.ref_count > 0}
    assert free | held == set(range(pool.num_blocks))
    assert not free & held
    assert pool.num_free == len(free)


def test_import_does_not_pull_torch() -> None:
    code = "import sys, engine.block_pool; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_all_then_exhausted() -> None:
    pool = BlockPool(3)
    ids = {pool.allocate().block_id for _ in range(3)}
    assert ids == {0, 1, 2}
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    _check(pool)


def test_refcount_and_double_free() -> None:
    pool = BlockPool(2)
    block = pool.allocate()
    pool.incref(block.block_id)
    assert block.ref_count == 2
    pool.decref(block.block_id)
    assert pool.num_free == 1  # still held once
    pool.decref(block.block_id)
    assert pool.num_free == 2
    with pytest.raises(RuntimeError):
        pool.decref(block.block_id)
    _check(pool)


def test_uncached_free_blocks_are_taken_before_cached_ones() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate().block_id, pool.allocate().block_id
    h = _cache_and_free(pool, a, (1, 2))
    pool.decref(b)  # uncached
    assert pool.num_cached_free == 1
    taken = [pool.allocate().block_id for _ in range(3)]
    assert a not in taken, "a cached block was evicted while uncached ones were free"
    assert pool.lookup(h, (1, 2)) == a
    assert pool.allocate().block_id == a  # only now is it evicted
    assert pool.lookup(h, (1, 2)) is None
    assert not pool.is_cached(a)
    _check(pool)


def test_cached_blocks_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    ids = [pool.allocate().block_id for _ in range(3)]
    hashes = {}
    for block_id in (ids[2], ids[0], ids[1]):  # free order defines recency
        hashes[block_id] = _cache_and_free(pool, block_id, (block_id, 7))
    # Re-using ids[2] through a hit and freeing it again makes it the most recent.
    assert pool.lookup(hashes[ids[2]], (ids[2], 7)) == ids[2]
    pool.incref(ids[2])
    pool.decref(ids[2])
    order = [pool.allocate().block_id for _ in range(3)]
    assert order == [ids[0], ids[1], ids[2]]
    assert all(pool.lookup(h, (b, 7)) is None for b, h in hashes.items())
    _check(pool)


def test_a_sequence_takes_a_block_next_to_its_last_where_one_is_free() -> None:
    pool = BlockPool(9)
    ids = [pool.allocate().block_id for _ in range(9)]
    for block_id in (5, 2, 8, 0, 3):  # uncached, freed out of order: the free list is 5, 2, 8, 0, 3
        pool.decref(block_id)
    assert pool.allocate(after=1).block_id == 2  # above its last block, ahead of 5 in the free list
    assert pool.allocate(after=4).block_id == 5  # above before below (3)
    assert pool.allocate(after=4).block_id == 3  # 5 is taken now: below
    assert pool.allocate(after=6).block_id == 8  # 7 and 5 held: the free list's first
    assert pool.allocate(after=None).block_id == 0
    assert pool.num_free == 0 and ids == list(range(9))
    _check(pool)


def test_a_cached_block_next_to_the_last_is_taken_only_when_cold() -> None:
    pool = BlockPool(9)
    pool.evictions = []
    for _ in range(9):
        pool.allocate()
    hashes = {b: _cache_and_free(pool, b, (b, 7)) for b in (2, 7, 6)}  # least recently freed first
    # 6 (above 5; 4 below it is held) was freed last: a prefix likely to come back, so it is not evicted out
    # of turn; the least recently freed block is.
    assert pool.allocate(after=5).block_id == 2
    assert pool.lookup(hashes[6], (6, 7)) == 6
    # 7 is the older half of what is left (7, 6): cold, taken next to block 8 and its eviction recorded.
    assert pool.allocate(after=8).block_id == 7
    assert pool.lookup(hashes[7], (7, 7)) is None
    assert pool.evictions == [(2, hashes[2], (2, 7)), (7, hashes[7], (7, 7))]
    assert pool.cached_block_ids() == [6]
    _check(pool)


def test_a_cached_block_is_never_taken_out_of_turn_while_uncached_ones_are_free() -> None:
    pool = BlockPool(4)
    for _ in range(4):
        pool.allocate()
    h = _cache_and_free(pool, 1, (1, 7))
    pool.decref(3)  # uncached
    assert pool.allocate(after=0).block_id == 3  # 1 is cold and next to 0, but evicting it would lose a hit
    assert pool.lookup(h, (1, 7)) == 1
    _check(pool)


def test_cached_block_ids_lists_free_ones_in_eviction_order_then_those_in_use() -> None:
    pool = BlockPool(4)
    ids = [pool.allocate().block_id for _ in range(4)]
    for block_id in (ids[2], ids[0]):
        _cache_and_free(pool, block_id, (block_id, 7))
    pool.cache(ids[3], hash_block(None, (ids[3], 7)), (ids[3], 7))  # cached and still held
    assert pool.cached_block_ids() == [ids[2], ids[0], ids[3]]  # ids[1]: held, never cached
    assert pool.allocate().block_id == ids[2]
    assert pool.cached_block_ids() == [ids[0], ids[3]]


def test_hit_takes_a_cached_block_off_the_free_list() -> None:
    pool = BlockPool(2)
    a = pool.allocate().block_id
    h = _cache_and_free(pool, a, (5,))
    hit = pool.lookup(h, (5,))
    assert hit == a
    pool.incref(a)
    assert pool.num_free == 1 and a not in pool.free_block_ids()
    # With the cached block held, allocation must not hand it out.
    assert pool.allocate().block_id != a
    _check(pool)


def test_lookup_verifies_tokens_not_only_the_digest() -> None:
    pool = BlockPool(2)
    a = pool.allocate().block_id
    forged = b"\x01" * 16  # pretend two different blocks collided on this digest
    pool.cache(a, forged, (1, 2, 3))
    assert pool.lookup(forged, (1, 2, 3)) == a
    assert pool.lookup(forged, (1, 2, 4)) is None


def test_chained_hash_depends_on_parent_and_extra_key() -> None:
    tokens = (4, 5, 6)
    root = hash_block(None, tokens)
    assert hash_block(None, tokens) == root
    assert hash_block(hash_block(None, (1, 2, 3)), tokens) != root
    assert hash_block(None, tokens, b"lora-1") != root
    assert hash_block(None, (4, 5, 7)) != root


def test_first_registration_wins_and_caching_can_be_disabled() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate().block_id, pool.allocate().block_id
    h = hash_block(None, (9,))
    pool.cache(a, h, (9,))
    pool.cache(b, h, (9,))
    assert pool.lookup(h, (9,)) == a and not pool.is_cached(b)
    off = BlockPool(2, enable_caching=False)
    c = off.allocate().block_id
    off.cache(c, h, (9,))
    assert off.lookup(h, (9,)) is None
    off.decref(c)
    assert off.num_cached_free == 0 and off.num_free == 2


def test_a_salt_changes_the_hash_and_no_salt_keeps_it() -> None:
    tokens = (4, 5, 6)
    assert hash_block(None, tokens, b"", b"") == hash_block(None, tokens)  # unsalted: as it always hashed
    salted = hash_block(None, tokens, b"", b"tenant-a")
    assert salted not in (hash_block(None, tokens), hash_block(None, tokens, b"", b"tenant-b"))
    # The salt goes in with its length: salt and extra key cannot pass for one another.
    assert hash_block(None, tokens, b"x", b"y") != hash_block(None, tokens, b"xy")
