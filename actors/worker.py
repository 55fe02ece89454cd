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

Data parallelism (actors/data_parallel.py, actors/data_parallel_worker.py): worker instance d * tp + t is TP
rank t of data-parallel rank d; it answers rank d's scheduler (scheduler instance d). Under expert parallelism
the data-parallel ranks' workers form one group at `ep_init_method`, each keeping its share of the experts; a
step without sequences (an idle rank keeping in step with busy ones) runs an empty forward through the MoE
layers' all-to-alls, and the per-expert token counts go to the front end every EXPERT_LOAD_INTERVAL_S while
steps run. With one data-parallel rank and tensor parallelism the experts spread over the TP ranks instead
(models/qwen3_moe.py): no group of their own, no empty steps; TP rank 0 reports the counts, as under DP x EP
(every TP rank routes every token, so one rank's counts count each token once). With both (data_parallel_size D,
tensor_parallel_size T, EP) all D x T workers join one world at `ep_init_method`, their TP groups sub-groups of
it (actors/data_parallel_worker.py join_expert_parallel); every TP rank of an idle DP rank runs the empty steps.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from flotilla.actors import data_parallel_worker as dp
from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.model_runner import ModelRunner
from flotilla.actors.step_trace import StepTrace
from flotilla.config import EngineConfig
from flotilla.models.parallel import destroy_expert_parallel, destroy_tensor_parallel
from flotilla.transport.messages import ExpertLoadEvent, KVCacheInfoEvent, StepPlan, StepResult

log = logging.getLogger(__name__)

EXPERT_LOAD_INTERVAL_S = 0.5
"""How often a worker under expert parallelism reports its per-expert token counts while it runs steps."""

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
        self.frontend = str(ctx.config.get("frontend", "frontend"))
        parallel = self.config.parallel
        self.tp_size, self.dp_size = parallel.tensor_parallel_size, parallel.data_parallel_size
        self.dp_rank, self.rank = dp.dp_tp_rank(ctx.instance, self.tp_size)
        """This worker's data-parallel rank (its scheduler's instance) and tensor-parallel rank."""
        ranks = self.tp_size * self.dp_size
        if ranks > 1 and len(ctx.endpoints.instances(ctx.name)) != ranks:
            raise ValueError(f"tensor_parallel_size {self.tp_size} x data_parallel_size {self.dp_size} needs {ranks} "
                             f"{ctx.name} instances, the topology has {len(ctx.endpoints.instances(ctx.name))}")
        self.lockstep = self.tp_size > 1 or parallel.expert_parallel_size > 1
        """A failed step cannot be repaired: the ranks' collectives would no longer line up."""
        self.ep_layers: list = []
        """The model's expert-parallel MoE layers (none without expert parallelism)."""
        self._steps_run = self._steps_reported = 0
        self._reporter: asyncio.Task | None = None
        self.runner: ModelRunner | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{ctx.name}{ctx.instance}-runner")
        self._completer: asyncio.Task | None = None
        self._trace = StepTrace.for_rank(self.config.worker.step_trace, self.rank)  # a per-step timeline
        self._published: set[int] = set()
        """Speculating steps whose results went out before their launch returned (MTPSpeculator.publish)."""
        self._sending: set[asyncio.Task] = set()

    async def setup(self) -> dict[str, str]:
        # loading blocks for seconds: keep the loop (and so the ready handshake's timing) honest
        self.runner = await asyncio.get_running_loop().run_in_executor(self._thread, self._load)
        r = self.runner
        _LOCAL_RUNNERS[(self.ctx.name, self.ctx.instance)] = r
        self.ep_layers = dp.expert_parallel_layers(r.model)
        if self.config.parallel.expert_parallel_size > 1 and not self.ep_layers:
            raise ValueError(f"enable_expert_parallel: {type(r.model).__name__} has no expert-parallel MoE layers "
                             "(built for Qwen3-MoE)")
        if self.ep_layers and self.rank == 0:
            self._reporter = asyncio.create_task(self._report_expert_loads(), name=f"{self.label}-expert-loads")
        if r.spec is not None and self.rank == 0:
            loop = asyncio.get_running_loop()
            r.spec.publish = lambda result: loop.call_soon_threadsafe(self._send_published, result)
        await self.send(self.scheduler, KVCacheInfoEvent(rank=self.rank, num_blocks=r.num_blocks,
                                                         block_size=r.block_size, max_model_len=r.max_model_len,
                                                         num_state_slots=r.num_state_slots,
                                                         num_state_snapshots=r.num_state_snapshots,
                                                         plans_ahead=r.spec is not None and r.spec.defer),
                        instance=self.dp_rank)
        return {"model": r.loaded.model_dir.name, "device": str(r.device), "dtype": str(r.dtype).removeprefix("torch."),
                "kv_tokens": str(r.capacity_tokens), "kv_blocks": str(r.num_blocks), "block_size": str(r.block_size),
                "kv_dtype": str(r.kv_dtype).removeprefix("torch."),
                "state_slots": str(r.num_state_slots),
                "attention": r.model.attention_backend_name, "gdn": getattr(r.model, "gdn_backend_name", "-"),
                "fused_ops": r.model.fused_ops_name, "moe": getattr(r.model, "moe_backend_name", "-"),
                "fp8": getattr(r.model, "fp8_backend_name", None) or "-",
                "tp": f"{self.rank}/{self.tp_size}", "load_s": f"{r.load_seconds:.2f}",
                "cuda_graphs": "on" if r.graphs is not None or (r.spec is not None and r.spec.graphs is not None)
                               else "off",
                "dp": f"{self.dp_rank}/{self.dp_size}", **dp.placement_detail(self.ep_layers)}

    def _load(self) -> ModelRunner:
        """On the runner thread: join the expert-parallel group (if any), then build the runner."""
        config = dp.rank_config(self.config, self.dp_rank)
        dp.join_expert_parallel(config, self.dp_rank, self.ctx.config.get("ep_init_method"), self.rank)
        methods = self.ctx.config.get("dist_init_methods")  # one TP rendezvous per data-parallel rank
        return ModelRunner(config, rank=self.rank, per_rank_device=bool(self.ctx.config.get("per_rank_device", True)),
                           dist_init_method=methods[self.dp_rank] if methods else
                           self.ctx.config.get("dist_init_method"))

    async def teardown(self) -> None:
        _LOCAL_RUNNERS.pop((self.ctx.name, self.ctx.instance), None)
        for task in (self._completer, self._reporter):
            if task is not None:
                task.cancel()
        if self.tp_size > 1:
            self._thread.submit(destroy_tensor_parallel)
        if self.config.parallel.expert_parallel_size > 1:
            self._thread.submit(destroy_expert_parallel)
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self.runner is not None:
            self.runner.close()  # its device memory back now, not when the stopped actors are collected
            self.runner = None
        if self._trace is not None:
            self._trace.close()
        await super().teardown()

    async def on_step_plan(self, plan: StepPlan) -> None:
        runner = self.runner
        assert runner is not None
        if self._trace is not None:
            self._trace.arrived(plan)
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._launch, plan)
        except Exception as exc:  # actor boundary: the step fails, queued in order behind the earlier ones
            log.exception("worker: step %d failed", plan.step)
            runner.fail(plan.step, f"{type(exc).__name__}: {exc}")
            self._fatal_under_tp(plan.step, exc)
            if plan.step in self._published:  # its tokens went out, its drafts or states did not: nothing to repair
                log.critical("worker %s: step %d failed after its result was sent; stopping", self.label, plan.step)
                self.request_stop(f"step {plan.step} failed after its result was sent")
        if self._completer is None or self._completer.done():
            if runner.num_pending == 1 and runner.oldest_finished():  # finished at launch (speculation): send now
                await self._complete()
            else:
                self._completer = asyncio.create_task(self._complete(), name=f"{self.ctx.name}-completer")

    def _launch(self, plan: StepPlan) -> None:
        """On the runner thread: launch a step; under expert parallelism a step without sequences still runs the
        MoE layers' all-to-alls (the other ranks' forwards wait for this rank's share)."""
        # a speculating step runs the MTP layer's passes too, which no decode graph holds: eager on every rank
        graphs = self.runner.graphs if self.runner.spec is None else None
        with dp.step_rows(plan, graphs) as graph_size:
            self.runner.launch(plan, graph_size)
            if self._trace is not None:  # when the launch returns (on this thread, before any finish of the step)
                self._trace.launched(plan.step)
            if self.ep_layers:
                if not plan.rids:
                    spec = self.runner.spec
                    if spec is None:
                        dp.empty_forward(self.ep_layers)
                    else:  # the MTP layer's all-to-alls as often as a speculating step runs it
                        dp.empty_forward(self.ep_layers, spec.mtp_ep_layers, spec.num_speculative_tokens)
                self._steps_run += 1

    async def _report_expert_loads(self) -> None:
        """Per-expert token counts to the front end, every EXPERT_LOAD_INTERVAL_S while steps run."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(EXPERT_LOAD_INTERVAL_S)
            if self._steps_run == self._steps_reported:
                continue
            self._steps_reported = self._steps_run
            counts = await loop.run_in_executor(self._thread, dp.expert_tokens, self.ep_layers)
            self.send_nowait(self.frontend, ExpertLoadEvent(dp_rank=self.dp_rank, expert_tokens=counts))

    async def _complete(self) -> None:
        """Send launched steps' results, oldest first, as the device finishes them."""
        runner = self.runner
        loop = asyncio.get_running_loop()
        while runner.num_pending:
            step, event = runner.oldest()
            if event is not None and not event.query():
                await asyncio.to_thread(event.synchronize)  # not on the runner's thread: it stages the next step
            try:
                # a step that finished at launch (every speculating step) is sent from here: a round trip through
                # the runner's thread would add to each step's turnaround
                result = runner.finish_oldest() if runner.oldest_finished() else \
                    await loop.run_in_executor(self._thread, runner.finish_oldest)  # fmt: skip
            except Exception as exc:  # actor boundary
                log.exception("worker: step %d failed", step)
                result = StepResult(step=step, error=f"{type(exc).__name__}: {exc}")
                self._fatal_under_tp(step, exc)
            if step in self._published:
                self._published.discard(step)
                continue
            if self._trace is not None:
                self._trace.done(step)
            if self.rank == 0:
                await self.send(self.scheduler, result, instance=self.dp_rank)

    def _send_published(self, result: StepResult) -> None:
        """On the loop: a speculating step's result, sent while its launch still drafts (MTPSpeculator.publish)."""
        self._published.add(result.step)
        if self._trace is not None:
            self._trace.done(result.step)
        task = asyncio.create_task(self.send(self.scheduler, result, instance=self.dp_rank))
        self._sending.add(task)  # (held until sent: the loop keeps only weak references to tasks)
        task.add_done_callback(self._sending.discard)

    def _fatal_under_tp(self, step: int, exc: Exception) -> None:
        """With tensor or expert parallelism a failed step leaves the ranks out of step: stop, so the engine goes
        down."""
        if self.lockstep:
            log.critical("worker %s (dp %d/%d, tp %d/%d): step %d failed (%s: %s); the ranks cannot continue in "
                         "lockstep, stopping", self.label, self.dp_rank, self.dp_size, self.rank, self.tp_size, step,
                         type(exc).__name__, exc)
            self.request_stop(f"step {step} failed under tensor / expert parallelism")
