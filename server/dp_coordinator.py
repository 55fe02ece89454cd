"""The data-parallel coordinator of one engine (pure, no sockets): which DP rank takes the next request, and
the ranks' reports summed up for /metrics.

An engine with data_parallel_size > 1 runs one scheduler per rank (actors/data_parallel.py). The front end
(EngineClient) asks `DPCoordinator.pick` for each new engine request: the rank with the fewest requests of
this front end still unfinished there, then the one whose KV cache is least used, then the lowest rank.
The front end's own count is exact at the moment of the choice (a scheduler's report lags by up to
STATS_INTERVAL_S), so a burst spreads evenly; the reported KV usage breaks ties in favour of the rank with
shorter sequences. (vLLM's DP coordinator balances on the engines' reported waiting and running counts
plus what it sent since; the idea is the same.)

`ExpertLoads` keeps each rank's latest per-expert token counts under expert parallelism and sums them:
the whole load of every expert, per MoE layer — what an expert-placement load balancer (EPLB) reads.
"""

from __future__ import annotations

import logging

import numpy as np

from flotilla.transport.messages import ExpertLoadEvent, SchedulerStatsEvent

log = logging.getLogger(__name__)


class DPCoordinator:
    """Least-loaded choice among the data-parallel ranks of one engine."""

    def __init__(self, dp_size: int) -> None:
        if dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        self.dp_size = dp_size
        self.unfinished = [0] * dp_size
        """Requests given to each rank that have not ended."""
        self.assigned = [0] * dp_size
        """Requests given to each rank since start."""
        self.stats: list[SchedulerStatsEvent | None] = [None] * dp_size
        """Each rank's latest scheduler report."""

    def load(self, rank: int) -> tuple[int, float]:
        """What `pick` minimises: (unfinished requests, reported KV usage)."""
        stats = self.stats[rank]
        return self.unfinished[rank], stats.kv_usage if stats is not None else 0.0

    def pick(self) -> int:
        """The least loaded rank; it counts the request as given to that rank until `finished`."""
        rank = min(range(self.dp_size), key=lambda r: (*self.load(r), r))
        self.unfinished[rank] += 1
        self.assigned[rank] += 1
        return rank

    def finished(self, rank: int) -> None:
        """A request given to `rank` ended (finished, failed or aborted)."""
        self.unfinished[rank] -= 1

    def observe(self, stats: SchedulerStatsEvent) -> None:
        """A rank's scheduler reported; a report from a rank the engine does not have is dropped (logged)."""
        if not 0 <= stats.dp_rank < self.dp_size:
            log.warning("stats from data-parallel rank %d of an engine with %d ranks ignored", stats.dp_rank,
                        self.dp_size)
            return
        self.stats[stats.dp_rank] = stats

    def total_stats(self) -> SchedulerStatsEvent | None:
        """The ranks' latest reports as one engine's (None before any report)."""
        return sum_stats([s for s in self.stats if s is not None])


def sum_stats(stats: list[SchedulerStatsEvent]) -> SchedulerStatsEvent | None:
    """Several schedulers' state as one: counts and capacities summed, KV usage and hit rate averaged."""
    if not stats:
        return None
    if len(stats) == 1:
        return stats[0]
    n = len(stats)
    return SchedulerStatsEvent(
        num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
        kv_usage=sum(s.kv_usage for s in stats) / n,
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
        num_preemptions=sum(s.num_preemptions for s in stats),
        kv_capacity_tokens=sum(s.kv_capacity_tokens for s in stats),
        num_transfers=sum(s.num_transfers for s in stats),
        kv_migrated_bytes=sum(s.kv_migrated_bytes for s in stats),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in stats),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in stats))


class ExpertLoads:
    """The ranks' per-expert token counts (ExpertLoadEvent), summed."""

    def __init__(self) -> None:
        self.by_rank: dict[int, np.ndarray] = {}
        """Each rank's latest int64 [num_moe_layers, num_experts] counts."""

    def observe(self, ev: ExpertLoadEvent) -> None:
        self.by_rank[ev.dp_rank] = np.asarray(ev.expert_tokens, dtype=np.int64)

    def total(self) -> np.ndarray | None:
        """int64 [num_moe_layers, num_experts]: tokens routed to each expert since start, all ranks (None
        before any report)."""
        if not self.by_rank:
            return None
        return np.sum(list(self.by_rank.values()), axis=0)
