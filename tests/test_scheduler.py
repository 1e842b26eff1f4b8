"""Scheduler: admission, chunked prefill, all-or-nothing preemption (swap / recompute), fork, abort,
and requests that can never fit, driven by a stand-in for the model that appends tokens (no torch)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.protocol import QueueFullError
from engine.request import RequestStatus, SamplingParams, SequenceGroup
from engine.scheduler import (
    PreemptionCosts,
    Scheduler,
    SchedulerOutput,
    choose_preemption,
    recompute_tokens,
    reservation_tokens,
)


def test_imports_do_not_pull_torch() -> None:
    code = (
        "import sys, engine.block_pool, engine.block_manager, engine.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Driver:
    """Stands in for the engine: runs schedule -> (KV writes) -> update -> sample, and after every
    step checks the scheduler's promises against its own model of where each group's KV lives and
    what every KV slot holds (the KV at a position is a function of all tokens up to it)."""

    def __init__(self, scheduler: Scheduler, check_kv: bool = True) -> None:
        self.s = scheduler
        self.bm = scheduler.block_manager
        self.check_kv = check_kv
        self.kv: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {"device": {}, "cpu": {}}
        self.groups: list[SequenceGroup] = []
        self.outputs: list[SchedulerOutput] = []
        self.ignored: list[SequenceGroup] = []
        self._arrival = 0
        self.sampled: list[bool] = []
        # The tables as the runner rebuilds them from each step's table updates alone.
        self.tables: dict[int, list[int]] = {}

    def add(
        self, prompt: list[int], max_tokens: int = 4, n: int = 1, request_id: str | None = None,
        reserve_output_tokens: int | None = None,
    ) -> SequenceGroup:
        self._arrival += 1
        rid = request_id or f"r{self._arrival}"
        params = SamplingParams(n=n, max_tokens=max_tokens, reserve_output_tokens=reserve_output_tokens)
        group = SequenceGroup(rid, prompt, params, arrival_time=self._arrival)
        self.s.add(group)
        self.groups.append(group)
        return group

    def _copy(self, plan: Iterable[tuple[int, int]], src: str, dst: str) -> None:
        for s, d in plan:
            for off in range(self.bm.block_size):
                value = self.kv[src].get((s, off))
                if value is None:
                    self.kv[dst].pop((d, off), None)
                else:
                    self.kv[dst][(d, off)] = value

    def step(self) -> SchedulerOutput:
        s, bm = self.s, self.bm
        waiting_before = set(map(id, s.waiting))
        running_before = list(s.running)
        tables_before = {seq.seq_id: list(bm.block_table(seq)) for g in s.running for seq in g.seqs}
        out = s.schedule()
        self.outputs.append(out)
        self.ignored.extend(out.ignored)
        cfg = s.config

        # Policy promises of this one call.
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert all(item.num_new_tokens > 0 for item in out.scheduled)
        assert len({item.seq.seq_id for item in out.scheduled}) == len(out.scheduled)
        assert sum(s._seq_slots(g) for g in s.running) <= cfg.max_num_seqs
        admitted = [g for g in s.running if id(g) in waiting_before]
        if s.swapped:
            assert not admitted, "admitted a new request while a group is swapped out"
        if out.preempted:
            assert not admitted and not out.blocks_to_swap_in
        swapped_out_src = {src for src, _ in out.blocks_to_swap_out}
        for rid in out.preempted:
            group = next(g for g in self.groups if g.request_id == rid)
            assert all(group.arrival_time > g.arrival_time for g in s.running), "preempted a non-newest group"
            if group.status is RequestStatus.SWAPPED:
                assert group in s.swapped
                for seq in group.seqs:
                    assert set(tables_before.get(seq.seq_id, [])) <= swapped_out_src
            else:
                assert group.status is RequestStatus.WAITING and group in s.waiting
                assert all(not bm.has_table(q) and q.num_computed_tokens == 0 for q in group.seqs)
        for group in out.ignored:
            assert group.is_finished and all(q.is_finished for q in group.seqs)
            assert any(q.finish_reason == "length" for q in group.seqs)
            assert all(not bm.has_table(q) for q in group.seqs)
            # "Can never fit" only when nothing else holds device memory (any other running group
            # was preempted or dropped first) ...
            others = [g for g in running_before if g.request_id not in out.preempted and g not in out.ignored]
            assert not others, "dropped a request that could wait"
            if len(group.seqs) == 1:
                # ... and the sequence is within a block (swap-in headroom) of the whole pool.
                usable = bm.device.num_blocks - sum(len(b) for b in bm.pinned_blocks().values())
                assert group.seqs[0].num_tokens > (usable - 1) * bm.block_size

        # What the runner would do, in its order: swap out, swap in, copy, then write new KV.
        self._copy(out.blocks_to_swap_out, "device", "cpu")
        self._copy(out.blocks_to_swap_in, "cpu", "device")
        self._copy(out.blocks_to_copy, "device", "device")
        bs = bm.block_size
        for item in out.scheduled:
            assert item.group.status is RequestStatus.RUNNING and item.group in s.running
            assert item.start == item.seq.num_computed_tokens
            table = self.tables.setdefault(item.seq.seq_id, [])
            assert item.table_start <= len(table)
            table[item.table_start:] = item.new_blocks
            assert table == bm.block_table(item.seq), "the table updates do not rebuild the table"
            assert len(table) * bs >= item.start + item.num_new_tokens
            for pos in range(item.start, item.start + item.num_new_tokens):
                self.kv["device"][(table[pos // bs], pos % bs)] = tuple(
                    item.seq.token_ids[: pos + 1]
                )
        if self.check_kv:
            # Attention for a scheduled token reads every earlier position through the table.
            for item in out.scheduled:
                self._check_kv_of(item.seq, "device", item.start + item.num_new_tokens)
        sampling = [item for item in out.scheduled if item.samples]
        self.sampled = [item.samples for item in out.scheduled]  # `samples` changes once tokens are appended
        s.update(out)

        # The "model": one token per sampling sequence; forks once the prompt is done.
        by_group: dict[int, list] = {}
        for item in sampling:
            by_group.setdefault(id(item.group), [item.group]).append(item.seq)
        for group, *seqs in by_group.values():
            if group.needs_fork:
                seqs.extend(s.fork(group))
            for seq in seqs:
                seq.token_ids.append((seq.index * 31 + seq.num_tokens) % 7)
                if (
                    seq.num_output_tokens >= group.sampling_params.max_tokens
                    or seq.num_tokens >= cfg.max_model_len
                ):
                    s.finish_seq(group, seq, "length")
        self.check()
        return out

    def _check_kv_of(self, seq, where: str, upto: int) -> None:  # type: ignore[no-untyped-def]
        table = self.bm.block_table(seq)
        bs = self.bm.block_size
        for pos in range(upto):
            got = self.kv[where].get((table[pos // bs], pos % bs))
            assert got == tuple(seq.token_ids[: pos + 1]), f"{seq} pos {pos} on {where}: wrong KV"

    def check(self) -> None:
        """Refcounts, free lists and KV contents against the queues the groups are in."""
        s, bm = self.s, self.bm
        bm.check_invariants()
        expected: dict[str, dict[int, int]] = {"device": {}, "cpu": {}}
        where_of = {id(g): "device" for g in s.running} | {id(g): "cpu" for g in s.swapped}
        assert len(where_of) == len(s.running) + len(s.swapped), "a group is in two queues"
        for group in self.groups:
            where = where_of.get(id(group))
            for seq in group.seqs:
                if where is None or seq.is_finished:
                    assert not bm.has_table(seq), f"{seq} of a {group.status} group holds blocks"
                    continue
                if where == "cpu":
                    assert bm.has_table(seq), "part of a swapped group was left behind"
                for block_id in bm.block_table(seq):
                    expected[where][block_id] = expected[where].get(block_id, 0) + 1
                if self.check_kv:
                    self._check_kv_of(seq, where, seq.num_computed_tokens)
        for blocks in bm.pinned_blocks().values():
            for block_id in blocks:
                expected["device"][block_id] = expected["device"].get(block_id, 0) + 1
        for where, pool in (("device", bm.device), ("cpu", bm.cpu)):
            free = pool.free_block_ids()
            held = set(expected[where])
            assert free | held == set(range(pool.num_blocks)) and not free & held
            for block in pool.blocks:
                assert block.ref_count == expected[where].get(block.block_id, 0)

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.s.has_unfinished():
            self.step()
            steps += 1
            assert steps <= max_steps, f"no progress: {self.s.stats()}"
        assert self.bm.device.num_free == self.bm.device.num_blocks - sum(
            len(b) for b in self.bm.pinned_blocks().values()
        )
        assert self.bm.cpu.num_free == self.bm.cpu.num_blocks
        return steps


def make(
    block_size: int = 4,
    num_device: int = 16,
    num_cpu: int = 0,
    caching: bool = True,
    costs: PreemptionCosts | None = None,
    **cfg: object,
) -> Driver:
    bm = BlockManager(block_size, num_device, num_cpu, enable_prefix_caching=caching)
    return Driver(Scheduler(SchedulerConfig(**cfg), bm, costs))  # type: ignore[arg-type]


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(salt * 13 + i * 7) % 50 + 1 for i in range(length)]


# -- small scenarios ---------------------------------------------------------------------------


def test_single_request_runs_to_max_tokens() -> None:
    d = make()
    g = d.add(prompt(5), max_tokens=3)
    first = d.step()
    assert [(i.start, i.num_new_tokens) for i in first.scheduled] == [(0, 5)]
    assert d.sampled == [True]
    d.run()
    assert g.is_finished and g.seqs[0].num_output_tokens == 3 and g.seqs[0].finish_reason == "length"


def test_fork_n3_shares_prompt_blocks() -> None:
    d = make(block_size=4)
    g = d.add(prompt(6), max_tokens=3, n=3)
    d.step()
    assert len(g.seqs) == 3 and [s.index for s in g.seqs] == [0, 1, 2]
    tables = [list(d.bm.block_table(s)) for s in g.seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
    assert [d.bm.device.blocks[b].ref_count for b in tables[0]] == [3, 3]
    out = d.step()  # each sample writes its token into the shared partial block
    assert len(out.scheduled) == 3 and len(out.blocks_to_copy) == 2
    assert {src for src, _ in out.blocks_to_copy} == {tables[0][1]}
    tables = [d.bm.block_table(s) for s in g.seqs]
    assert len({t[1] for t in tables}) == 3 and len({t[0] for t in tables}) == 1
    assert d.bm.device.blocks[tables[0][0]].ref_count == 3
    d.run()
    assert all(s.num_output_tokens == 3 for s in g.seqs)
    assert len({tuple(s.output_token_ids) for s in g.seqs}) == 3


def test_chunked_prefill_splits_long_prompt() -> None:
    d = make(block_size=4, num_device=32, max_num_batched_tokens=16)
    g = d.add(prompt(40), max_tokens=2)
    chunks = []
    for _ in range(3):
        out = d.step()
        chunks.append([(i.start, i.num_new_tokens, f) for i, f in zip(out.scheduled, d.sampled, strict=True)])
    assert chunks == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert g.seqs[0].num_output_tokens == 1
    d.run()


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    d = make(block_size=4, num_device=64, max_num_batched_tokens=8)
    old = d.add(prompt(3), max_tokens=10)
    d.step()
    d.add(prompt(30, salt=1), max_tokens=2)
    out = d.step()
    assert [(i.group is old, i.num_new_tokens) for i in out.scheduled] == [(True, 1), (False, 7)]
    d.run()


def test_max_num_seqs_is_respected() -> None:
    d = make(num_device=64, max_num_seqs=3)
    for i in range(4):
        d.add(prompt(3, salt=i), max_tokens=3, n=2)
    out = d.step()
    assert len(out.scheduled) == 1  # a second n=2 group would need 4 sequence slots
    d.run()
    assert all(g.is_finished and all(s.num_output_tokens == 3 for s in g.seqs) for g in d.groups)


def test_prefix_cache_hit_across_requests() -> None:
    d = make(block_size=4, num_device=16)
    d.add(prompt(10), max_tokens=1)
    d.run()
    g = d.add(prompt(10) + [5, 5], max_tokens=1)
    out = d.step()
    assert g.num_cached_tokens == 8
    assert [(i.start, i.num_new_tokens) for i in out.scheduled] == [(8, 4)]
    d.run()


def test_newest_running_group_is_preempted_and_swapped_back_first() -> None:
    # 3 requests of 4-token prompts in 6 blocks of 4: all fit at first, then growth needs a 7th block.
    d = make(block_size=4, num_device=6, num_cpu=8, preemption_mode="swap")
    a, b, c = (d.add(prompt(4, salt=i), max_tokens=8) for i in range(3))
    d.step()
    d.step()  # 3 x 6 tokens: 6 blocks, the pool is full
    waiting = d.add(prompt(2, salt=9), max_tokens=1)
    for _ in range(3):  # positions 5 to 7 still fit in the second blocks
        assert not d.step().preempted
    out = d.step()
    assert out.preempted == (c.request_id,)
    assert c.status is RequestStatus.SWAPPED and len(out.blocks_to_swap_out) == 2
    assert a.status is b.status is RequestStatus.RUNNING
    # The swapped group comes back before the waiting request is admitted.
    while c.status is RequestStatus.SWAPPED:
        assert waiting.status is RequestStatus.WAITING
        out = d.step()
    assert out.blocks_to_swap_in and out.scheduled[0].group is c
    d.run()
    assert d.s.num_preemptions["swap"] >= 1
    assert all(g.seqs[0].num_output_tokens == g.sampling_params.max_tokens for g in d.groups)


def test_recompute_preemption_frees_and_requeues_first() -> None:
    d = make(block_size=4, num_device=6, num_cpu=8, preemption_mode="recompute")
    a, b, c = (d.add(prompt(4, salt=i), max_tokens=8) for i in range(3))
    d.add(prompt(2, salt=9), max_tokens=1)
    for _ in range(5):
        assert not d.step().preempted
    out = d.step()
    assert out.preempted == (c.request_id,) and not out.blocks_to_swap_out
    assert d.s.waiting[0] is c and c.seqs[0].num_computed_tokens == 0
    d.run()
    assert d.s.num_preemptions == {"swap": 0, "recompute": d.s.num_preemptions["recompute"]}
    assert all(g.seqs[0].num_output_tokens == g.sampling_params.max_tokens for g in d.groups)


def test_swap_without_cpu_room_falls_back_to_recompute() -> None:
    d = make(block_size=4, num_device=6, num_cpu=0, preemption_mode="swap")
    for i in range(3):
        d.add(prompt(4, salt=i), max_tokens=8)
    d.run()
    assert d.s.num_preemptions["swap"] == 0 and d.s.num_preemptions["recompute"] >= 1


# -- auto preemption: swap or recompute by cost ----------------------------------------------------
CHEAP_SWAP = PreemptionCosts(swap_seconds_per_block=1e-6, prefill_seconds_per_token=1e-3)
DEAR_SWAP = PreemptionCosts(swap_seconds_per_block=1.0, prefill_seconds_per_token=1e-3)


@pytest.mark.parametrize(
    ("costs", "num_cpu", "chosen"),
    [(CHEAP_SWAP, 8, "swap"), (DEAR_SWAP, 8, "recompute"), (CHEAP_SWAP, 0, "recompute"),
     (CHEAP_SWAP, 1, "recompute")],  # the victim holds 2 blocks: 1 CPU block is too short
    ids=["cheap-swap", "expensive-swap", "no-swap-space", "short-swap-space"],
)
def test_auto_preemption_picks_the_cheaper_mode(costs: PreemptionCosts, num_cpu: int, chosen: str) -> None:
    d = make(block_size=4, num_device=6, num_cpu=num_cpu, preemption_mode="auto",
             costs=PreemptionCosts(costs.swap_seconds_per_block, costs.prefill_seconds_per_token))
    a, b, c = (d.add(prompt(4, salt=i), max_tokens=8) for i in range(3))
    for _ in range(5):
        assert not d.step().preempted
    out = d.step()
    assert out.preempted == (c.request_id,)
    assert bool(out.blocks_to_swap_out) == (chosen == "swap")
    assert c.status is (RequestStatus.SWAPPED if chosen == "swap" else RequestStatus.WAITING)
    d.run()
    other = "recompute" if chosen == "swap" else "swap"
    assert d.s.num_preemptions[chosen] >= 1 and d.s.num_preemptions[other] == 0
    assert getattr(d.s.stats(), f"preemptions_{chosen}") == d.s.num_preemptions[chosen]
    assert all(g.seqs[0].num_output_tokens == g.sampling_params.max_tokens for g in d.groups)


def test_choose_preemption_compares_round_trip_against_prefill() -> None:
    costs = PreemptionCosts(swap_seconds_per_block=2e-3, prefill_seconds_per_token=1e-4)
    # 3 blocks: 6 ms of swapping against 50 tokens (5 ms) or 70 tokens (7 ms) of prefill.
    assert choose_preemption("auto", True, 3, 50, costs) == "recompute"
    assert choose_preemption("auto", True, 3, 70, costs) == "swap"
    assert choose_preemption("auto", True, 3, 60, costs) == "swap"  # a tie redoes no work
    assert choose_preemption("auto", False, 3, 10**6, costs) == "recompute"
    assert choose_preemption("swap", True, 3, 1, costs) == "swap"
    assert choose_preemption("swap", False, 3, 1, costs) == "recompute"
    assert choose_preemption("recompute", True, 3, 10**6, costs) == "recompute"


def test_auto_recomputes_a_group_whose_blocks_are_mostly_shared() -> None:
    # Swapping blocks others hold frees none of them and brings them back as private copies.
    costs = PreemptionCosts(swap_seconds_per_block=2e-4, prefill_seconds_per_token=1e-3)
    assert choose_preemption("auto", True, 18, 30, costs) == "swap"  # by time alone: 3.6 ms against 30 ms
    assert choose_preemption("auto", True, 18, 30, costs, shared_blocks=9) == "recompute"
    assert choose_preemption("auto", True, 18, 30, costs, shared_blocks=8) == "swap"
    assert choose_preemption("swap", True, 18, 30, costs, shared_blocks=16) == "swap"  # a fixed mode is fixed


def test_recompute_tokens_count_a_shared_prompt_once() -> None:
    d = make(block_size=2, num_device=32)
    g = d.add(prompt(5), max_tokens=4, n=3)
    assert recompute_tokens(g) == 0
    d.step()  # the prompt, then the fork into 3 samples of 1 token each
    d.step()  # each sample's first token computed
    assert [s.num_computed_tokens for s in g.seqs] == [6, 6, 6]
    assert recompute_tokens(g) == 5 + 3 * 1


def test_preemption_costs_start_from_the_first_timing_then_average() -> None:
    costs = PreemptionCosts()
    costs.observe_prefill(100, 0.5)
    assert costs.prefill_measured and costs.prefill_seconds_per_token == pytest.approx(5e-3)
    costs.observe_prefill(100, 0.1)
    assert 1e-3 < costs.prefill_seconds_per_token < 5e-3
    costs.observe_swap(4, 0.002)  # one way: a round trip costs twice as much
    assert costs.swap_seconds_per_block == pytest.approx(1e-3)
    costs.observe_swap(0, 1.0)
    costs.observe_prefill(0, 1.0)
    assert costs.swap_seconds_per_block == pytest.approx(1e-3)


@pytest.mark.parametrize(("caching", "len_a", "len_b"), [(False, 2, 3), (True, 4, 6)])
def test_recomputed_group_larger_than_one_step_budget(caching: bool, len_a: int, len_b: int) -> None:
    # B (n=2) is preempted for recompute after forking; re-admitting both of its sequences takes
    # more tokens than one step's budget, so the second one must wait for later steps (it fits
    # the pool alone, so it must not be dropped as "can never fit").
    d = make(
        block_size=2, num_device=6, caching=caching, preemption_mode="recompute", max_num_batched_tokens=4
    )
    a = d.add(prompt(len_a), max_tokens=6)
    b = d.add(prompt(len_b, salt=1), max_tokens=3, n=2)
    d.run()
    assert d.s.num_preemptions["recompute"] >= 1
    assert not d.ignored
    assert a.seqs[0].num_output_tokens == 6
    assert [s.num_output_tokens for s in b.seqs] == [3, 3]


def test_rolled_back_admission_leaves_no_uncomputed_block_in_the_cache() -> None:
    # Admitting a recomputed n=2 group allocates its first sequence, then finds no room for the
    # second and gives the first back. The blocks it registered were never written: no hits.
    d = make(block_size=2, num_device=6, preemption_mode="recompute")
    a = d.add(prompt(2, salt=5), max_tokens=9)
    b = d.add(prompt(3, salt=1), max_tokens=3, n=2)
    d.run()
    assert d.s.num_preemptions["recompute"] >= 1
    assert a.seqs[0].num_output_tokens == 9 and [s.num_output_tokens for s in b.seqs] == [3, 3]


def _state_in_all_queues(d: Driver) -> tuple[SequenceGroup, SequenceGroup, SequenceGroup]:
    a = d.add(prompt(4, salt=1), max_tokens=20)
    b = d.add(prompt(4, salt=2), max_tokens=20, n=2)
    while b.status is not RequestStatus.SWAPPED:
        d.step()
    c = d.add(prompt(3, salt=3), max_tokens=20)
    d.step()
    assert a.status is RequestStatus.RUNNING and c.status is RequestStatus.WAITING
    return a, b, c


@pytest.mark.parametrize("which", [0, 1, 2])
def test_abort_from_each_queue_frees_everything(which: int) -> None:
    d = make(block_size=2, num_device=6, num_cpu=8, preemption_mode="swap")
    groups = _state_in_all_queues(d)
    target = groups[which]
    before = (d.bm.device.num_free, d.bm.cpu.num_free)
    assert d.s.abort(target.request_id) is target
    assert d.s.abort(target.request_id) is None
    assert target.is_finished and all(s.finish_reason == "abort" for s in target.seqs)
    assert all(target not in queue for queue in (d.s.running, d.s.waiting, d.s.swapped))
    d.check()
    after = (d.bm.device.num_free, d.bm.cpu.num_free)
    assert after[which == 1] > before[which == 1] or which == 2
    for g in groups:
        if g is not target:
            assert d.s.abort(g.request_id) is g
    d.check()
    assert not d.s.has_unfinished()
    assert d.bm.device.num_free == 6 and d.bm.cpu.num_free == 8


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_prompt_larger_than_pool_is_ignored(mode: str) -> None:
    d = make(block_size=4, num_device=4, num_cpu=8, preemption_mode=mode)
    too_big = d.add(prompt(17), max_tokens=2)
    ok = d.add(prompt(3), max_tokens=2)
    out = d.step()
    assert out.ignored == (too_big,) and too_big.seqs[0].finish_reason == "length"
    d.run()
    assert ok.seqs[0].num_output_tokens == 2


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [4, 6, 64])
@pytest.mark.parametrize("prompt_len", [14, 18])
def test_request_outgrowing_the_pool_ends_with_length(
    mode: str, caching: bool, budget: int, prompt_len: int
) -> None:
    # 4 blocks of 4: a 14-token prompt fits and then outgrows the pool while decoding; an 18-token
    # prompt is admitted chunk by chunk and runs out of room mid-prefill.
    d = make(
        block_size=4,
        num_device=4,
        num_cpu=8,
        caching=caching,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
    )
    g = d.add(prompt(prompt_len), max_tokens=50)
    d.run(max_steps=200)
    assert g.is_finished and g.seqs[0].finish_reason == "length"
    if prompt_len < 16:
        assert 16 <= g.seqs[0].num_tokens <= 17  # the last sampled token never needs a slot
    else:
        assert g.seqs[0].num_output_tokens == 0


def test_kv_reservation_max_len_reserves_whole_sequences() -> None:
    d = make(block_size=4, num_device=20, max_model_len=18, kv_reservation="max_len")
    groups = [d.add(prompt(3, salt=i), max_tokens=4) for i in range(5)]
    out = d.step()
    per_seq = math.ceil(18 / 4)
    assert len(out.scheduled) == 4  # 4 x 5 blocks = 20
    for item in out.scheduled:
        assert (item.table_start, len(item.new_blocks)) == (0, per_seq)
    assert groups[4].status is RequestStatus.WAITING
    assert d.bm.slot_usage() == (12, 4 * per_seq * 4)
    d.run()


@pytest.mark.parametrize(
    ("policy", "output", "expected"),
    [("paged", 5, 0), ("max", 5, 100), ("max_len", None, 100), ("oracle", 5, 8), ("oracle", 1, 4),
     ("pow2", 5, 11), ("pow2", 8, 11), ("pow2", 9, 19), ("pow2", 1, 4), ("oracle", 200, 100), ("pow2", 64, 67)],
)
def test_reservation_tokens_per_policy(policy: str, output: int | None, expected: int) -> None:
    # The paper's Orca baselines: Max reserves the context limit, Pow2 the prompt + output rounded up to a
    # power of two (at most 2x over), Oracle exactly prompt + output; none exceeds max_model_len.
    assert reservation_tokens(policy, 100, 3, output) == expected  # type: ignore[arg-type]


def test_reservation_tokens_needs_the_output_length() -> None:
    for policy in ("pow2", "oracle"):
        with pytest.raises(ValueError, match="reserve_output_tokens"):
            reservation_tokens(policy, 100, 3, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "admitted", "blocks_each"), [
    ("paged", 12, 1), ("oracle", 10, 2), ("pow2", 6, 3), ("max", 4, 5), ("max_len", 4, 5)])
def test_kv_reservation_admits_what_the_policy_reserves(policy: str, admitted: int, blocks_each: int) -> None:
    # 20 blocks of 4; prompts of 3 tokens, 5 output tokens each: paged takes 1 block at admission (watermark
    # aside: all 12), oracle 8 tokens = 2 blocks, pow2 3 + 8 = 11 tokens = 3 blocks, max 18 tokens = 5 blocks.
    d = make(block_size=4, num_device=20, max_model_len=18, kv_reservation=policy)
    groups = [d.add(prompt(3, salt=i), max_tokens=5, reserve_output_tokens=5) for i in range(12)]
    out = d.step()
    assert len(out.scheduled) == admitted
    for item in out.scheduled:
        assert len(item.new_blocks) == blocks_each
    assert d.bm.device.num_free == 20 - len(out.scheduled) * blocks_each
    d.run()
    assert all(g.is_finished and g.seqs[0].num_output_tokens == 5 for g in groups)
    assert d.bm.device.num_free == 20


def test_kv_reservation_oracle_keeps_the_whole_reservation_until_the_end() -> None:
    # Reserved slots are held up front, so decoding never allocates and never preempts.
    d = make(block_size=4, num_device=12, max_model_len=64, kv_reservation="oracle")
    groups = [d.add(prompt(5, salt=i), max_tokens=11, reserve_output_tokens=11) for i in range(3)]
    d.step()
    assert d.bm.device.num_free == 0  # 3 x ceil(16 / 4)
    for _ in range(5):
        out = d.step()
        assert all(not item.new_blocks for item in out.scheduled)
    d.run()
    assert d.s.stats().preemptions_swap + d.s.stats().preemptions_recompute == 0
    assert all(g.seqs[0].num_output_tokens == 11 for g in groups)


@pytest.mark.parametrize("policy", ["pow2", "oracle"])
def test_kv_reservation_without_output_length_is_refused(policy: str) -> None:
    d = make(kv_reservation=policy)
    with pytest.raises(ValueError, match="reserve_output_tokens"):
        d.add(prompt(3))
    assert not d.s.has_unfinished()
    d.add(prompt(3), reserve_output_tokens=4)
    d.run()


def test_more_samples_than_max_num_seqs_is_rejected() -> None:
    # Such a group could never be admitted and would block the head of the waiting queue forever.
    d = make(max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        d.add(prompt(2), n=3)
    assert not d.s.has_unfinished()
    ok = d.add(prompt(2), max_tokens=2, n=2)
    d.run()
    assert all(s.num_output_tokens == 2 for s in ok.seqs)


def test_queue_full() -> None:
    d = make(max_waiting=2)
    d.add(prompt(2))
    d.add(prompt(2))
    with pytest.raises(QueueFullError):
        d.add(prompt(2))


def test_stats_are_back_to_idle_after_everything_ends() -> None:
    d = make(block_size=2, num_device=8, num_cpu=4)
    for i in range(5):
        d.add(prompt(5, salt=i % 2), max_tokens=6, n=1 + i % 2)
    d.run()
    stats = d.s.stats()
    assert stats.kv_blocks_free == 8 and stats.cpu_blocks_free == 4
    assert stats.requests_running == stats.requests_waiting == stats.requests_swapped == 0
    assert stats.prefix_cache_hit_tokens > 0


# -- oversubscription and random operation sequences --------------------------------------------


# Swapping a block costs as much as prefilling 3 tokens: auto swaps only groups whose blocks are >= 3/4 full.
BALANCED = PreemptionCosts(swap_seconds_per_block=3e-3, prefill_seconds_per_token=1e-3)


@pytest.mark.parametrize(("mode", "num_cpu"), [("swap", 64), ("recompute", 64), ("swap", 0), ("swap", 3),
                                               ("auto", 64), ("auto", 3)])
def test_oversubscribed_workload_finishes(mode: str, num_cpu: int) -> None:
    d = make(
        block_size=4,
        num_device=16,
        num_cpu=num_cpu,
        costs=PreemptionCosts(BALANCED.swap_seconds_per_block, BALANCED.prefill_seconds_per_token),
        preemption_mode=mode,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    for i in range(12):
        d.add(prompt(3 + (i * 5) % 14, salt=i % 3), max_tokens=4 + (i * 3) % 9, n=1 + i % 3)
    d.run()
    assert not d.ignored
    for g in d.groups:
        assert g.is_finished and len(g.seqs) == g.sampling_params.n
        assert all(s.num_output_tokens == g.sampling_params.max_tokens for s in g.seqs)
    preemptions = d.s.num_preemptions
    assert preemptions["swap"] + preemptions["recompute"] > 0, "workload did not oversubscribe"
    if num_cpu == 0 or mode == "recompute":
        assert preemptions["swap"] == 0
    if mode == "auto":  # groups both fuller and emptier than the break-even fill, or short of CPU room
        assert preemptions["swap"] > 0 and preemptions["recompute"] > 0


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_device=st.integers(4, 16),
    num_cpu=st.integers(0, 8),
    mode=st.sampled_from(["swap", "recompute", "auto"]),
    caching=st.booleans(),
    budget=st.integers(2, 24),
    max_num_seqs=st.integers(3, 8),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 63), st.integers(0, 63)), max_size=30),
)
def test_random_operations(
    block_size: int,
    num_device: int,
    num_cpu: int,
    mode: str,
    caching: bool,
    budget: int,
    max_num_seqs: int,
    ops: list[tuple[int, int, int]],
) -> None:
    d = make(
        block_size,
        num_device,
        num_cpu,
        caching=caching,
        costs=PreemptionCosts(BALANCED.swap_seconds_per_block, BALANCED.prefill_seconds_per_token),
        preemption_mode=mode,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
    )
    for kind, a, b in ops:
        live = [g for g in d.groups if not g.is_finished]
        if kind == 0:  # add
            d.add(prompt(1 + a % 12, salt=b % 3), max_tokens=1 + b % 8, n=1 + a % 3)
        elif kind == 1:
            d.step()
        elif kind == 2 and live:  # finish one running sequence early (a stop string, say)
            group = live[a % len(live)]
            seqs = group.unfinished_seqs()
            if group.status is RequestStatus.RUNNING and seqs and not group.needs_fork:
                d.s.finish_seq(group, seqs[b % len(seqs)], "stop")
        elif kind == 3 and live:
            d.s.abort(live[a % len(live)].request_id)
        d.check()
    d.run()
    for g in d.groups:
        assert g.is_finished


def test_recompute_skips_a_prompt_prefix_that_other_requests_keep_on_the_device() -> None:
    # Two requests share a 2-block system prompt; preempting one leaves those blocks held by the other,
    # so its recompute redoes only its own tokens, and with the prefill dear against the swap auto sees that.
    d = make(block_size=4, num_device=32, num_cpu=32, preemption_mode="auto")
    system = prompt(8, salt=9)
    a = d.add(system + prompt(3, salt=1), max_tokens=4)
    b = d.add(system + prompt(3, salt=2), max_tokens=4)
    d.step()
    d.step()
    bm = d.bm
    assert bm.resident_prefix_blocks(b) == 2 and bm.resident_prefix_blocks(a) == 2
    assert recompute_tokens(b) == 12 and recompute_tokens(b, 2 * 4) == 4
    # Alone, nothing of the prompt survives a free.
    d.s.abort(a.request_id)
    assert bm.resident_prefix_blocks(b) == 0
    # Swapped-out groups hold nothing on the device.
    assert bm.resident_prefix_blocks(a) == 0


@pytest.mark.parametrize(("caching", "chosen"), [(True, "recompute"), (False, "swap")])
def test_auto_counts_a_prompt_prefix_that_stays_cached_as_free_to_recompute(caching: bool, chosen: str) -> None:
    # Two requests share a 2-block system prompt in a 7-block pool; the newer is preempted with 16 tokens
    # computed in 4 blocks: 12 ms to swap, 16 ms to recompute all of it, 8 ms for its own 8 tokens when the
    # other request keeps the shared 8 cached. With prefix caching off nothing is shared or stays: preempted
    # earlier, with 12 tokens in 3 blocks, 9 ms to swap against 12 to recompute.
    costs = PreemptionCosts(swap_seconds_per_block=3e-3, prefill_seconds_per_token=1e-3)
    d = make(block_size=4, num_device=7, num_cpu=32, caching=caching, preemption_mode="auto", costs=costs)
    system = prompt(8, salt=9)
    d.add(system + prompt(3, salt=1), max_tokens=8)
    victim = d.add(system + prompt(3, salt=2), max_tokens=8)
    preempted = None
    for _ in range(12):
        before = victim.seqs[0].num_computed_tokens
        out = d.step()
        if out.preempted:
            preempted = out
            break
    assert preempted is not None and preempted.preempted == (victim.request_id,)
    assert before == (16 if caching else 12)
    assert bool(preempted.blocks_to_swap_out) == (chosen == "swap")
    d.run()
    other = "swap" if chosen == "recompute" else "recompute"
    assert d.s.num_preemptions[chosen] >= 1 and d.s.num_preemptions[other] == 0
