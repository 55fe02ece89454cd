"""GPUWorkerActor: executes StepPlans on the model and answers each with a StepResult.

The shell around ModelRunner (actors/model_runner.py). Every runner call happens on one thread of its
own, in arrival order (the runner's per-sequence state depends on it), so this actor's event loop keeps
heartbeating and receiving while the host stages a step. A plan is launched as soon as it arrives; a
completer task waits (on another thread) for the oldest launched step's results to reach the host and
sends its StepResult. So while the device runs step N the next plan is already being staged and queued
behind it, and results still leave strictly in step order.

Tensor parallelism: the engine runs one worker instance per rank (instance = rank), each in its own
process, all given every plan by the scheduler. Each joins the group at the rendezvous address in its actor
config (`dist_init_method`, chosen by the engine) before building its share of the model, reports its KV
cache (the scheduler takes the smallest), and runs every step in lockstep with the others through the
model's collectives. Only rank 0 sends StepResults: the ranks hold the same tokens (rank 0 samples and
broadcasts), and its result implies the others finished the step's collectives too. A step that fails on
one rank cannot be repaired (the ranks' collectives would no longer line up), so it stops the worker and
the supervisor takes the engine down instead of letting the other ranks hang.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.model_runner import ModelRunner
from flotilla.actors.step_trace import StepTrace
from flotilla.config import EngineConfig
from flotilla.models.parallel import destroy_tensor_parallel
from flotilla.transport.messages import KVCacheInfoEvent, StepPlan, StepResult

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
        self.rank = ctx.instance
        self.tp_size = self.config.parallel.tensor_parallel_size
        if self.tp_size > 1 and len(ctx.endpoints.instances(ctx.name)) != self.tp_size:
            raise ValueError(f"tensor_parallel_size {self.tp_size} needs as many {ctx.name} instances, the topology "
                             f"has {len(ctx.endpoints.instances(ctx.name))}")
        self.runner: ModelRunner | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{ctx.name}{ctx.instance}-runner")
        self._completer: asyncio.Task | None = None
        self._trace = StepTrace.from_env(self.rank)  # FLOTILLA_STEP_TRACE: a per-step timeline (actors/step_trace.py)

    async def setup(self) -> dict[str, str]:
        # loading blocks for seconds: keep the loop (and so the ready handshake's timing) honest
        load = functools.partial(ModelRunner, self.config, rank=self.rank,
                                 dist_init_method=self.ctx.config.get("dist_init_method"))
        self.runner = await asyncio.get_running_loop().run_in_executor(self._thread, load)
        r = self.runner
        _LOCAL_RUNNERS[(self.ctx.name, self.ctx.instance)] = r
        await self.send(self.scheduler, KVCacheInfoEvent(rank=self.ctx.instance, num_blocks=r.num_blocks,
                                                         block_size=r.block_size, max_model_len=r.max_model_len))
        return {"model": r.loaded.model_dir.name, "device": str(r.device), "dtype": str(r.dtype).removeprefix("torch."),
                "kv_tokens": str(r.capacity_tokens), "kv_dtype": str(r.kv_dtype).removeprefix("torch."),
                "attention": r.model.attention_backend_name,
                "fused_ops": r.model.fused_ops_name, "moe": getattr(r.model, "moe_backend_name", "-"),
                "tp": f"{self.rank}/{self.tp_size}", "load_s": f"{r.load_seconds:.2f}"}

    async def teardown(self) -> None:
        _LOCAL_RUNNERS.pop((self.ctx.name, self.ctx.instance), None)
        if self._completer is not None:
            self._completer.cancel()
        if self.tp_size > 1:
            self._thread.submit(destroy_tensor_parallel)
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self._trace is not None:
            self._trace.close()
        await super().teardown()

    async def on_step_plan(self, plan: StepPlan) -> None:
        runner = self.runner
        assert runner is not None
        if self._trace is not None:
            self._trace.arrived(plan)
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, runner.launch, plan)
            if self._trace is not None:
                self._trace.launched(plan.step)
        except Exception as exc:  # actor boundary: the step fails, queued in order behind the earlier ones
            log.exception("worker: step %d failed", plan.step)
            runner.fail(plan.step, f"{type(exc).__name__}: {exc}")
            self._fatal_under_tp(plan.step, exc)
        if self._completer is None or self._completer.done():
            self._completer = asyncio.create_task(self._complete(), name=f"{self.ctx.name}-completer")

    async def _complete(self) -> None:
        """Send launched steps' results, oldest first, as the device finishes them."""
        runner = self.runner
        loop = asyncio.get_running_loop()
        while runner.num_pending:
            step, event = runner.oldest()
            if event is not None and not event.query():
                await asyncio.to_thread(event.synchronize)  # not on the runner's thread: it stages the next step
            try:
                result = await loop.run_in_executor(self._thread, runner.finish_oldest)
            except Exception as exc:  # actor boundary
                log.exception("worker: step %d failed", step)
                result = StepResult(step=step, error=f"{type(exc).__name__}: {exc}")
                self._fatal_under_tp(step, exc)
            if self._trace is not None:
                self._trace.done(step)
            if self.rank == 0:
                await self.send(self.scheduler, result)

    def _fatal_under_tp(self, step: int, exc: Exception) -> None:
        """With tensor parallelism a failed step leaves the ranks out of step: stop, so the engine goes down."""
        if self.tp_size > 1:
            log.critical("worker rank %d of %d: step %d failed (%s: %s); the ranks cannot continue in lockstep, "
                         "stopping", self.rank, self.tp_size, step, type(exc).__name__, exc)
            self.request_stop(f"step {step} failed under tensor parallelism")
