"""SchedulerActor: the I/O shell around the batching policy (actors/batching.py).

It admits TokenizedRequests, plans a step whenever none is in flight, sends the StepPlan to every
worker rank, applies the StepResult (stop checks, freeing blocks) and pushes one TokenDelta per step
to the detokenizer. Nothing is admitted before the workers reported their KV cache (KVCacheInfoEvent);
requests arriving earlier wait in order.
"""

from __future__ import annotations

import logging
import time

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.config import EngineConfig
from flotilla.transport.messages import (
    AbortCmd,
    KVCacheInfoEvent,
    Message,
    RequestFailedEvent,
    SchedulerStatsEvent,
    SeqTokens,
    StepPlan,
    StepResult,
    TokenDelta,
    TokenizedRequest,
)

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1
"""Most frequent SchedulerStatsEvent while busy, seconds."""


class SchedulerActor(Actor):
    """Continuous batching for one engine."""

    kind = "scheduler"
    inbox = (TokenizedRequest, AbortCmd, StepResult, KVCacheInfoEvent)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.workers = str(ctx.config.get("workers", "worker"))
        self.detokenizer = str(ctx.config.get("detokenizer", "detokenizer"))
        self.frontend = str(ctx.config.get("frontend", "frontend"))
        self.num_ranks = len(ctx.endpoints.instances(self.workers))
        self.core: BatchScheduler | None = None
        self._kv_info: dict[int, KVCacheInfoEvent] = {}
        self._early: list[TokenizedRequest | AbortCmd] = []
        self._inflight: dict[int, StepPlan] = {}
        self._max_inflight = self.config.scheduler.max_steps_in_flight
        self._stats_at = 0.0

    async def on_kv_cache_info_event(self, ev: KVCacheInfoEvent) -> None:
        self._kv_info[ev.rank] = ev
        if len(self._kv_info) < self.num_ranks or self.core is not None:
            return
        num_blocks = min(e.num_blocks for e in self._kv_info.values())
        max_len = min(e.max_model_len for e in self._kv_info.values())
        blocks = BlockManager(num_blocks, ev.block_size, enable_prefix_caching=self.config.cache.enable_prefix_caching)
        self.core = BatchScheduler(self.config.scheduler, blocks, max_len)
        log.info("scheduler: %d KV blocks x %d tokens, max_model_len %d", num_blocks, ev.block_size, max_len)
        await self._stats()
        early, self._early = self._early, []
        for msg in early:
            await (self.on_tokenized_request(msg) if isinstance(msg, TokenizedRequest) else self.on_abort_cmd(msg))

    async def on_tokenized_request(self, req: TokenizedRequest) -> None:
        if self.core is None:
            self._early.append(req)
            return
        if not self.core.add(req):
            await self.send(self.frontend, RequestFailedEvent(
                rid=req.rid, status=429, code="rate_limit_exceeded",
                message=f"the engine has {self.core.num_waiting} requests waiting; retry later"))
            return
        await self._step()

    async def on_abort_cmd(self, msg: AbortCmd) -> None:
        if self.core is None:
            self._early = [m for m in self._early if not (isinstance(m, TokenizedRequest) and m.rid == msg.rid)]
            return
        delta = self.core.abort(msg.rid)
        await self._emit([delta] if delta is not None else [])
        await self._step()

    async def on_step_result(self, result: StepResult) -> None:
        assert self.core is not None
        if self._inflight.pop(result.step, None) is None:
            log.warning("scheduler: result of step %d was not expected; ignored", result.step)
            return
        if result.error is not None:
            log.error("scheduler: step %d failed in the worker: %s", result.step, result.error)
        deltas = self.core.update(result)
        await self._step()  # the worker gets its next plan before the detokenizer gets this step's tokens
        await self._emit(deltas)

    async def _step(self) -> None:
        """Plan and send steps until max_steps_in_flight are out or there is nothing to run."""
        while self.core is not None and len(self._inflight) < self._max_inflight:
            plan = self.core.schedule()
            if plan is None:
                return
            self._inflight[plan.step] = plan
            for rank in range(self.num_ranks):
                await self.send(self.workers, plan, instance=rank)

    async def _emit(self, deltas: list[SeqTokens]) -> None:
        if deltas:
            await self.send(self.detokenizer, TokenDelta(items=deltas))
        await self._stats()

    async def _stats(self) -> None:
        """State for /metrics: at most every STATS_INTERVAL_S while busy, and always when the engine idles."""
        core = self.core
        assert core is not None
        now = time.monotonic()
        idle = not core.seqs
        if not idle and now - self._stats_at < STATS_INTERVAL_S:
            return
        self._stats_at = now
        blocks = core.blocks
        self.send_nowait(self.frontend, SchedulerStatsEvent(
            num_running=len(core.running), num_waiting=core.num_waiting, kv_usage=blocks.usage,
            prefix_cache_hit_rate=blocks.prefix_cache_hit_rate, num_preemptions=core.num_preemptions,
            kv_capacity_tokens=blocks.num_blocks * blocks.block_size))

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        if isinstance(msg, TokenizedRequest):
            await self.send(self.frontend, RequestFailedEvent(rid=msg.rid, status=500,
                                                              message=f"scheduler failed: {type(exc).__name__}: {exc}"))
