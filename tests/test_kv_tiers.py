"""KV host and disk tiers: the accounting on its own, then the engine restoring returning conversations from
each tier (a tiny model, and the real one against transformers), across a restart, through bad files, under
pressure and aborts."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import hf_greedy, hf_reference  # noqa: F401
from tiny_model import make_tiny_model_dir

from engine.block_manager import BlockManager
from engine.engine import LLMEngine
from engine.kv_disk import SUFFIX
from engine.kv_tiers import KVTiers
from engine.llm import LLM
from engine.request import CacheSalt, SamplingParams, Sequence

# ---- the accounting ---------------------------------------------------------------------------------


def _evict_a_then_return(bm: BlockManager, tiers: KVTiers,
                         salt: CacheSalt | None = None) -> tuple[Sequence, list[tuple[int, int]]]:
    """Compute a 3-block prompt (under ``salt``), push it out of the 6-block pool with another prompt, and
    return (the returning sequence, the offloads of the first prompt's blocks)."""
    first = Sequence(list(range(100, 113)), 13, cache_salt=salt)
    tiers.begin_step()
    bm.allocate_slots(first, 13)
    bm.free(first)
    assert tiers.finish_plan().is_empty
    other = Sequence(list(range(200, 224)), 24)
    tiers.begin_step()
    bm.allocate_slots(other, 24)
    plan = tiers.finish_plan()
    bm.free(other)
    return Sequence(list(range(100, 116)), 16), list(plan.offload)


def test_evicted_blocks_are_offloaded_and_restored_as_prefix_hits() -> None:
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    again, offloads = _evict_a_then_return(bm, tiers)
    assert len(offloads) == 3  # the first prompt's three full blocks
    tiers.begin_step()
    tiers.restore(again)
    prefix = bm.lookup_prefix(again)
    assert len(prefix) == 3
    bm.allocate_slots(again, 4, prefix)
    tiers.release_admission()
    plan = tiers.finish_plan()
    # The pool evicts a freed prompt tail first; the loads follow the chain from its head.
    assert [host for host, _ in plan.load] == [host for _, host in reversed(offloads)]
    assert [device for _, device in plan.load] == prefix
    assert again.num_computed_tokens == 12 and tiers.counters.host_hit_blocks == 3
    # The plan's host blocks are held until the next plan: nothing in this step may reuse them.
    assert all(tiers.host.blocks[h].ref_count == 1 for h, _ in plan.load)
    tiers.begin_step()
    assert all(tiers.host.blocks[h].ref_count == 0 for h, _ in plan.load)
    bm.check_invariants()


def test_restore_needs_room_for_the_whole_sequence() -> None:
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    again, _ = _evict_a_then_return(bm, tiers)
    hog = Sequence(list(range(300, 312)), 12)
    bm.allocate_slots(hog, 12)  # 3 of the 6 blocks held: the 4 the returning sequence needs are not free
    tiers.begin_step()
    tiers.restore(again)
    assert bm.lookup_prefix(again) == []
    tiers.release_admission()
    assert tiers.finish_plan().load == ()
    bm.check_invariants()


def test_another_requests_cache_salt_never_hits_the_host_tier() -> None:
    """The host tier is keyed by the salted hash chain: a tenant's offloaded blocks come back for a request
    with its salt, never for another tenant's request with the same tokens (nor for an unsalted one)."""
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    _, offloads = _evict_a_then_return(bm, tiers, CacheSalt(b"tenant-a"))
    assert len(offloads) == 3
    for other in (CacheSalt(b"tenant-b"), CacheSalt()):
        again = Sequence(list(range(100, 116)), 16, cache_salt=other)
        tiers.begin_step()
        tiers.restore(again)
        assert bm.lookup_prefix(again) == []
        tiers.release_admission()
        assert tiers.finish_plan().load == () and tiers.counters.host_hit_blocks == 0
    own = Sequence(list(range(100, 116)), 16, cache_salt=CacheSalt(b"tenant-a"))
    tiers.begin_step()
    tiers.restore(own)
    assert len(bm.lookup_prefix(own)) == 3
    tiers.release_admission()
    tiers.finish_plan()
    assert tiers.counters.host_hit_blocks == 3


def test_host_evictions_spill_to_disk_only_once(tmp_path: Path) -> None:
    from engine.kv_disk import HEADER_ALLOWANCE, BlockFormat, DiskStore

    fmt = BlockFormat("m", "float32", 4, "layer,kv,head,token,dim", (1,), 4)
    disk = DiskStore(tmp_path, fmt, 100 * (fmt.payload_bytes + HEADER_ALLOWANCE))
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 2, disk)
    _, offloads = _evict_a_then_return(bm, tiers)
    assert len(offloads) == 2  # a 2-block host tier, all of it in this plan: the third block is lost
    tiers.begin_step()
    pusher = Sequence(list(range(400, 424)), 24)
    bm.allocate_slots(pusher, 24)  # evicts the other prompt's blocks, pushing the host tier's to disk
    plan = tiers.finish_plan()
    assert [host for host, _, _ in plan.spill] == sorted(host for _, host in offloads)
    for _, h, t in plan.spill:  # the engine hands their bytes over
        assert not disk.contains(h, t)
        disk.write(h, t, b"\0" * 4)
    disk.flush()
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    assert tiers.counters.disk_spilled_blocks == 2


# ---- the engine, tiny model -------------------------------------------------------------------------

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama")


def _conversations(n: int = 6, length: int = 61, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def _tiny(tiny_dir: Path, **kw: Any) -> LLM:
    return LLM(model=str(tiny_dir), num_kv_blocks=24, block_size=4, dtype="float32", **kw)


def _first_turns(llm: LLM, convs: list[list[int]]) -> list[list[int]]:
    """One turn of each conversation in turn: each pushes the ones before it out of the 24-block pool."""
    return [llm.generate(prompt_token_ids=[c], sampling_params=PARAMS)[0].outputs[0].token_ids for c in convs]


def _returning(convs: list[list[int]], replies: list[list[int]]) -> list[int]:
    return convs[0] + replies[0] + [5, 6, 7]


@pytest.fixture(scope="module")
def recomputed(tiny_dir: Path) -> tuple[list[list[int]], list[int]]:
    """Without tiers: the first turns' replies and the returning turn's, all recomputed."""
    llm = _tiny(tiny_dir)
    convs = _conversations()
    replies = _first_turns(llm, convs)
    back = llm.generate(prompt_token_ids=[_returning(convs, replies)], sampling_params=PARAMS)[0]
    assert back.num_cached_tokens == 0  # the pool really forgot it
    return replies, back.outputs[0].token_ids


def _return(llm: LLM, convs: list[list[int]], replies: list[list[int]]) -> tuple[list[int], int]:
    back = llm.generate(prompt_token_ids=[_returning(convs, replies)], sampling_params=PARAMS)[0]
    llm.engine.block_manager.check_invariants()
    return back.outputs[0].token_ids, back.num_cached_tokens


def test_host_tier_restores_a_returning_conversation(tiny_dir: Path, recomputed: Any) -> None:
    llm = _tiny(tiny_dir, kv_host_bytes=1 << 20)
    convs = _conversations()
    assert _first_turns(llm, convs) == recomputed[0]
    tokens, cached = _return(llm, convs, recomputed[0])
    assert tokens == recomputed[1]
    assert cached == 68  # every full block of the 72-token prompt but the one holding its last token
    stats = llm.stats()
    assert stats.kv_host_hit_blocks == 17 and stats.kv_host_offloaded_blocks > 0 and stats.kv_disk_blocks == 0


def _disk_llm(tiny_dir: Path, disk_dir: Path, **kw: Any) -> LLM:
    # 40 host blocks: a conversation's 17 blocks fit in the half a disk read may fill; 6 conversations do not.
    return _tiny(tiny_dir, kv_host_bytes=40 * 2048, kv_disk_dir=str(disk_dir), kv_disk_bytes=1 << 24, **kw)


def test_disk_tier_restores_what_the_host_tier_pushed_out(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    llm = _disk_llm(tiny_dir, tmp_path)
    assert llm.engine.block_bytes == 2048
    convs = _conversations()
    assert _first_turns(llm, convs) == recomputed[0]
    tokens, cached = _return(llm, convs, recomputed[0])
    assert tokens == recomputed[1] and cached == 68
    stats = llm.stats()
    assert stats.kv_disk_hit_blocks == 17 and stats.kv_disk_spilled_blocks > 0 and stats.kv_disk_load_seconds > 0
    assert stats.kv_disk_failed_loads == 0


def _after_restart(tiny_dir: Path, disk_dir: Path, model_dir: Path | None = None
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """Run the first turns on an engine with a disk tier and shut it down (its host tier and its pool's
    cached blocks go to disk)."""
    llm = _disk_llm(model_dir or tiny_dir, disk_dir)
    convs = _conversations()
    replies = _first_turns(llm, convs)
    llm.engine.close()
    return convs, replies


def test_restart_restores_from_the_disk_tier(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    convs, replies = _after_restart(tiny_dir, tmp_path)
    files = len(list(tmp_path.glob(f"*{SUFFIX}")))
    assert files == 6 * 17  # every full block: the evicted ones, the host tier's and those the pool held
    llm = _disk_llm(tiny_dir, tmp_path)
    assert llm.stats().kv_disk_blocks == files
    tokens, cached = _return(llm, convs, replies)
    assert tokens == recomputed[1] and cached == 68
    assert llm.stats().kv_disk_hit_blocks == 17


def test_restart_restores_the_conversation_the_pool_held(tiny_dir: Path, tmp_path: Path) -> None:
    """The last conversation before a shutdown was still in the device pool, never evicted down a tier:
    closing the engine writes it too, so it is the first to come back after the restart."""
    convs, replies = _after_restart(tiny_dir, tmp_path)
    last = convs[-1] + replies[-1] + [5, 6, 7]
    expected = _tiny(tiny_dir).generate(prompt_token_ids=[last], sampling_params=PARAMS)[0].outputs[0].token_ids
    llm = _disk_llm(tiny_dir, tmp_path)
    back = llm.generate(prompt_token_ids=[last], sampling_params=PARAMS)[0]
    llm.engine.block_manager.check_invariants()
    assert back.outputs[0].token_ids == expected and back.num_cached_tokens == 68
    assert llm.stats().kv_disk_hit_blocks == 17


def test_corrupt_files_are_recomputed_never_served(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    convs, replies = _after_restart(tiny_dir, tmp_path)
    for path in tmp_path.glob(f"*{SUFFIX}"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01  # one bit of the KV payload: only the checksum can tell
        path.write_bytes(bytes(data))
    llm = _disk_llm(tiny_dir, tmp_path)
    tokens, cached = _return(llm, convs, replies)
    assert tokens == recomputed[1] and cached == 0
    stats = llm.stats()
    assert stats.kv_disk_failed_loads > 0 and stats.kv_disk_hit_blocks == 0 and stats.kv_disk_dropped_files > 0


def test_truncated_files_are_dropped_at_start_up(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    convs, replies = _after_restart(tiny_dir, tmp_path)
    paths = list(tmp_path.glob(f"*{SUFFIX}"))
    for path in paths:
        path.write_bytes(path.read_bytes()[:-7])
    llm = _disk_llm(tiny_dir, tmp_path)
    assert llm.stats().kv_disk_dropped_files == len(paths) and not list(tmp_path.glob(f"*{SUFFIX}"))
    tokens, cached = _return(llm, convs, replies)
    assert tokens == recomputed[1] and cached == 0


def test_another_models_files_are_dropped(tiny_dir: Path, tmp_path: Path, recomputed: Any,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    other = make_tiny_model_dir(tmp_path_factory.mktemp("other"), arch="llama", seed=1)
    _after_restart(tiny_dir, tmp_path, model_dir=other)
    assert list(tmp_path.glob(f"*{SUFFIX}"))
    llm = _disk_llm(tiny_dir, tmp_path)
    assert llm.stats().kv_disk_blocks == 0 and llm.stats().kv_disk_dropped_files > 0
    convs = _conversations()
    assert _first_turns(llm, convs) == recomputed[0]


def test_abort_while_loading_frees_everything(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    convs, replies = _after_restart(tiny_dir, tmp_path)
    engine = _disk_llm(tiny_dir, tmp_path).engine
    group = engine.add_request("back", PARAMS, prompt_token_ids=_returning(convs, replies))
    engine.step()
    assert engine.scheduler.loading == [group]  # set aside while the reader thread reads its blocks
    engine.abort_request("back")
    # No request is left; the engine still steps until the reads in flight are installed (engine.has_unfinished).
    assert not engine.scheduler.has_unfinished()
    assert engine.tiers is not None
    while engine.tiers.reading:
        engine.step()
    engine.block_manager.check_invariants()
    assert engine.block_manager.device.num_free == engine.block_manager.device.num_blocks
    assert all(b.ref_count == 0 for b in engine.tiers.host.blocks)
    assert not engine.tiers._waiting_on


def test_others_pass_a_loading_request_and_evict_under_pressure(tiny_dir: Path, tmp_path: Path,
                                                                 recomputed: Any) -> None:
    convs, replies = _after_restart(tiny_dir, tmp_path)
    newcomers = _conversations(n=4, seed=7)
    reference = _first_turns(_tiny(tiny_dir), newcomers)
    engine = _disk_llm(tiny_dir, tmp_path).engine
    back = engine.add_request("back", PARAMS, prompt_token_ids=_returning(convs, replies))
    others = [engine.add_request(f"new-{i}", PARAMS, prompt_token_ids=c) for i, c in enumerate(newcomers)]
    engine.step()
    assert engine.scheduler.loading == [back] and engine.scheduler.running  # the newcomers went first
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_invariants()
    assert back.seqs[0].output_token_ids == recomputed[1]
    assert [g.seqs[0].output_token_ids for g in others] == reference
    stats = engine.stats()
    assert stats.kv_host_offloaded_blocks > 0 and stats.kv_disk_hit_blocks > 0


def test_disk_full_falls_back_to_recompute(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    """Every write fails (the directory is replaced by a file after start-up, so the real open() raises):
    the engine keeps serving, and the returning turn is recomputed where the host tier lacks its blocks."""
    llm = _disk_llm(tiny_dir, tmp_path / "kv")
    (tmp_path / "kv").rmdir()
    (tmp_path / "kv").write_bytes(b"")
    convs = _conversations()
    assert _first_turns(llm, convs) == recomputed[0]
    tokens, _ = _return(llm, convs, recomputed[0])
    assert tokens == recomputed[1]
    assert llm.engine.tiers is not None and llm.engine.tiers.disk is not None
    llm.engine.tiers.disk.flush()  # the last step's writes may still be failing on the writer thread
    stats = llm.stats()
    assert stats.kv_disk_write_failures > 0 and stats.kv_disk_blocks == 0


def test_tiers_are_off_by_default_and_checked(tiny_dir: Path) -> None:
    assert _tiny(tiny_dir).engine.tiers is None
    with pytest.raises(ValueError, match="kv_disk_dir"):
        _tiny(tiny_dir, kv_host_bytes=1 << 20, kv_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_host_bytes"):
        _tiny(tiny_dir, kv_disk_dir="/tmp/x", kv_disk_bytes=1 << 20)


# ---- warm on intent ----------------------------------------------------------------------------------


def test_warm_loads_host_blocks_into_free_device_blocks() -> None:
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    again, offloads = _evict_a_then_return(bm, tiers)
    tiers.begin_step()
    plan = tiers.warm("s1", bm.history_chain(again.token_ids[:12]))
    # Half of the 6 free blocks at most: all three of the history's, from its head.
    assert len(plan.load) == 3 and [h for h, _ in plan.load] == [h for _, h in reversed(offloads)]
    assert plan.offload  # the cached blocks it evicted went to the host tier first, in the same plan
    assert bm.lookup_prefix(again) == [d for _, d in plan.load]  # prefix hits now, on the device
    assert bm.device.num_free == 6 and tiers.counters.warm_loaded_blocks == 3
    bm.check_invariants()


def test_warm_under_another_salt_finds_nothing() -> None:
    from engine.request import CacheSalt

    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    again, _ = _evict_a_then_return(bm, tiers)
    tiers.begin_step()
    plan = tiers.warm("s1", bm.history_chain(again.token_ids[:12], CacheSalt(b"another tenant")))
    assert plan.load == () and tiers.counters.warm_loaded_blocks == 0


def test_warm_never_takes_blocks_in_use() -> None:
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8)
    again, _ = _evict_a_then_return(bm, tiers)
    running = Sequence(list(range(300, 320)), 20)
    tiers.begin_step()
    bm.allocate_slots(running, 20)  # five of the six blocks
    tiers.finish_plan()
    tiers.begin_step()
    plan = tiers.warm("s1", bm.history_chain(again.token_ids[:12]))
    assert plan.load == () and bm.block_table(running) and bm.device.num_free == 1
    bm.free(running)


def test_warm_reads_disk_once_per_session(tmp_path: Path) -> None:
    from engine.kv_disk import BlockFormat, DiskStore

    fmt = BlockFormat(model="m", dtype="float32", block_size=4, layout="x", shape=(4,), payload_bytes=4)
    disk = DiskStore(tmp_path, fmt, 1 << 20)
    bm = BlockManager(4, 6, extra_key=b"model")
    tiers = KVTiers(bm, 8, disk)
    chain = bm.history_chain(list(range(500, 512)))
    for block_hash, tokens in chain:
        disk.write(block_hash, tokens, b"\x01\x02\x03\x04")
    disk.flush()
    assert tiers.warm("s1", chain).is_empty and tiers.warm_reads("s1")
    assert tiers.counters.warm_read_blocks == 3
    tiers.warm("s1", chain)  # while its reads are in flight: nothing more
    assert tiers.counters.warm_read_blocks == 3
    for read in tiers.reads_in_flight():
        read.result(timeout=10)
    assert all(c.payload == b"\x01\x02\x03\x04" for c in tiers.take_completed_reads())


def test_a_warmed_session_restores_from_the_host_tier(tiny_dir: Path, tmp_path: Path, recomputed: Any) -> None:
    """A conversation the host tier pushed to disk, warmed before its next message: the message finds its
    blocks in the host tier (no disk wait), and its tokens are a recompute's."""
    llm = _disk_llm(tiny_dir, tmp_path)
    convs = _conversations()
    assert _first_turns(llm, convs) == recomputed[0]
    engine = llm.engine
    history = convs[0] + recomputed[0][0]
    assert engine.warm_prefix("s0", history) > 0
    assert engine.stats().kv_warm_read_blocks > 0
    while engine.has_unfinished():  # the engine loop while the user types: it installs the reads
        engine.step()
    read = engine.stats().kv_disk_hit_blocks
    assert read == engine.stats().kv_warm_read_blocks
    tokens, cached = _return(llm, convs, recomputed[0])
    assert tokens == recomputed[1] and cached == 68
    stats = llm.stats()
    assert stats.kv_disk_hit_blocks == read  # nothing more from disk: the message came from the host tier
    assert stats.kv_host_hit_blocks >= read


# ---- the real model --------------------------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The real model's engines run on one thread (``engine_threads=1``), and so does the reference after them:
    on a machine shared with other work, torch's OpenMP threads wait on each other at every small matmul and
    these tests run several times slower on two threads than on one. The process's setting is restored."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


REAL_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _real_turn(e: LLMEngine, ids: list[int], rid: str) -> tuple[list[int], int]:
    """One turn through the engine to its end: its greedy tokens and how many prompt tokens were cached."""
    group = e.add_request(rid, REAL_PARAMS, prompt_token_ids=ids)
    while e.has_unfinished():
        e.step()
    e.block_manager.check_invariants()
    return group.seqs[0].output_token_ids, group.num_cached_tokens


@pytest.mark.integration
@pytest.mark.slow
def test_real_model_restores_match_transformers(tmp_path: Path, hf_greedy: Callable[[list[int], int], list[int]],  # noqa: F811
                                                one_thread: None) -> None:
    """SmolLM2 in float32: a returning conversation restored from the host tier, from the disk tier, and
    after a restart gives transformers' greedy tokens (a recompute's)."""
    rng = random.Random(1)
    convs = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(5)]

    def engine(**kw: Any) -> LLMEngine:
        return LLM(dtype="float32", num_kv_blocks=30, block_size=16, engine_threads=1, **kw).engine

    block_bytes = 737280  # SmolLM2-135M, float32: 30 layers x K,V x 16 tokens x 3 heads x 64
    host = engine(kv_host_bytes=40 * block_bytes)
    # 24 host blocks: the 12 a disk read needs fit in the half it may fill; 5 conversations' 65 do not.
    disk = engine(kv_host_bytes=24 * block_bytes, kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 30)
    for e, tier in ((host, "host"), (disk, "disk")):
        replies = [_real_turn(e, c, f"{tier}-{i}")[0] for i, c in enumerate(convs)]
        assert replies[0] == hf_greedy(convs[0], 6)
        back = convs[0] + replies[0] + [504, 1234, 28]
        tokens, cached = _real_turn(e, back, f"{tier}-back")
        assert cached == 192  # the 12 full blocks of the first prompt
        assert tokens == hf_greedy(back, 6)
        stats = e.stats()
        assert stats.kv_host_hit_blocks >= 12  # the disk tier's blocks come back through the host tier too
        assert (stats.kv_disk_hit_blocks > 0) == (tier == "disk")
    disk.close()
    restarted = engine(kv_host_bytes=24 * block_bytes, kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 30)
    back = convs[1] + hf_greedy(convs[1], 6) + [504, 1234, 28]
    tokens, cached = _real_turn(restarted, back, "after-restart")
    assert cached == 192 and tokens == hf_greedy(back, 6)


@pytest.mark.integration
@pytest.mark.slow
def test_real_model_warmed_session_matches_transformers(tmp_path: Path,
                                                        hf_greedy: Callable[[list[int], int], list[int]],  # noqa: F811
                                                        one_thread: None) -> None:
    """SmolLM2 in float32: a conversation pushed to the disk tier and warmed before its next message is
    restored from the host tier and gives transformers' greedy tokens."""
    rng = random.Random(2)
    convs = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(5)]
    block_bytes = 737280  # SmolLM2-135M, float32
    engine = LLM(dtype="float32", num_kv_blocks=30, block_size=16, kv_host_bytes=24 * block_bytes,
                 kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 30, engine_threads=1).engine

    replies = [_real_turn(engine, c, f"first-{i}")[0] for i, c in enumerate(convs)]
    assert engine.warm_prefix("s0", convs[0] + replies[0]) > 0
    while engine.has_unfinished():
        engine.step()
    read = engine.stats().kv_disk_hit_blocks
    assert read > 0
    back = convs[0] + replies[0] + [504, 1234, 28]
    tokens, cached = _real_turn(engine, back, "back")
    assert cached == 192 and tokens == hf_greedy(back, 6)
    stats = engine.stats()
    # Read from disk by the warm only; the rest of the 12 came into the pool by the warm or the admission.
    assert stats.kv_disk_hit_blocks == read and stats.kv_host_hit_blocks >= read
    assert stats.kv_host_hit_blocks + stats.kv_warm_loaded_blocks >= 12


# ---- the start-up preload ----------------------------------------------------------------------------


def _preload(engine: LLMEngine) -> None:
    while engine.has_background_work():
        engine.step()


def test_preload_fills_the_host_tier_newest_first_within_its_cap(tiny_dir: Path, tmp_path: Path) -> None:
    _after_restart(tiny_dir, tmp_path)  # 102 blocks on disk; the host tier holds 40
    llm = _disk_llm(tiny_dir, tmp_path)
    engine = llm.engine
    assert engine.tiers is not None and engine.tiers.disk is not None
    newest = list(engine.tiers.disk.index)[-40:]
    _preload(engine)
    host = engine.tiers.host
    assert llm.stats().kv_host_preloaded_blocks == 40 and host.num_free_uncached == 0
    assert llm.stats().kv_disk_hit_blocks == 0  # background reads, not a request's hits
    # The host tier's eviction order: the disk's least recent first, as if they had never left memory.
    assert [host.blocks[i].block_hash for i in host.cached_block_ids()] == newest


def test_preload_off_leaves_the_host_tier_empty(tiny_dir: Path, tmp_path: Path) -> None:
    _after_restart(tiny_dir, tmp_path)
    engine = _disk_llm(tiny_dir, tmp_path, kv_host_preload=False).engine
    assert not engine.has_background_work()
    assert engine.stats().kv_host_preloaded_blocks == 0


def test_shutdown_during_the_preload_is_clean(tiny_dir: Path, tmp_path: Path) -> None:
    _after_restart(tiny_dir, tmp_path)
    files = len(list(tmp_path.glob(f"*{SUFFIX}")))
    engine = _disk_llm(tiny_dir, tmp_path).engine
    engine.step()  # the first preload reads are queued
    assert engine.has_background_work()
    engine.close()
    assert not engine.has_background_work()
    assert engine.tiers is not None and engine.tiers.disk is not None
    engine.tiers.disk.close()  # the reader thread ends: no read was left hanging
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == files  # nothing dropped or rewritten
    again = _disk_llm(tiny_dir, tmp_path).engine
    assert again.stats().kv_disk_blocks == files


@pytest.mark.integration
@pytest.mark.slow
def test_real_model_restore_from_a_preloaded_host_tier_matches_transformers(
        tmp_path: Path, hf_greedy: Callable[[list[int], int], list[int]], one_thread: None) -> None:  # noqa: F811
    """SmolLM2 in float32: after a restart, a conversation restored from the host tier the start-up preload
    refilled (no read of its own from disk) gives transformers' greedy tokens."""
    rng = random.Random(3)
    convs = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(3)]
    block_bytes = 737280  # SmolLM2-135M, float32

    def engine() -> LLMEngine:
        return LLM(dtype="float32", num_kv_blocks=30, block_size=16, kv_host_bytes=48 * block_bytes,
                   kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 30, engine_threads=1).engine

    first = engine()
    replies = [_real_turn(first, c, f"first-{i}")[0] for i, c in enumerate(convs)]
    first.close()
    restarted = engine()
    _preload(restarted)
    assert restarted.stats().kv_host_preloaded_blocks >= 12
    back = convs[0] + replies[0] + [504, 1234, 28]
    tokens, cached = _real_turn(restarted, back, "back")
    assert cached == 192 and tokens == hf_greedy(back, 6)
    stats = restarted.stats()
    assert stats.kv_disk_hit_blocks == 0 and stats.kv_host_hit_blocks >= 12
