"""Data parallelism x expert parallelism: what the scheduler and the workers of one data-parallel rank add.

An engine with data_parallel_size = D runs D schedulers (scheduler instance d) and D x tensor_parallel_size
workers (worker instance d * tp + t is TP rank t of DP rank d); one tokenizer and one detokenizer serve all
ranks, and the front end's coordinator (server/dp_coordinator.py) gives each request to one rank.

Without expert parallelism the ranks are independent replicas (a MoE model keeps every expert on every
rank). With enable_expert_parallel the D x tp workers form one expert-parallel group: each keeps num_experts /
(D x tp) experts (models/qwen3_moe.py; with tp > 1 each TP rank sends its share of its DP rank's tokens) and
every forward runs the MoE layers' all-to-alls across all of them. So every
rank must run exactly as many forwards as the others, in step (vLLM's DP engine cores run a dummy batch
when idle for the same reason):

- `StepLockstep` (in each scheduler) counts the steps its rank sent; a rank that sends more than any other
  so far announces its count to the other ranks' schedulers (DPStepsEvent), and a rank behind that count
  sends steps until it catches up: real ones when it has work, empty ones (negative step numbers, no
  sequences) when it has none. Steps pair up by their order on each rank, not by their numbers.
- the worker runs an empty step of an expert-parallel model as `empty_forward` (actors/data_parallel_worker.py,
  the worker's side, which imports torch; this module stays light for the scheduler): each MoE layer takes
  part in its all-to-alls with no tokens, in layer order, which is exactly the collectives a real forward runs.

Nothing deadlocks on the in-flight limit: a rank's step n waits only for the other ranks' step n, and each
rank sends its step n once its own earlier steps (already paired) have come back.
"""

from __future__ import annotations

import itertools

from flotilla.transport.messages import StepPlan


class StepLockstep:
    """A data-parallel rank's step count against the other ranks' (pure: the scheduler actor sends)."""

    def __init__(self) -> None:
        self.sent = 0
        """Steps this rank sent its workers."""
        self.peak = 0
        """The most steps any other rank announced."""
        self._empty_steps = itertools.count(-1, -1)

    @property
    def owed(self) -> bool:
        """Another rank is ahead: this one must send steps (empty if it has nothing to run)."""
        return self.sent < self.peak

    def on_peer(self, num_steps: int) -> None:
        """Another rank announced how many steps it sent."""
        self.peak = max(self.peak, num_steps)

    def count_sent(self) -> int | None:
        """One more step sent; the count to announce to the other ranks when this rank is now ahead of all."""
        self.sent += 1
        return self.sent if self.sent > self.peak else None

    def empty_plan(self) -> StepPlan:
        """A step without sequences (numbered below zero: the batching policy's steps count up from 0)."""
        return StepPlan(step=next(self._empty_steps))

    @staticmethod
    def is_empty_step(step: int) -> bool:
        return step < 0
