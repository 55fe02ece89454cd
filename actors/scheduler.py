"""SchedulerActor: the I/O shell around the batching policy (actors/batching.py).

It admits TokenizedRequests, plans a step whenever none is in flight, sends the StepPlan to every
worker rank, applies the StepResult (stop checks, freeing blocks) and pushes one TokenDelta per step
to the detokenizer. Nothing is admitted before the workers reported their KV cache (KVCacheInfoEvent);
requests arriving earlier wait in order.

Roles (EngineConfig.disagg.role): a colocated engine runs BatchScheduler; a prefill engine runs
PrefillBatchScheduler and a decode engine DecodeBatchScheduler (actors/disagg.py). For a disaggregated
request the shell routes what those policies put in their outbox: KVReadyEvent to the decode engine's
scheduler, BlocksReleasedEvent back to the prefill engine's, MigrateKVCmd to this engine's KV-migration
actors (one per worker rank; every rank reports MigrationDoneEvent and the policy hears of the migration
once all have). The peer's addresses come with the request (TokenizedRequest.peer).

Data parallelism: scheduler instance d is data-parallel rank d's, planning for its own workers (instances
d * tp .. d * tp + tp - 1). Under expert parallelism the ranks' steps must pair up (actors/data_parallel.py):
a rank ahead of the others announces its step count (DPStepsEvent) and a rank behind sends steps, empty ones
when it has nothing to run, until it has caught up.
"""

from __future__ import annotations

import logging
import time

from flotilla.actors.base import Actor, ActorContext
import msgspec
import numpy as np

from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.actors.data_parallel import StepLockstep
from flotilla.actors.disagg import DecodeBatchScheduler, PrefillBatchScheduler
from flotilla.config import EngineConfig
from flotilla.transport.messages import (
    AbortCmd,
    BlocksReleasedEvent,
    DPStepsEvent,
    EncodeImagesCmd,
    ImagesEncodedEvent,
    KVCacheInfoEvent,
    KVReadyEvent,
    Message,
    MigrateKVCmd,
    MigrationDoneEvent,
    RequestFailedEvent,
    SchedulerStatsEvent,
    SeqTokens,
    StepPlan,
    StepResult,
    TokenDelta,
    TokenizedRequest,
    TransferPeer,
)

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1
"""Most frequent SchedulerStatsEvent while busy, seconds."""


class SchedulerActor(Actor):
    """Continuous batching for one engine."""

    kind = "scheduler"
    inbox = (TokenizedRequest, AbortCmd, StepResult, KVCacheInfoEvent, KVReadyEvent, MigrationDoneEvent,
             BlocksReleasedEvent, DPStepsEvent, ImagesEncodedEvent)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.workers = str(ctx.config.get("workers", "worker"))
        self.detokenizer = str(ctx.config.get("detokenizer", "detokenizer"))
        self.frontend = str(ctx.config.get("frontend", "frontend"))
        self.dp_rank, self.dp_size = ctx.instance, self.config.parallel.data_parallel_size
        self.num_ranks = len(ctx.endpoints.instances(self.workers)) // self.dp_size
        """Worker ranks of this data-parallel rank (its tensor-parallel ranks)."""
        self.first_worker = self.dp_rank * self.num_ranks
        """Worker instance of this rank's TP rank 0."""
        self.lockstep = StepLockstep() if self.config.parallel.expert_parallel_size > 1 else None
        """Under expert parallelism: this rank's step count against the other data-parallel ranks'."""
        self.core: BatchScheduler | None = None
        self._length_limit: str | None = None
        """What brought the engine's max_model_len below the model's (the KV cache's size, the step budget), if any."""
        self._kv_info: dict[int, KVCacheInfoEvent] = {}
        self._early: list[Message] = []
        self._inflight: dict[int, StepPlan] = {}
        # speculative decoding plans a decode once it knows how many drafts the last step accepted, or one step
        # ahead where the workers correct that on the device (on_kv_cache_info_event)
        sched = self.config.scheduler
        self._max_inflight = 1 if sched.speculative_config else sched.max_steps_in_flight
        self._stats_at = 0.0
        self.role = self.config.disagg.role
        self.engine_id = str(ctx.config.get("engine_id", "engine"))
        self.kv_migration = str(ctx.config.get("kv_migration", "kv_migration"))
        self._peers: dict[str, TransferPeer] = {}  # transfer id -> the other engine, until BlocksReleased
        self._done: dict[str, list[MigrationDoneEvent]] = {}  # transfer id -> reports of the ranks so far
        self.kv_migrated_bytes = 0
        self.encoders = str(ctx.config.get("encoders", ""))
        """The encoder actors beside the workers (worker.image_encoder = actor); empty: the steps encode images."""
        self._encoding: dict[str, tuple[TokenizedRequest, set[int]]] = {}  # rid -> its request, ranks still encoding

    async def on_kv_cache_info_event(self, ev: KVCacheInfoEvent) -> None:
        self._kv_info[ev.rank] = ev
        if len(self._kv_info) < self.num_ranks or self.core is not None:
            return
        num_blocks = min(e.num_blocks for e in self._kv_info.values())
        max_len = min(e.max_model_len for e in self._kv_info.values())
        # A sequence longer than the engine can run (SchedulerConfig.length_limit) could never be scheduled and would
        # wait for good: the engine's max_model_len comes down to that, sequences end there ("length"), and a prompt
        # that reaches it is refused (on_tokenized_request). vLLM refuses to start instead.
        sched = self.config.scheduler
        limit, self._length_limit = sched.length_limit(max_len, num_blocks * ev.block_size)
        if self._length_limit is not None:
            log.warning("%s, fewer than max_model_len %d: sequences end at %d tokens and longer prompts are refused "
                        "(raise kv_cache_blocks / gpu_memory_utilization / max_num_batched_tokens, or lower "
                        "max_model_len)", self._length_limit, max_len, limit)
            max_len = limit
        prefix_caching = self.config.cache.enable_prefix_caching
        slots = min(e.num_state_slots for e in self._kv_info.values())
        snapshots = min(e.num_state_snapshots for e in self._kv_info.values())
        if slots:  # a hybrid model: one state slot per running sequence; prefix hits and transfers use snapshots
            if prefix_caching and not snapshots:
                log.info("prefix caching is off: the model's linear-attention layers keep a recurrent state, which is "
                         "valid at one position only, and num_state_snapshots is 0")
                prefix_caching = False
            if self.role != "both" and not snapshots:
                raise RuntimeError("a disaggregated engine of a model with recurrent state moves each prompt's state "
                                   "through a snapshot slot: num_state_snapshots must be at least 1")
            if slots < sched.max_num_seqs:  # (the workers size their slots by max_num_seqs)
                raise RuntimeError(f"the workers hold recurrent state for {slots} sequences, fewer than max_num_seqs "
                                   f"{sched.max_num_seqs}")
        blocks = BlockManager(num_blocks, ev.block_size, enable_prefix_caching=prefix_caching,
                              recompute_last_hit=self.config.scheduler.speculative_config is not None,
                              num_state_snapshots=snapshots if slots else 0)
        if self.role == "prefill":
            self.core = PrefillBatchScheduler(self.config.scheduler, blocks, max_len, engine=self.engine_id)
        elif self.role == "decode":
            self.core = DecodeBatchScheduler(self.config.scheduler, blocks, max_len)
        else:
            self.core = BatchScheduler(self.config.scheduler, blocks, max_len)
        if sched.speculative_config is not None and self.lockstep is None and sched.max_steps_in_flight > 1 \
                and all(e.plans_ahead for e in self._kv_info.values()):
            self.core.plan_ahead = True
            self._max_inflight = 2
        log.info("scheduler (%s, role %s): %d KV blocks x %d tokens, max_model_len %d", self.engine_id, self.role,
                 num_blocks, ev.block_size, max_len)
        await self._stats()
        early, self._early = self._early, []
        for msg in early:
            await getattr(self, self._handlers[type(msg)])(msg)

    async def on_tokenized_request(self, req: TokenizedRequest) -> None:
        if self.core is None:
            self._early.append(req)
            return
        if self.encoders and req.images:  # its prefill starts once every rank's encoder has its images ready
            ranks = set(range(self.first_worker, self.first_worker + self.num_ranks))
            self._encoding[req.rid] = (req, ranks)
            for rank in sorted(ranks):
                cmd = EncodeImagesCmd(rid=req.rid, images=req.images, vision_encoder=req.vision_encoder)
                await self.send(self.encoders, cmd, instance=rank)
            return
        await self._accept(req)

    async def on_images_encoded_event(self, ev: ImagesEncodedEvent) -> None:
        entry = self._encoding.get(ev.rid)
        if entry is None:  # aborted meanwhile: the abort released the other ranks, this one encoded after it
            await self.send(self.encoders, EncodeImagesCmd(rid=ev.rid), instance=ev.rank)
            return
        req, ranks = entry
        if ev.error is not None:
            del self._encoding[ev.rid]
            await self._release_images(ev.rid, ranks - {ev.rank})
            await self.reply(req.reply_to, RequestFailedEvent(rid=req.rid, status=ev.status, message=ev.error))
            return
        ranks.discard(ev.rank)
        if not ranks:
            del self._encoding[ev.rid]
            await self._accept(req)

    async def _release_images(self, rid: str, ranks: set[int]) -> None:
        for rank in sorted(ranks):
            await self.send(self.encoders, EncodeImagesCmd(rid=rid), instance=rank)

    async def _accept(self, req: TokenizedRequest) -> None:
        """A request ready to schedule: checked against what the engine runs, then queued."""
        assert self.core is not None
        if req.transfer_id is not None:
            if self.role == "both" or req.peer is None:
                await self.reply(req.reply_to, RequestFailedEvent(
                    rid=req.rid, status=400, message=f"engine {self.engine_id} (role {self.role}) cannot take a "
                                                     "disaggregated request" + ("" if req.peer else " without a peer")))
                return
            if self.core.released_before_arrival(req.transfer_id):
                log.info("scheduler %s: request %s dropped: its transfer was released before it arrived (the other "
                         "engine died)", self.engine_id, req.rid)
                return
            self._peers[req.transfer_id] = req.peer
        if len(req.prompt_ids) >= self.core.max_model_len:  # only under a _length_limit (the tokenizer checks the rest)
            await self.reply(req.reply_to, RequestFailedEvent(
                rid=req.rid, status=400, param="prompt", code="context_length_exceeded",
                message=f"Engine {self.engine_id} runs sequences of at most {self.core.max_model_len} tokens "
                        f"({self._length_limit or 'max_model_len'}). However, your prompt has "
                        f"{len(req.prompt_ids)} tokens, which leaves no room for output. Please shorten the prompt."))
            if req.transfer_id is not None:
                self._refused(req, f"prompt longer than it can run ({self._length_limit or 'max_model_len'})")
                await self._route()
            return
        if not self.core.add(req):
            await self.reply(req.reply_to, RequestFailedEvent(
                rid=req.rid, status=429, code="rate_limit_exceeded",
                message=f"the engine has {self.core.num_waiting} requests waiting; retry later"))
            if req.transfer_id is not None:
                self._refused(req)
                await self._route()
            return
        await self._route()
        if isinstance(self.core, DecodeBatchScheduler) and self.core.ended:
            ended, self.core.ended = self.core.ended, []
            await self._emit(ended)
        await self._step()

    def _refused(self, req: TokenizedRequest, why: str = "queue full") -> None:
        """A disaggregated request refused here: the other side must not wait for it."""
        if isinstance(self.core, PrefillBatchScheduler):
            self.core.outbox.append(KVReadyEvent(
                transfer_id=req.transfer_id, block_ids=np.zeros(0, np.int32), num_tokens=0, first_token=-1,
                src_engine=self.engine_id, error=f"prefill engine {self.engine_id} refused it: {why}"))
        elif isinstance(self.core, DecodeBatchScheduler):
            self.core.refuse(req.transfer_id)

    # ---- disaggregation: messages between the two engines' schedulers and the migration actors ----------

    async def on_kv_ready_event(self, ev: KVReadyEvent) -> None:
        if self.core is None:
            self._early.append(ev)
            return
        if not isinstance(self.core, DecodeBatchScheduler):
            log.warning("scheduler %s (role %s): KVReady for %s ignored", self.engine_id, self.role, ev.transfer_id)
            return
        deltas = self.core.on_kv_ready(ev)
        await self._route()
        await self._emit(deltas)
        await self._step()

    async def on_migration_done_event(self, ev: MigrationDoneEvent) -> None:
        if not isinstance(self.core, DecodeBatchScheduler):
            log.warning("scheduler %s (role %s): MigrationDone for %s ignored", self.engine_id, self.role,
                        ev.transfer_id)
            return
        reports = self._done.setdefault(ev.transfer_id, [])
        reports.append(ev)
        if len(reports) < self.num_ranks:
            return
        del self._done[ev.transfer_id]
        self.kv_migrated_bytes += sum(r.num_bytes for r in reports)
        errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
        deltas = self.core.on_migration_done(MigrationDoneEvent(
            transfer_id=ev.transfer_id, error="; ".join(errors) if errors else None))
        await self._route()
        await self._emit(deltas)
        await self._step()

    async def on_blocks_released_event(self, ev: BlocksReleasedEvent) -> None:
        if self.core is None:
            self._early.append(ev)
            return
        self._peers.pop(ev.transfer_id, None)
        if isinstance(self.core, PrefillBatchScheduler):
            self.core.on_blocks_released(ev)
            await self._tell_kv_migration(ev)  # its blocks may no longer be served
        await self._step()
        await self._stats()

    async def _route(self) -> None:
        """Send what the disaggregation policy queued to where it goes."""
        core = self.core
        if not isinstance(core, (PrefillBatchScheduler, DecodeBatchScheduler)) or not core.outbox:
            return
        out, core.outbox = core.outbox, []
        for msg in out:
            if isinstance(msg, MigrateKVCmd):
                peer = self._peers[msg.transfer_id]
                cmd = msgspec.structs.replace(msg, src_kv=peer.kv)
                for rank in range(self.num_ranks):
                    await self.send(self.kv_migration, cmd, instance=rank)
                continue
            # KVReady (prefill -> decode) keeps the peer for the BlocksReleased to come; BlocksReleased ends it
            peer = (self._peers.get if isinstance(msg, KVReadyEvent) else self._peers.pop)(msg.transfer_id, None)
            if peer is None:
                log.warning("scheduler %s: no peer engine known for transfer %s; %s dropped", self.engine_id,
                            msg.transfer_id, type(msg).__name__)
                continue
            if isinstance(msg, KVReadyEvent) and msg.error is None:
                # announced to our KV-migration ranks before the decode side hears of it: they serve only these blocks
                await self._tell_kv_migration(msg)
            await self.send_to(peer.scheduler, msg)

    async def _tell_kv_migration(self, msg: KVReadyEvent | BlocksReleasedEvent) -> None:
        """A transfer's blocks, or their release, to every KV-migration rank of this engine (if it has them)."""
        for rank in range(len(self.ctx.endpoints.instances(self.kv_migration))):
            await self.send(self.kv_migration, msg, instance=rank)

    async def on_abort_cmd(self, msg: AbortCmd) -> None:
        if self.core is None:
            self._early = [m for m in self._early if not (isinstance(m, TokenizedRequest) and m.rid == msg.rid)]
            return
        entry = self._encoding.pop(msg.rid, None)
        if entry is not None:  # its images are still being encoded: the encoders let go of them
            await self._release_images(msg.rid, set(range(self.first_worker, self.first_worker + self.num_ranks)))
            return
        delta = self.core.abort(msg.rid)
        await self._route()
        await self._emit([delta] if delta is not None else [])
        await self._step()

    async def on_dp_steps_event(self, ev: DPStepsEvent) -> None:
        if self.lockstep is None:
            log.warning("scheduler %s: DPStepsEvent from rank %d without expert parallelism; ignored", self.label,
                        ev.dp_rank)
            return
        self.lockstep.on_peer(ev.num_steps)
        await self._step()

    async def on_step_result(self, result: StepResult) -> None:
        if self._inflight.pop(result.step, None) is None:
            log.warning("scheduler: result of step %d was not expected; ignored", result.step)
            return
        if result.error is not None:
            log.error("scheduler: step %d failed in the worker: %s", result.step, result.error)
        if StepLockstep.is_empty_step(result.step):
            await self._step()
            return
        assert self.core is not None
        deltas = self.core.update(result)
        await self._route()  # a prefill hands its KV off as soon as its first token is sampled
        await self._step()  # the worker gets its next plan before the detokenizer gets this step's tokens
        await self._emit(deltas)

    async def _step(self) -> None:
        """Plan and send steps until max_steps_in_flight are out or there is nothing to run."""
        while len(self._inflight) < self._max_inflight:
            plan = self.core.schedule() if self.core is not None else None
            if plan is None:
                if self.lockstep is None or not self.lockstep.owed:
                    return
                plan = self.lockstep.empty_plan()  # another rank is ahead: its MoE all-to-alls wait for ours
            self._inflight[plan.step] = plan
            for rank in range(self.num_ranks):
                await self.send(self.workers, plan, instance=self.first_worker + rank)
            if self.lockstep is not None and (ahead := self.lockstep.count_sent()) is not None:
                for peer in range(self.dp_size):
                    if peer != self.dp_rank:
                        await self.send(self.ctx.name, DPStepsEvent(dp_rank=self.dp_rank, num_steps=ahead),
                                        instance=peer)

    async def _emit(self, deltas: list[SeqTokens]) -> None:
        if deltas:
            await self.send(self.detokenizer, TokenDelta(items=deltas, dp_rank=self.dp_rank))
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
            kv_capacity_tokens=blocks.num_blocks * blocks.block_size, num_transfers=len(self._peers),
            kv_migrated_bytes=self.kv_migrated_bytes, dp_rank=self.dp_rank,
            spec_draft_tokens=core.spec_draft_tokens, spec_accepted_tokens=core.spec_accepted_tokens,
            prefix_cache_queries=blocks.queried_tokens, prefix_cache_hits=blocks.hit_tokens))

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        if isinstance(msg, TokenizedRequest):
            await self.reply(msg.reply_to, RequestFailedEvent(rid=msg.rid, status=500,
                                                              message=f"scheduler failed: {type(exc).__name__}: {exc}"))
