"""GPUWorkerActor: executes StepPlans on the model and answers each with a StepResult.

The shell around ModelRunner (actors/model_runner.py). The forward pass runs in a worker thread so
this actor's event loop keeps heartbeating and receiving while the device computes; plans are still
executed strictly one at a time, in order, because the runner's per-sequence state depends on it.
"""

from __future__ import annotations

import asyncio
import logging

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.model_runner import ModelRunner
from flotilla.config import EngineConfig
from flotilla.transport.messages import KVCacheInfoEvent, Message, StepPlan, StepResult

log = logging.getLogger(__name__)

_LOCAL_RUNNERS: dict[tuple[str, int], ModelRunner] = {}
"""Runners of this process by (worker actor name, rank): actors of the worker's process group (the
KV-migration actor) reach the KV cache memory through here, never over a socket."""


def local_runner(worker: str, rank: int = 0) -> ModelRunner | None:
    """The ModelRunner of worker actor `worker`, rank `rank`, if it lives in this process and has loaded."""
    return _LOCAL_RUNNERS.get((worker, rank))


class GPUWorkerActor(Actor):
    """One model replica (rank) of an engine."""

    kind = "worker"
    inbox = (StepPlan,)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.runner: ModelRunner | None = None

    async def setup(self) -> dict[str, str]:
        # loading blocks for seconds: keep the loop (and so the ready handshake's timing) honest
        self.runner = await asyncio.to_thread(ModelRunner, self.config)
        r = self.runner
        _LOCAL_RUNNERS[(self.ctx.name, self.ctx.instance)] = r
        await self.send(self.scheduler, KVCacheInfoEvent(rank=self.ctx.instance, num_blocks=r.num_blocks,
                                                         block_size=r.block_size, max_model_len=r.max_model_len))
        return {"model": r.loaded.model_dir.name, "device": str(r.device), "dtype": str(r.dtype).removeprefix("torch."),
                "kv_tokens": str(r.capacity_tokens), "attention": r.model.attention_backend_name,
                "load_s": f"{r.load_seconds:.2f}"}

    async def teardown(self) -> None:
        _LOCAL_RUNNERS.pop((self.ctx.name, self.ctx.instance), None)
        await super().teardown()

    async def on_step_plan(self, plan: StepPlan) -> None:
        assert self.runner is not None
        result = await asyncio.to_thread(self.runner.execute, plan)
        await self.send(self.scheduler, result)

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        # the scheduler must not wait forever for a step that failed: fail the step's requests instead
        if isinstance(msg, StepPlan):
            await self.send(self.scheduler, StepResult(step=msg.step, error=f"{type(exc).__name__}: {exc}"))
