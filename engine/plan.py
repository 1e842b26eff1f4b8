"""The step plan: what the scheduler (policy) hands the runner (mechanism) each step, as data only.

Kept apart from the scheduler so the runner depends on the plan's shape, never on the policy that
made it (vLLM v1 keeps its ``SchedulerOutput`` apart the same way). No torch, no logic beyond
derived properties.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Sequence, SequenceGroup


@dataclass(frozen=True)
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    start: int  # first position computed this step
    num_new_tokens: int
    # How the sequence's block table changed since it was last scheduled: its entries from ``table_start``
    # on are ``new_blocks`` (blocks appended, the copy-on-write of the last one, or a whole new table).
    table_start: int
    new_blocks: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, whose logits pick the next."""
        return self.start + self.num_new_tokens == self.seq.num_tokens

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def new_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_new_tokens]

    def planned(self) -> PlannedSeq:
        return PlannedSeq(self.seq_id, self.start, self.num_new_tokens, self.table_start, self.new_blocks,
                          tuple(self.new_token_ids), self.samples)


@dataclass(frozen=True)
class PlannedSeq:
    """A scheduled sequence as plain data, without the request behind it: what the step plan sent to the
    other tensor-parallel ranks carries (they hold no requests)."""

    seq_id: int
    start: int
    num_new_tokens: int
    table_start: int
    new_blocks: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    samples: bool


# What the runner reads of one scheduled sequence: a ``ScheduledSeq`` on the scheduler's rank, a
# ``PlannedSeq`` on the other tensor-parallel ranks.
StepSeq = ScheduledSeq | PlannedSeq


@dataclass(frozen=True)
class TierPlan:
    """Block moves between the device pool and the KV tiers under it (engine.kv_tiers), in the order the
    engine runs them: ``spill`` copies host blocks to the disk tier before ``offload`` overwrites them with
    blocks the device pool evicted this step; ``load`` brings host blocks back into device blocks after
    the offloads (and swaps) have read whatever those device blocks held before."""

    spill: tuple[tuple[int, bytes, tuple[int, ...]], ...] = ()  # (host block, hash, token ids)
    offload: tuple[tuple[int, int], ...] = ()  # (device, host)
    load: tuple[tuple[int, int], ...] = ()  # (host, device)

    @property
    def is_empty(self) -> bool:
        return not (self.spill or self.offload or self.load)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...] = ()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()  # (device, cpu)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()  # (cpu, device)
    blocks_to_copy: tuple[tuple[int, int], ...] = ()  # (src, dst) on device
    preempted: tuple[str, ...] = ()
    # Requests that can never fit in the pool (even alone); finished with reason "length".
    ignored: tuple[SequenceGroup, ...] = ()
    tiers: TierPlan = TierPlan()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy
                    or not self.tiers.is_empty)


__all__ = ["PlannedSeq", "ScheduledSeq", "SchedulerOutput", "StepSeq", "TierPlan"]
