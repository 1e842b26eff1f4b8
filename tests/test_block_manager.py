"""BlockManager: exact block ids and refcounts in small scenarios, and random operation sequences
checked against an independent model of the tables and of the KV contents (no torch, no model)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.request import CacheSalt, SamplingParams, Sequence, SequenceGroup


def _group(tokens: list[int], request_id: str = "r", n: int = 1) -> SequenceGroup:
    return SequenceGroup(request_id, tokens, SamplingParams(n=n, max_tokens=64))


def _compute(bm: BlockManager, seq: Sequence, num_new: int | None = None, use_prefix: bool = True) -> list:
    """Allocate and mark computed the next ``num_new`` tokens (all uncomputed ones by default), as one
    engine step would; returns the copy-on-write plan."""
    prefix = bm.lookup_prefix(seq) if use_prefix and not bm.has_table(seq) else None
    if prefix:
        n = seq.num_tokens - len(prefix) * bm.block_size if num_new is None else num_new
    else:
        n = seq.num_uncomputed_tokens if num_new is None else num_new
    assert bm.can_allocate([(seq, n)], prefix)
    copies = bm.allocate_slots(seq, n, prefix)
    seq.num_computed_tokens += n
    bm.check_invariants()
    return copies


def _refs(bm: BlockManager, ids: list[int]) -> list[int]:
    return [bm.device.blocks[b].ref_count for b in ids]


def test_import_does_not_pull_torch() -> None:
    code = "import sys, engine.block_manager; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_table_follows_a_freed_run_of_blocks() -> None:
    # A freed table enters the free list last block first; the next table gets its blocks next to one
    # another, as the attention kernels read them fastest (engine.block_pool), here downwards.
    bm = BlockManager(block_size=4, num_device_blocks=8, enable_prefix_caching=False)
    a, b = _group(list(range(16)), "a").seqs[0], _group(list(range(100, 116)), "b").seqs[0]
    _compute(bm, a)
    _compute(bm, b)
    assert bm.block_table(a) == [0, 1, 2, 3] and bm.block_table(b) == [4, 5, 6, 7]
    bm.free(a)
    c = _group(list(range(200, 206)), "c").seqs[0]
    _compute(bm, c)
    assert bm.block_table(c) == [3, 2]  # 4, above 3, is b's
    for tok in range(300, 304):  # decodes into a third block: the one next to its last
        c.token_ids.append(tok)
        _compute(bm, c, 1)
    assert bm.block_table(c) == [3, 2, 1]


def test_shared_prompt_shares_block_ids() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8)
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    a, b = _group(prompt, "a").seqs[0], _group(prompt, "b").seqs[0]
    _compute(bm, a)
    table_a = bm.block_table(a)
    assert len(table_a) == 3
    assert bm.lookup_prefix(b) == table_a[:2]
    _compute(bm, b)
    table_b = bm.block_table(b)
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert b.num_computed_tokens == 9
    assert _refs(bm, table_a) == [2, 2, 1]
    assert bm.prefix_hit_tokens == 8 and bm.prefix_queried_tokens == 18
    assert bm.device.num_free == 4
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.device.num_free == 8


def test_fully_cached_prompt_leaves_a_token_to_compute() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8)
    prompt = list(range(8))  # exactly two full blocks
    a = _group(prompt, "a").seqs[0]
    _compute(bm, a)
    b = _group(prompt, "b").seqs[0]
    hits = bm.lookup_prefix(b)
    assert hits == bm.block_table(a)[:1], "the last block must be recomputed, not all hit"
    assert bm.can_allocate([(b, 4)], hits)
    bm.allocate_slots(b, 4, hits)
    assert b.num_computed_tokens == 4  # 4 tokens left to compute, the last has logits
    assert bm.block_table(b)[1] != bm.block_table(a)[1]
    bm.check_invariants()


def test_prefix_hit_requires_the_same_parent_chain() -> None:
    bm = BlockManager(block_size=2, num_device_blocks=16)
    x, y, z = [1, 2], [3, 4], [5, 6]
    first = _group(x + y + z + [0], "first").seqs[0]
    _compute(bm, first)
    # y sits at block 0 here but at block 1 in `first`: identical tokens, different chain.
    assert bm.lookup_prefix(_group(y + z + [0], "moved").seqs[0]) == []
    # Same first block, different second block: only the first is a hit, the chain stops there.
    t = bm.block_table(first)
    assert bm.lookup_prefix(_group(x + z + y + [0], "branch").seqs[0]) == t[:1]
    assert bm.lookup_prefix(_group(x + y + [9, 9], "deep").seqs[0]) == t[:2]


def test_prefix_hit_verifies_tokens_when_digests_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.block_manager as bm_module

    # A hash that collides for every block: the pool must still refuse blocks with other tokens.
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra=b"", salt=b"": b"\x00" * 16)
    bm = BlockManager(block_size=2, num_device_blocks=8)
    _compute(bm, _group([1, 2, 3], "a").seqs[0])
    assert bm.lookup_prefix(_group([7, 8, 3], "b").seqs[0]) == []


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(block_size=2, num_device_blocks=8, enable_prefix_caching=False)
    _compute(bm, _group([1, 2, 3, 4, 5], "a").seqs[0])
    assert bm.lookup_prefix(_group([1, 2, 3, 4, 5], "b").seqs[0]) == []


def test_copy_on_write_of_shared_partial_last_block() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8)
    parent = _group(list(range(6))).seqs[0]  # blocks: [full, 2 of 4]
    _compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    shared = list(bm.block_table(parent))
    assert bm.block_table(child) == shared and _refs(bm, shared) == [2, 2]
    bm.check_invariants()

    child.token_ids.append(100)
    copies = _compute(bm, child, 1)
    new_child_table = bm.block_table(child)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared[1] and dst == new_child_table[1] and dst not in shared
    assert new_child_table[0] == shared[0]
    assert bm.block_table(parent) == shared  # the shared block is untouched
    assert _refs(bm, shared) == [2, 1] and _refs(bm, [dst]) == [1]

    parent.token_ids.append(200)
    assert _compute(bm, parent, 1) == [], "the last holder writes in place"
    assert bm.block_table(parent) == shared
    # A block boundary never copies: both get fresh private blocks.
    for s, tok in ((child, 101), (parent, 201)):
        s.token_ids.append(tok)
        assert _compute(bm, s, 1) == []
    s_tok = [102, 103]
    for s, tok in zip((child, parent), s_tok, strict=True):
        s.token_ids.append(tok)
        assert _compute(bm, s, 1) == []
    assert len(bm.block_table(child)) == 3 and bm.block_table(child)[2] != bm.block_table(parent)[2]


def test_beam_step_forks_a_parent_twice_and_frees_a_dropped_beam_at_once() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=12)
    group = _group(list(range(6)), n=1)
    a = group.seqs[0]
    _compute(bm, a)
    b = a.fork(1)
    bm.fork(a, b)
    for seq, tok in ((a, 10), (b, 20)):  # two beams diverge inside the shared partial block
        seq.token_ids.append(tok)
        _compute(bm, seq, 1)
    prompt_block = bm.block_table(a)[0]
    assert bm.block_table(b)[0] == prompt_block and bm.block_table(a)[1] != bm.block_table(b)[1]
    # The step keeps two continuations of a and none of b: a forks, b is dropped.
    c = a.fork(2)
    bm.fork(a, c)
    b_private = bm.block_table(b)[1]
    free_before = bm.device.num_free
    bm.free(b)
    assert bm.device.num_free == free_before + 1 and bm.device.blocks[b_private].ref_count == 0
    assert _refs(bm, bm.block_table(a)) == [2, 2]
    copies = []
    for seq, tok in ((a, 11), (c, 12)):
        seq.token_ids.append(tok)
        copies += _compute(bm, seq, 1)
    # The first writer copies the shared partial block; the last holder (c) then writes into it in place.
    assert copies == [(bm.block_table(c)[1], bm.block_table(a)[1])]
    assert _refs(bm, [prompt_block]) == [2]
    bm.free(a)
    bm.free(c)
    assert bm.device.num_free == 12


def test_table_updates_report_only_what_changed() -> None:
    """What the runner is sent of a table: appended blocks, a copy-on-write's replacement, a whole new table
    after a fork or a swap-in, and nothing when nothing changed."""
    bm = BlockManager(block_size=4, num_device_blocks=12, num_cpu_blocks=12)
    group = _group(list(range(6)), n=2)
    parent = group.seqs[0]
    _compute(bm, parent)
    assert bm.take_table_update(parent) == (0, tuple(bm.block_table(parent)))
    assert bm.take_table_update(parent) == (2, ())
    parent.token_ids += [50, 51, 52]  # into a third block
    _compute(bm, parent)
    assert bm.take_table_update(parent) == (2, (bm.block_table(parent)[2],))
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    assert bm.take_table_update(child) == (0, tuple(bm.block_table(parent)))
    child.token_ids.append(60)
    assert len(_compute(bm, child, 1)) == 1  # the shared partial block is copied
    assert bm.take_table_update(child) == (2, (bm.block_table(child)[2],))
    bm.swap_out(group)
    bm.swap_in(group)
    assert bm.take_table_update(parent) == (0, tuple(bm.block_table(parent)))


def test_can_allocate_counts_the_copy() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=2)
    parent = _group([1, 2, 3, 4, 5]).seqs[0]
    _compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    for s in (parent, child):
        s.token_ids.append(9)
    assert bm.device.num_free == 0
    assert not bm.can_allocate([(child, 1)])  # a write into the shared block needs a copy
    with pytest.raises(RuntimeError):
        bm.allocate_slots(child, 1)
    bm.check_invariants()
    assert bm.block_table(child) == bm.block_table(parent)


def test_can_allocate_knows_the_last_holder_writes_in_place() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=4)
    parent = _group([1, 2, 3, 4, 5, 6]).seqs[0]
    _compute(bm, parent)
    seqs = [parent]
    for i in (1, 2):
        child = parent.fork(i)
        bm.fork(parent, child)
        seqs.append(child)
    for s in seqs:
        s.token_ids.append(9)
    # Three writers of a block shared three ways: two copies, the third writes in place.
    assert bm.device.num_free == 2
    requests = [(s, 1) for s in seqs]
    assert bm.can_allocate(requests)
    assert not bm.can_allocate(requests + [(_group([1]).seqs[0], 5)])
    copies = [c for s in seqs for c in bm.allocate_slots(s, 1)]
    assert len(copies) == 2 and bm.device.num_free == 0
    bm.check_invariants()


def test_pinned_prefix_is_never_evicted_and_is_shared() -> None:
    bm = BlockManager(block_size=2, num_device_blocks=6)
    persona = [7, 7, 8, 8]
    warm = _group(persona + [1], "warm").seqs[0]
    _compute(bm, warm)
    pinned_ids = bm.block_table(warm)[:2]
    assert bm.pin("p", persona) == 4
    assert bm.pinned_blocks() == {"p": pinned_ids}
    bm.free(warm)
    bm.check_invariants()
    assert _refs(bm, pinned_ids) == [1, 1]
    assert bm.device.num_free == 4
    # Fill the rest of the pool with unrelated work: the pinned blocks must survive.
    other = _group([1, 2, 3, 4, 5, 6, 7, 8], "other").seqs[0]
    _compute(bm, other)
    assert bm.device.num_free == 0 and set(pinned_ids).isdisjoint(bm.block_table(other))
    bm.free(other)
    # Every sequence that starts with the persona shares the pinned blocks.
    users = [_group(persona + [i, i + 1], f"u{i}").seqs[0] for i in range(2)]
    for u in users:
        assert bm.lookup_prefix(u) == pinned_ids
        _compute(bm, u)
        assert bm.block_table(u)[:2] == pinned_ids
    assert _refs(bm, pinned_ids) == [3, 3]
    for u in users:
        bm.free(u)
    bm.unpin("p")
    bm.check_invariants()
    assert bm.pinned_blocks() == {}
    # Back in the normal cache: free, still a hit, evictable.
    assert bm.device.num_free == 6 and bm.device.num_cached_free >= 2
    assert bm.lookup_prefix(_group(persona + [0], "again").seqs[0]) == pinned_ids
    _compute(bm, _group(list(range(100, 112)), "big").seqs[0])
    assert bm.lookup_prefix(_group(persona + [0], "gone").seqs[0]) == []


def test_pin_of_uncached_prefix_pins_nothing() -> None:
    bm = BlockManager(block_size=2, num_device_blocks=4)
    assert bm.pin("p", [1, 2, 3, 4]) == 0
    bm.unpin("p")
    bm.unpin("never-pinned")
    bm.check_invariants()
    assert bm.device.num_free == 4


def test_cached_blocks_evicted_lru_after_uncached() -> None:
    bm = BlockManager(block_size=2, num_device_blocks=6)
    old, new = _group([1, 1, 1], "old").seqs[0], _group([2, 2, 2], "new").seqs[0]
    _compute(bm, old)
    _compute(bm, new)
    old_full, new_full = bm.block_table(old)[0], bm.block_table(new)[0]
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    assert bm.device.num_cached_free == 2
    # Two uncached free blocks exist beyond the 2 partial ones just freed: 4 allocations evict nothing.
    filler = _group([5, 6, 7, 8, 9, 10, 11], "f").seqs[0]
    _compute(bm, filler, 7, use_prefix=False)
    assert old_full not in bm.block_table(filler) and new_full not in bm.block_table(filler)
    assert bm.lookup_prefix(_group([1, 1, 1], "x").seqs[0]) == [old_full]
    filler.token_ids.extend([12, 13])
    _compute(bm, filler, 2)  # one more block: the least recently freed cached block goes
    assert old_full in bm.block_table(filler)
    assert bm.lookup_prefix(_group([1, 1, 1], "y").seqs[0]) == []
    assert bm.lookup_prefix(_group([2, 2, 2], "z").seqs[0]) == [new_full]


def _group_with_shared_blocks(bm: BlockManager) -> SequenceGroup:
    group = _group([1, 2, 3, 4, 5, 6], "g", n=2)  # bs 4: [full, partial], then forked
    parent = group.seqs[0]
    _compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    child.token_ids.append(50)
    _compute(bm, child, 1)  # child now has a private copy of the partial block
    return group


def test_swap_out_and_in_keeps_sharing() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8, num_cpu_blocks=4)
    group = _group_with_shared_blocks(bm)
    parent, child = group.seqs
    before = {s.seq_id: list(bm.block_table(s)) for s in group.seqs}
    distinct = set(before[parent.seq_id]) | set(before[child.seq_id])
    assert len(distinct) == 3
    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    bm.check_invariants()
    assert sorted(src for src, _ in out) == sorted(distinct)
    assert len({dst for _, dst in out}) == 3
    moved = dict(out)
    for s in group.seqs:
        assert bm.block_table(s) == [moved[b] for b in before[s.seq_id]]
    shared_cpu = moved[before[parent.seq_id][0]]
    assert bm.cpu.blocks[shared_cpu].ref_count == 2
    assert bm.device.num_free == 8 and bm.cpu.num_free == 1
    # Reuse the whole device pool meanwhile, so the original cached copies are evicted.
    hog = _group(list(range(100, 132)), "hog").seqs[0]
    _compute(bm, hog)
    bm.free(hog)
    assert bm.lookup_prefix(_group([1, 2, 3, 4, 0], "p").seqs[0]) == []

    assert bm.can_swap_in(group)
    back = bm.swap_in(group)
    bm.check_invariants()
    assert sorted(src for src, _ in back) == sorted(moved.values())
    assert bm.cpu.num_free == 4 and bm.device.num_free == 5
    tables = [bm.block_table(s) for s in group.seqs]
    assert tables[0][0] == tables[1][0] and bm.device.blocks[tables[0][0]].ref_count == 2
    assert tables[0][1] != tables[1][1]
    # The swapped-in full block is a prefix-cache hit again.
    assert bm.lookup_prefix(_group([1, 2, 3, 4, 0], "q").seqs[0]) == [tables[0][0]]


def test_swap_out_without_room_changes_nothing() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8, num_cpu_blocks=2)
    group = _group_with_shared_blocks(bm)
    tables = [list(bm.block_table(s)) for s in group.seqs]
    refs = [b.ref_count for b in bm.device.blocks]
    assert not bm.can_swap_out(group)  # 3 distinct blocks, 2 CPU blocks
    with pytest.raises(RuntimeError):
        bm.swap_out(group)
    assert [list(bm.block_table(s)) for s in group.seqs] == tables
    assert [b.ref_count for b in bm.device.blocks] == refs
    assert bm.cpu.num_free == 2
    bm.check_invariants()


def test_swap_in_needs_headroom() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=4, num_cpu_blocks=4)
    group = _group_with_shared_blocks(bm)
    bm.swap_out(group)
    hog = _group(list(range(100, 104)), "hog").seqs[0]
    _compute(bm, hog, use_prefix=False)  # 3 device blocks left: enough for the blocks, not headroom
    assert bm.can_swap_in(group, headroom_per_seq=0)
    assert not bm.can_swap_in(group)


def test_max_len_reservation_allocates_up_front() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8)
    seq = _group([1, 2, 3]).seqs[0]
    assert bm.can_allocate([(seq, 3)], None, reserve_tokens=17)
    bm.allocate_slots(seq, 3, None, reserve_tokens=17)
    assert len(bm.block_table(seq)) == 5
    assert bm.slot_usage() == (3, 20)
    assert not bm.can_allocate([(_group([1]).seqs[0], 1)], None, reserve_tokens=13)


def test_slot_usage_counts_shared_blocks_once() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=8)
    parent = _group([1, 2, 3, 4, 5]).seqs[0]
    _compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.slot_usage() == (5, 8)
    child.token_ids.append(6)
    _compute(bm, child, 1)
    assert bm.slot_usage() == (4 + 1 + 2, 12)


# -- random operation sequences ---------------------------------------------------------------

FAMILIES = [[0] * 12, [1] * 12, [0, 1] * 6, [0] * 4 + [1] * 8]


@dataclass
class _Model:
    """What the test believes: each group's location, and the token each KV slot holds."""

    bm: BlockManager
    groups: list[tuple[SequenceGroup, str]] = field(default_factory=list)  # (group, "device" | "cpu")
    kv: dict[str, dict[tuple[int, int], tuple[int, ...]]] = field(
        default_factory=lambda: {"device": {}, "cpu": {}}
    )
    pins: dict[str, list[int]] = field(default_factory=dict)  # key -> pinned tokens

    def pool(self, where: str):  # type: ignore[no-untyped-def]
        return self.bm.device if where == "device" else self.bm.cpu

    def write(self, seq: Sequence, start: int, n: int) -> None:
        bs = self.bm.block_size
        table = self.bm.block_table(seq)
        for pos in range(start, start + n):
            # The KV at a position is a function of every token up to it, not of that token alone.
            self.kv["device"][(table[pos // bs], pos % bs)] = tuple(seq.token_ids[: pos + 1])

    def copy(self, plan: list[tuple[int, int]], src: str, dst: str) -> None:
        bs = self.bm.block_size
        for s, d in plan:
            for off in range(bs):
                if (s, off) in self.kv[src]:
                    self.kv[dst][(d, off)] = self.kv[src][(s, off)]
                else:
                    self.kv[dst].pop((d, off), None)

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants()
        expected: dict[str, dict[int, int]] = {"device": {}, "cpu": {}}
        bs = bm.block_size
        for group, where in self.groups:
            for seq in group.seqs:
                table = bm.block_table(seq)
                assert bm.has_table(seq) != seq.is_finished
                for block_id in table:
                    assert 0 <= block_id < self.pool(where).num_blocks
                    expected[where][block_id] = expected[where].get(block_id, 0) + 1
                if seq.is_finished:
                    continue
                # KV under the table is exactly this sequence's tokens.
                assert len(table) * bs >= seq.num_computed_tokens
                for pos in range(seq.num_computed_tokens):
                    got = self.kv[where].get((table[pos // bs], pos % bs))
                    assert got == tuple(seq.token_ids[: pos + 1]), f"{seq} pos {pos}: slot holds {got}"
        for key, blocks in bm.pinned_blocks().items():
            assert len(blocks) * bs <= len(self.pins[key])
            for i, block_id in enumerate(blocks):
                expected["device"][block_id] = expected["device"].get(block_id, 0) + 1
                for off in range(bs):
                    pos = i * bs + off
                    assert self.kv["device"].get((block_id, off)) == tuple(self.pins[key][: pos + 1])
        for where in ("device", "cpu"):
            pool = self.pool(where)
            free = pool.free_block_ids()
            referenced = {b for b, c in expected[where].items() if c > 0}
            assert free | referenced == set(range(pool.num_blocks)) and not free & referenced
            for block in pool.blocks:
                assert block.ref_count == expected[where].get(block.block_id, 0)


def _run_ops(bm: BlockManager, ops: list[tuple[int, int, int]]) -> None:
    m = _Model(bm)
    counter = 0
    for kind, a, b in ops:
        live = [(g, w) for g, w in m.groups if g.unfinished_seqs()]
        on_device = [g for g, w in live if w == "device"]
        on_cpu = [g for g, w in live if w == "cpu"]
        if kind == 0:  # add a request and compute (a chunk of) its prompt
            fam = FAMILIES[a % len(FAMILIES)]
            tokens = fam[: 1 + b % len(fam)]
            counter += 1
            group = _group(tokens, f"r{counter}", n=2)
            seq = group.seqs[0]
            prefix = bm.lookup_prefix(seq)
            n = min(seq.num_tokens - len(prefix) * bm.block_size, 1 + a % 8)
            if not bm.can_allocate([(seq, n)], prefix):
                continue
            assert bm.allocate_slots(seq, n, prefix) == []
            m.write(seq, seq.num_computed_tokens, n)
            seq.num_computed_tokens += n
            for _ in range(a % 3):  # most groups start out with shared blocks
                child = seq.fork(len(group.seqs))
                bm.fork(seq, child)
                group.seqs.append(child)
            m.groups.append((group, "device"))
        elif kind in (1, 2) and on_device:  # one step: every unfinished sequence of a group advances
            group = on_device[a % len(on_device)]
            requests = []
            for seq in group.unfinished_seqs():
                if seq.num_uncomputed_tokens == 0:
                    seq.token_ids.append(b % 2)
                requests.append((seq, min(seq.num_uncomputed_tokens, 1 + b % 3)))
            if not bm.can_allocate(requests):
                continue
            for seq, n in requests:
                start = seq.num_computed_tokens
                m.copy(bm.allocate_slots(seq, n), "device", "device")
                m.write(seq, start, n)
                seq.num_computed_tokens += n
        elif kind == 3 and on_device:  # fork
            group = on_device[a % len(on_device)]
            parent = group.unfinished_seqs()[0]
            if len(group.seqs) < 4:
                child = parent.fork(len(group.seqs))
                bm.fork(parent, child)
                group.seqs.append(child)
        elif kind == 4 and live:  # finish one sequence
            group, _ = live[a % len(live)]
            seq = group.unfinished_seqs()[b % len(group.unfinished_seqs())]
            seq.finish_reason = "stop"
            bm.free(seq)
        elif kind == 5 and live:  # abort a whole group
            group, _ = live[a % len(live)]
            for seq in group.unfinished_seqs():
                seq.finish_reason = "abort"
            bm.free_group(group)
        elif kind == 6 and on_device:  # swap out, or nothing at all when it does not fit
            group = on_device[a % len(on_device)]
            device_blocks = {blk for s in group.seqs for blk in bm.block_table(s)}
            if not bm.can_swap_out(group):
                refs = [blk.ref_count for blk in bm.device.blocks]
                with pytest.raises(RuntimeError):
                    bm.swap_out(group)
                assert [blk.ref_count for blk in bm.device.blocks] == refs
                continue
            plan = bm.swap_out(group)
            assert sorted(s for s, _ in plan) == sorted(device_blocks)
            assert len({d for _, d in plan}) == len(plan)
            m.copy(plan, "device", "cpu")
            m.groups = [(g, "cpu" if g is group else w) for g, w in m.groups]
            cpu_blocks = {blk for s in group.seqs for blk in bm.block_table(s)}
            assert cpu_blocks == {d for _, d in plan}
        elif kind == 7 and on_cpu:  # swap in
            group = on_cpu[a % len(on_cpu)]
            if not bm.can_swap_in(group, headroom_per_seq=0):
                continue
            plan = bm.swap_in(group)
            m.copy(plan, "cpu", "device")
            m.groups = [(g, "device" if g is group else w) for g, w in m.groups]
        elif kind == 9 and on_device:  # a beam step: parents drawn with repeats; forks, then drops
            group = on_device[a % len(on_device)]
            beams = group.unfinished_seqs()
            if any(s.num_uncomputed_tokens for s in beams) or len(beams) > 4:
                continue
            parents = [beams[(a + b * i) % len(beams)] for i in range(1 + b % len(beams))]
            nxt: list[Sequence] = []
            for parent in parents:  # the first continuation of a parent is the parent itself
                if parent not in nxt:
                    nxt.append(parent)
                    continue
                child = parent.fork(len(group.seqs))
                bm.fork(parent, child)
                group.seqs.append(child)
                nxt.append(child)
            for seq in beams:
                if seq in nxt:
                    continue
                private = [blk for blk in bm.block_table(seq) if bm.device.blocks[blk].ref_count == 1]
                free_before = bm.device.num_free
                bm.free(seq)
                group.seqs.remove(seq)
                assert bm.device.num_free == free_before + len(private), "a dropped beam keeps blocks"
                assert all(bm.device.blocks[blk].ref_count == 0 for blk in private)
            for i, seq in enumerate(nxt):
                seq.token_ids.append((b + i) % 2)
        elif kind == 8:  # pin / unpin a family prefix
            key = f"p{a % 2}"
            if b % 2:
                tokens = FAMILIES[b % len(FAMILIES)][: 2 + a % 8]
                bm.pin(key, tokens)
                m.pins[key] = tokens
            else:
                bm.unpin(key)
        m.check()
    for group, _ in m.groups:
        bm.free_group(group)
    for key in list(m.pins):
        bm.unpin(key)
    bm.check_invariants()
    assert bm.device.num_free == bm.device.num_blocks
    assert bm.cpu.num_free == bm.cpu.num_blocks


_ops = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 63), st.integers(0, 63)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_device=st.integers(4, 16),
    num_cpu=st.integers(0, 8),
    caching=st.booleans(),
    ops=_ops,
)
def test_random_operations_keep_invariants(
    block_size: int, num_device: int, num_cpu: int, caching: bool, ops: list[tuple[int, int, int]]
) -> None:
    _run_ops(BlockManager(block_size, num_device, num_cpu, enable_prefix_caching=caching), ops)


def _salted(tokens: list[int], salt: str | None, shared: int = 0, request_id: str = "r") -> Sequence:
    params = SamplingParams(max_tokens=8, cache_salt=salt, shared_prefix_tokens=shared)
    return SequenceGroup(request_id, tokens, params).seqs[0]


def test_a_cache_salt_hits_only_its_own_blocks() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=16)
    prompt = list(range(10, 23))  # 3 full blocks + 1 token
    _compute(bm, _salted(prompt, "tenant-a", request_id="a"))
    assert bm.lookup_prefix(_salted(prompt, "tenant-b")) == []
    assert bm.lookup_prefix(_salted(prompt, None)) == []
    assert len(bm.lookup_prefix(_salted(prompt, "tenant-a"))) == 3
    # Forks (n > 1) keep the salt: their blocks are found under it.
    seq = _salted(prompt, "tenant-a")
    assert seq.fork(1).cache_salt == seq.cache_salt


def test_blocks_wholly_inside_the_shared_prefix_are_shared_by_every_salt() -> None:
    """A shared persona's prompt (here 9 tokens) hashes without the salt up to its last full block; the block
    holding its last token and the requester's first ones is the requester's."""
    bm = BlockManager(block_size=4, num_device_blocks=16)
    persona = list(range(50, 59))
    bm.pin("persona:shared", persona)  # nothing computed yet: nothing pinned
    shared = _salted(persona + [1, 2, 3, 4, 5, 6, 7], "tenant-a", shared=len(persona), request_id="a")
    _compute(bm, shared)
    other = _salted(persona + [1, 2, 3, 4, 5, 6, 7], "tenant-b", shared=len(persona))
    assert bm.lookup_prefix(other) == bm.block_table(shared)[:2]
    # An unsalted persona prefill and pin find the same two blocks.
    assert bm.pin("persona:shared", persona) == 8
    assert bm.pinned_blocks()["persona:shared"] == bm.block_table(shared)[:2]
    # A salted pin (an owner's own persona) finds only blocks computed under its salt.
    assert bm.pin("persona:own", persona, CacheSalt(b"tenant-b")) == 0
    own = _salted(persona + [1, 2, 3], "tenant-b", request_id="b")
    _compute(bm, own)
    assert bm.pin("persona:own", persona, CacheSalt(b"tenant-b")) == 8
    assert bm.pinned_blocks()["persona:own"] == bm.block_table(own)[:2] != bm.block_table(shared)[:2]
    bm.check_invariants()


def test_shared_prefix_tokens_without_a_salt_change_nothing() -> None:
    bm = BlockManager(block_size=4, num_device_blocks=16)
    prompt = list(range(10, 23))
    _compute(bm, _salted(prompt, None, request_id="a"))
    assert len(bm.lookup_prefix(_salted(prompt, None, shared=4))) == 3
