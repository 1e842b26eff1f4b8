"""Who runs this step: admission, the token budget, and all-or-nothing preemption.

Policy only. The scheduler asks the block manager yes/no questions and collects the plans it
returns (blocks to swap out, swap in and copy); it never touches blocks itself. Each step mixes
decodes and prefill chunks under ``max_num_batched_tokens`` (chunked prefill), oldest request
first. When the pool runs dry the newest running group is preempted whole: swapped to the CPU
pool, or freed to be recomputed. While any group is swapped out nothing new is admitted.

Swap or recompute: ``preemption_mode="auto"`` picks, per preempted group, whichever the engine's
measured costs (``PreemptionCosts``, plain numbers the engine reports) say is cheaper: moving the
group's blocks to the CPU pool and back, or prefilling its tokens again (less the prompt blocks other requests
keep on the device, which re-admission finds in the prefix cache). Without CPU room it recomputes.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, BlockPlan
from engine.config import RESERVATIONS_NEEDING_OUTPUT_LENGTH, KVReservation, PreemptionMode, SchedulerConfig
from engine.kv_tiers import KVTiers
from engine.plan import ScheduledSeq, SchedulerOutput, TierPlan
from engine.protocol import EngineStats, QueueFullError
from engine.request import RequestStatus, Sequence, SequenceGroup

# Until the engine has timed a prefill, recompute is assumed slow (1 ms a token, a float32 CPU's order):
# auto then swaps, the mode whose cost does not grow with the context, while CPU room allows.
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 1e-3
DEFAULT_SWAP_SECONDS_PER_BLOCK = 1e-4
# Weight of the newest timing in the running estimates: a few steps outweigh a slow first (warm-up) one.
_NEW_WEIGHT = 0.3


@dataclass
class PreemptionCosts:
    """Running estimates, in seconds, of what each way of preempting costs: moving one KV block to the CPU
    pool and back (a swap's round trip), and prefilling one token (what a recompute redoes). The engine
    measures and reports them; the scheduler only compares them."""

    swap_seconds_per_block: float = DEFAULT_SWAP_SECONDS_PER_BLOCK
    prefill_seconds_per_token: float = DEFAULT_PREFILL_SECONDS_PER_TOKEN
    swap_measured: bool = False
    prefill_measured: bool = False

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        """``num_blocks`` moved one way (out or in) in ``seconds``."""
        if num_blocks > 0 and seconds > 0:
            self.swap_seconds_per_block = self._update(
                self.swap_seconds_per_block, 2 * seconds / num_blocks, self.swap_measured)
            self.swap_measured = True

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step of mostly prefill tokens (``num_tokens`` in all) took ``seconds``. Its fixed per-step
        cost is counted against the tokens too, which leans towards swapping, the mode that keeps work."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_seconds_per_token = self._update(
                self.prefill_seconds_per_token, seconds / num_tokens, self.prefill_measured)
            self.prefill_measured = True

    @staticmethod
    def _update(old: float, new: float, measured: bool) -> float:
        return old + _NEW_WEIGHT * (new - old) if measured else new


def choose_preemption(mode: PreemptionMode, can_swap: bool, num_blocks: int, num_tokens: int,
                      costs: PreemptionCosts, shared_blocks: int = 0) -> PreemptionMode:
    """"swap" or "recompute" for a group holding ``num_blocks`` blocks whose recompute redoes ``num_tokens``
    tokens. Recompute whenever the CPU pool cannot take the blocks; ties go to swap (no work is redone).

    ``shared_blocks`` of them are also held outside the group (a shared system prompt). Swapping those
    frees nothing now and brings them back as private copies, while a recompute finds them in the prefix
    cache: once they are half the group's blocks or more, a swap would at least double what the group holds
    on its return, so auto recomputes whatever the times say (``benchmarks/paper/swap_recompute.py`` serves
    requests behind a shared system prompt in each mode)."""
    if mode == "recompute" or not can_swap:
        return "recompute"
    if mode == "swap":
        return "swap"
    if shared_blocks and 2 * shared_blocks >= num_blocks:
        return "recompute"
    swap_s = num_blocks * costs.swap_seconds_per_block
    recompute_s = num_tokens * costs.prefill_seconds_per_token
    return "swap" if swap_s <= recompute_s else "recompute"


def recompute_tokens(group: SequenceGroup, resident_tokens: int = 0) -> int:
    """Tokens a recompute of the group prefills again: the shared prompt once, then each sequence's own.
    ``resident_tokens`` of the prompt stay on the device in blocks others hold (a shared system prompt):
    re-admission finds them in the prefix cache, so they cost nothing to recompute."""
    seqs = group.unfinished_seqs()
    if not seqs:
        return 0
    prompt = group.num_prompt_tokens
    computed = [s.num_computed_tokens for s in seqs]
    prompt_done = min(prompt, max(computed))
    return prompt_done - min(resident_tokens, prompt_done) + sum(max(0, c - prompt) for c in computed)


def reservation_tokens(policy: KVReservation, max_model_len: int, prompt_tokens: int,
                       output_tokens: int | None) -> int:
    """Token slots a sequence reserves at admission under ``policy`` (0: none ahead, blocks as tokens come).
    ``output_tokens`` is the request's true output length, which "pow2" rounds up to a power of two and
    "oracle" takes as it is; the reservation never exceeds ``max_model_len``."""
    if policy == "paged":
        return 0
    if policy in ("max", "max_len"):
        return max_model_len
    if output_tokens is None:
        raise ValueError(f"kv_reservation={policy!r} needs reserve_output_tokens on the request")
    if policy == "pow2":
        output_tokens = 1 << (output_tokens - 1).bit_length()
    return min(prompt_tokens + output_tokens, max_model_len)


@dataclass
class _StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: BlockPlan = field(default_factory=list)
    swap_in: BlockPlan = field(default_factory=list)
    copies: BlockPlan = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)


def _arrival(group: SequenceGroup) -> float:
    return group.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 costs: PreemptionCosts | None = None, tiers: KVTiers | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.costs = costs or PreemptionCosts()
        self.tiers = tiers
        self.waiting: deque[SequenceGroup] = deque()
        # Waiting groups set aside while the disk tier reads their blocks (engine.kv_tiers); others pass them.
        self.loading: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []  # kept in arrival order; the last is preempted first
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = {"swap": 0, "recompute": 0}

    # -- queues -------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.sampling_params.max_seqs > self.config.max_num_seqs:
            # It could never be admitted and would block the head of the waiting queue forever.
            raise ValueError(f"{group.sampling_params.max_seqs} sequences (n or best_of) exceed "
                             f"max_num_seqs={self.config.max_num_seqs}")
        if (self.config.kv_reservation in RESERVATIONS_NEEDING_OUTPUT_LENGTH
                and group.sampling_params.reserve_output_tokens is None):
            raise ValueError(f"kv_reservation={self.config.kv_reservation!r} reserves the request's true output "
                             f"length: set sampling_params.reserve_output_tokens")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        group.status = RequestStatus.WAITING
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request from whichever queue holds it and free all its blocks at once."""
        for queue in (self.running, self.waiting, self.swapped, self.loading):
            group = next((g for g in queue if g.request_id == request_id), None)
            if group is not None:
                queue.remove(group)
                self._end(group, "abort")
                return group
        return None

    def _num_running_seqs(self) -> int:
        return sum(self._seq_slots(g) for g in self.running)

    @staticmethod
    def _seq_slots(group: SequenceGroup) -> int:
        # A group that will fork (into n samples, or up to best_of beams) is admitted with room for all of them.
        will_fork = group.needs_fork or group.beam is not None
        return max(len(group.unfinished_seqs()), group.sampling_params.max_seqs if will_fork else 0)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan()
        if self.tiers is not None:
            self._return_loaded(self.tiers)
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            budget = self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        tiers = TierPlan() if self.tiers is None else self.tiers.finish_plan()
        return SchedulerOutput(tuple(plan.scheduled), tuple(plan.swap_out), tuple(plan.swap_in),
                               tuple(plan.copies), tuple(plan.preempted), tuple(plan.ignored), tiers)

    def _return_loaded(self, tiers: KVTiers) -> None:
        """Groups whose disk blocks are in the host tier now go back to the head of the waiting queue."""
        tiers.begin_step()
        loaded = [g for g in self.loading if tiers.loads_done(g.request_id)]
        for group in reversed(loaded):
            self.loading.remove(group)
            self.waiting.appendleft(group)

    def _requests_for(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        requests = []
        for seq in group.unfinished_seqs():
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 0:
                requests.append((seq, n))
                budget -= n
        return requests

    def _commit(self, plan: _StepPlan, group: SequenceGroup, requests: list[tuple[Sequence, int]]) -> int:
        for seq, n in requests:
            start = seq.num_computed_tokens
            plan.copies.extend(self.block_manager.allocate_slots(seq, n))
            self._schedule_seq(plan, group, seq, start, n)
        return sum(n for _, n in requests)

    def _schedule_seq(self, plan: _StepPlan, group: SequenceGroup, seq: Sequence, start: int, n: int) -> None:
        plan.scheduled.append(ScheduledSeq(group, seq, start, n, *self.block_manager.take_table_update(seq)))

    def _schedule_running(self, plan: _StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            requests = self._requests_for(group, budget)
            while requests and not self.block_manager.can_allocate(requests):
                if len(self.running) == 1:
                    # Alone with the whole pool and still no room: preempting it would only bring
                    # it back to the same point (a swap/recompute loop), so it can never fit.
                    self.running.remove(group)
                    self._ignore(group, plan)
                    requests = []
                    break
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is group:
                    requests = []
            if group.status is RequestStatus.RUNNING:
                budget -= self._commit(plan, group, requests)
                i += 1
        return budget

    def _preempt(self, group: SequenceGroup, plan: _StepPlan) -> None:
        self.running.remove(group)
        plan.preempted.append(group.request_id)
        if self._preemption_mode(group) == "swap":
            plan.swap_out.extend(self.block_manager.swap_out(group))
            group.status = RequestStatus.SWAPPED
            # Oldest first, so swapped groups come back in arrival order.
            bisect.insort(self.swapped, group, key=_arrival)
            self.num_preemptions["swap"] += 1
        else:
            self.block_manager.free_group(group)
            for seq in group.seqs:
                seq.num_computed_tokens = 0
            group.status = RequestStatus.WAITING
            self.waiting.appendleft(group)
            self.num_preemptions["recompute"] += 1

    def _preemption_mode(self, group: SequenceGroup) -> PreemptionMode:
        bm = self.block_manager
        num_blocks = len({b for seq in group.seqs for b in bm.block_table(seq)})
        resident = bm.resident_prefix_blocks(group)
        return choose_preemption(self.config.preemption_mode, bm.can_swap_out(group), num_blocks,
                                 recompute_tokens(group, resident * bm.block_size), self.costs, resident)

    def _schedule_swapped(self, plan: _StepPlan, budget: int) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            if self._num_running_seqs() + self._seq_slots(group) > self.config.max_num_seqs:
                break
            if not self.block_manager.can_swap_in(group):
                if not self.running:
                    # Nothing else holds memory, so it will never fit: give up on it.
                    self.swapped.popleft()
                    self._ignore(group, plan)
                    continue
                break
            self.swapped.popleft()
            plan.swap_in.extend(self.block_manager.swap_in(group))
            group.status = RequestStatus.RUNNING
            self._insert_running(group)
            requests = self._requests_for(group, budget)
            if self.block_manager.can_allocate(requests):
                budget -= self._commit(plan, group, requests)
        return budget

    def _schedule_waiting(self, plan: _StepPlan, budget: int) -> None:
        reserving = self.config.kv_reservation != "paged"
        # Admitting into the last few free blocks would only preempt someone at the next decode.
        watermark = 0 if reserving else max(1, self.block_manager.device.num_blocks // 100)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            reserve = reservation_tokens(self.config.kv_reservation, self.config.max_model_len,
                                         group.num_prompt_tokens, group.sampling_params.reserve_output_tokens)
            if self._num_running_seqs() + self._seq_slots(group) > self.config.max_num_seqs:
                break
            if self.tiers is not None and self.tiers.start_disk_loads(group):
                self.waiting.popleft()
                self.loading.append(group)
                continue
            admitted: list[tuple[Sequence, int]] = []
            for seq in group.unfinished_seqs():
                if self.tiers is not None:
                    self.tiers.restore(seq)
                prefix = self.block_manager.lookup_prefix(seq)
                # A later sequence of a group (re-admitted after recompute) may get no tokens this
                # step when the budget is spent: it still gets its table and runs next step.
                n = min(seq.num_tokens - len(prefix) * self.block_manager.block_size, budget)
                margin = watermark if self.running else 0
                if not self.block_manager.can_allocate([(seq, n)], prefix, reserve, margin):
                    break
                start_copies = self.block_manager.allocate_slots(seq, n, prefix, reserve)
                assert not start_copies, "a fresh table never needs copy-on-write"
                admitted.append((seq, n))
                budget -= n
            if len(admitted) < len(group.unfinished_seqs()):
                # All of a group or none of it: give back what this admission took.
                for seq, _ in admitted:
                    self.block_manager.abandon(seq)
                    seq.num_computed_tokens = 0
                if not self.running and not plan.scheduled:
                    # Alone with the whole pool and still no room: it will never fit.
                    self.waiting.popleft()
                    self._ignore(group, plan)
                    continue
                break
            self.waiting.popleft()
            group.status = RequestStatus.RUNNING
            if group.num_cached_tokens == 0:
                group.num_cached_tokens = group.seqs[0].num_computed_tokens
            self._insert_running(group)
            for seq, n in admitted:
                if n:
                    self._schedule_seq(plan, group, seq, seq.num_computed_tokens, n)
        if self.tiers is not None:
            self.tiers.release_admission()

    def _ignore(self, group: SequenceGroup, plan: _StepPlan) -> None:
        self._end(group, "length")
        plan.ignored.append(group)

    def _end(self, group: SequenceGroup, reason: str) -> None:
        """Finish the group's unfinished sequences with ``reason`` and free all its blocks."""
        for seq in group.unfinished_seqs():
            seq.finish_reason = reason
        self._finish_group(group)

    def _insert_running(self, group: SequenceGroup) -> None:
        bisect.insort(self.running, group, key=_arrival)

    # -- after the model ran ------------------------------------------------------------------
    def update(self, output: SchedulerOutput) -> None:
        """Record that the scheduled tokens' KV is now computed."""
        for item in output.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens

    def fork(self, group: SequenceGroup) -> list[Sequence]:
        """Split a group's single sequence into ``n`` that share its blocks (after its prompt)."""
        parent = group.seqs[0]
        return [self.fork_seq(group, parent) for _ in range(len(group.seqs), group.sampling_params.n)]

    def fork_seq(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new beam continuing ``parent``: it shares every block of it; whichever of the two writes into the
        shared last, partial block first copies it (copy-on-write at its next ``allocate_slots``)."""
        child = parent.fork(len(group.seqs))
        self.block_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """A beam that no continuation extends: it leaves the group and its private blocks are free at once
        (blocks it shares stay with the other holders)."""
        self.block_manager.free(seq)
        group.seqs.remove(seq)

    def finish_group(self, group: SequenceGroup) -> None:
        """End a running group whose sequences hold no blocks any more (a beam search that is done)."""
        if group in self.running:
            self.running.remove(group)
        self._finish_group(group)

    def finish_seq(self, group: SequenceGroup, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if all(s.is_finished for s in group.seqs) and not group.needs_fork:
            self.finish_group(group)

    def _finish_group(self, group: SequenceGroup) -> None:
        self.block_manager.free_group(group)
        group.status = RequestStatus.FINISHED
        if self.tiers is not None:
            self.tiers.forget(group.request_id)

    # -- numbers ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            kv_blocks_total=bm.device.num_blocks, kv_blocks_free=bm.device.num_free,
            kv_blocks_cached=bm.device.num_cached_free, cpu_blocks_total=bm.cpu.num_blocks,
            cpu_blocks_free=bm.cpu.num_free, prefix_cache_queried_tokens=bm.prefix_queried_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens, preemptions_swap=self.num_preemptions["swap"],
            preemptions_recompute=self.num_preemptions["recompute"], requests_running=len(self.running),
            requests_waiting=len(self.waiting) + len(self.loading), requests_swapped=len(self.swapped),
            max_waiting=self.config.max_waiting)
