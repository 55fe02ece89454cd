"""EngineClient: the front end's side of the engine (used by the HTTP server and the offline LLM).

It starts the engine's actors (tokenizer -> scheduler -> worker -> scheduler -> detokenizer) as a
supervised topology, owns the front end's inbox, and runs ONE receive loop that routes every
TextDelta item to its request's asyncio.Queue (SGLang's pattern). Requests with n > 1 fan out here
into n engine requests (choice_seed(seed, i) each, so seeded choices differ yet reproduce). If any actor dies or
hangs, every waiting request gets EngineDeadError at once: the front end fails fast, never hangs.

A dead engine is restarted when `restarts` allows: every actor of the old one is stopped (killed if need
be), and after a backoff (restart_backoff_s, doubling per failure in a row) a fresh topology starts. Until
it is ready `alive` is False and `retry_after_s` says when to try again. After `restarts` failures in a
row (an engine that stayed up STABLE_S starts the count over) the client gives up: `on_gave_up`.

With data_parallel_size > 1 the engine has one scheduler per data-parallel rank; the client's coordinator
(server/dp_coordinator.py) gives each engine request to the least loaded rank (GenerateRequest.dp_rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path

import msgspec
import zmq

from flotilla.actors.base import RuntimeOptions
from flotilla.actors.runtime import Runtime
from flotilla.actors.topology import ActorSpec, Topology
from flotilla.config import DEVICE_BATCH_OPTIONS, EngineConfig, SchedulerConfig, batch_defaults
from flotilla.models.context_length import load_max_model_len
from flotilla.models.hf_config import load_hf_config
from flotilla.models.model_folder import has_recurrent_state, model_dir, takes_images
from flotilla.server.dp_coordinator import DPCoordinator, ExpertLoads
from flotilla.transport.channels import Inbox, Outbox
from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.messages import (
    AbortCmd,
    ActorFailedEvent,
    ExpertLoadEvent,
    GenerateRequest,
    RequestFailedEvent,
    SchedulerStatsEvent,
    SeqText,
    TextDelta,
)

log = logging.getLogger(__name__)

FRONTEND = "frontend"

RESTART_BACKOFF_S = 1.0
"""Wait before the first restart of a failed engine; it doubles with each failure in a row."""
RESTART_BACKOFF_MAX_S = 30.0
"""The longest wait before a restart."""
STABLE_S = 600.0
"""An engine that served this long before it failed starts its count of failures in a row over."""


class EngineDeadError(RuntimeError):
    """An engine actor failed; the request cannot complete."""


class RequestFailed(RuntimeError):
    """The engine refused or failed a request (carries the HTTP status and OpenAI error fields)."""

    def __init__(self, ev: RequestFailedEvent) -> None:
        super().__init__(ev.message)
        self.status, self.param, self.code = ev.status, ev.param, ev.code


class Outcome:
    """How a request's stream ended: `ended` once the engine said its last word (finish, failure, death),
    `failed` when that word was a failure or a death."""

    __slots__ = ("ended", "failed")

    def __init__(self) -> None:
        self.ended = self.failed = False


class _Collector:
    """Receives a request's deltas into a list; `done` resolves at its last word (None: finished, else the
    failure). The collect() counterpart of a stream's queue."""

    __slots__ = ("items", "done", "outcome")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: list[SeqText] = []
        self.done: asyncio.Future = loop.create_future()
        self.outcome = Outcome()

    def put_nowait(self, item: object) -> None:
        if self.done.done():
            return
        if isinstance(item, SeqText):
            self.items.append(item)
            if item.finish_reason is not None:
                self.outcome.ended = True
                self.done.set_result(None)
            return
        self.outcome.ended = self.outcome.failed = True
        self.done.set_result(item)


async def deltas(queue: asyncio.Queue, outcome: Outcome) -> AsyncIterator[SeqText]:
    """A request's SeqTexts from its queue until the last one; RequestFailed / EngineDeadError end it too."""
    while True:
        item = await queue.get()
        if isinstance(item, SeqText):
            outcome.ended = item.finish_reason is not None
            yield item
            if outcome.ended:
                return
        elif isinstance(item, RequestFailedEvent):
            outcome.ended = outcome.failed = True
            raise RequestFailed(item)
        else:
            outcome.ended = outcome.failed = True
            raise EngineDeadError(str(item))


def with_device_batch_defaults(config: EngineConfig, given: Collection[str], *, offline: bool) -> EngineConfig:
    """The config with max_num_seqs and max_num_batched_tokens, those not `given` by the user, set as vLLM sets them
    for the GPU the engine runs on and for offline or serving use (config.batch_defaults). On CPU, or with no GPU
    visible here (actors Ray places on other nodes), the config keeps its own."""
    missing = [name for name in DEVICE_BATCH_OPTIONS if name not in given]
    device_bytes, device_name = gpu_memory(config.worker.device) if missing else (0, "")
    if not device_bytes:
        return config
    values = batch_defaults(device_bytes, device_name, offline=offline, hybrid=has_recurrent_state(model_dir(config)))
    scheduler = msgspec.structs.replace(config.scheduler, **{name: values[name] for name in missing})
    return msgspec.structs.replace(config, scheduler=scheduler)


def gpu_memory(device: str) -> tuple[int, str]:
    """Total bytes and name of the GPU `device` (a WorkerConfig.device) means; (0, "") for none. Reads the device's
    properties without allocating on it."""
    if not device.startswith(("cuda", "auto")) or not cuda_available():
        return 0, ""
    import torch

    props = torch.cuda.get_device_properties(0 if device == "auto" else torch.device(device).index or 0)
    return props.total_memory, props.name


GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")
"""Files a GPU driver puts on a machine: NVIDIA's (containers given a GPU included), WSL2's GPU bridge, ROCm's."""


def gpu_driver_present() -> bool:
    """Whether this machine may have a GPU: without a driver's files torch's import (~1.6 s of CPU in every front end)
    is not needed to learn that it has none."""
    return any(os.path.exists(path) for path in GPU_DRIVER_FILES)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU driver is (gpu_driver_present)."""
    if not gpu_driver_present():
        return False
    import torch

    return torch.cuda.is_available()


def engine_topology(config: EngineConfig, placement: str = "inline", name: str = "engine",
                    options: RuntimeOptions | None = None, host: str | None = None,
                    own_vision_encoder: bool = True) -> Topology:
    """The actors of one engine, wired by name; each gets the whole EngineConfig.

    A prefill or decode engine also runs a KV-migration actor per worker rank, in the worker's process
    (process group "worker") so it can register the rank's KV cache with the data plane. Tensor parallelism
    runs tensor_parallel_size worker instances (instance = rank), one process each, that meet at a
    rendezvous address chosen here (torch.distributed's tcp:// init). Data parallelism runs one scheduler per
    rank (instance = DP rank) and tensor_parallel_size workers for each (actors/data_parallel.py); under expert
    parallelism the data-parallel ranks' workers meet at one more address instead, all tp x dp of them, and their
    TP groups are sub-groups of that world (over the tensor-parallel ranks alone the experts need none: their
    group is the TP group). `host`: every actor listens on TCP there (other nodes' front ends send it requests),
    not on this machine's Unix sockets. An engine of role encoder is its vision encoder alone; with
    image_encoder = remote another engine starts a vision encoder of its own unless `own_vision_encoder` is False
    (a fleet's engines beside encoder engines: the router names one per request)."""
    engine = config.to_dict()
    common = {"engine": engine, "scheduler": "scheduler", "frontend": FRONTEND, "engine_id": name}
    if placement == "process" and config.parallel.distributed_executor_backend == "ray":
        placement = "ray"
    tcp: dict = ({"ray_address": config.parallel.ray_address,
                  "ray_placement_strategy": config.parallel.ray_placement_strategy} if placement == "ray" else {})
    if placement == "ray":
        host = None  # (its actors listen at their Ray nodes' addresses, which other nodes reach)
    if host is not None:
        if placement != "process":
            raise ValueError("engines other nodes reach run one process per actor: drop --single-process")
        tcp = {"transport": "tcp", "supervisor_host": host}
    if config.disagg.role == "encoder":
        if not takes_images(model_dir(config)):
            raise ValueError(f"an encoder engine runs a vision tower: {model_dir(config).name} takes no images")
        actors = [ActorSpec(name="vision_encoder", kind="vision_encoder", config=common)]
        return Topology(name=name, placement=placement, options=options or RuntimeOptions(), clients=[FRONTEND],
                        actors=[msgspec.structs.replace(a, host=host) for a in actors] if host else actors, **tcp)
    disagg = config.disagg.role != "both"
    tp, dp = config.parallel.tensor_parallel_size, config.parallel.data_parallel_size
    worker = dict(common)
    if placement == "inline" and config.parallel.distributed_executor_backend == "ray":
        raise ValueError("distributed_executor_backend ray places every actor in a process of its own: drop "
                         "--single-process (placement inline)")
    if tp * dp > 1 and placement == "inline":
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} runs one process per rank: use "
                         "placement='process' (--placement process; flotilla serve without --single-process)")
    if dp > 1 and disagg:
        raise ValueError("data_parallel_size > 1 with a prefill or decode role is not built yet: run several "
                         "engines (--engines) instead")
    if config.parallel.enable_expert_parallel:
        check_expert_parallel(config)
    if config.model.max_model_len is not None and config.model.model is not None \
            and (Path(config.model.model) / "config.json").is_file():
        load_max_model_len(config.model.max_model_len, config.model.model)  # longer than the model allows: refused now
    dp_ep = config.parallel.expert_parallel_size > 1 and dp > 1
    if tp > 1 and not dp_ep:  # (under DP x TP x EP the TP groups are sub-groups of the EP ranks' world)
        addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(dp)]  # one TP group per DP rank
        if dp == 1:
            worker["dist_init_method"] = addresses[0]
        else:
            worker["dist_init_methods"] = addresses
    if dp_ep:  # over TP ranks alone the experts use the TP group
        worker["ep_init_method"] = f"tcp://127.0.0.1:{free_tcp_port()}"
    # an encoder actor beside each worker rank (image_encoder = actor, or remote: then it reads the embeddings of a
    # vision encoder of its own process); a decode engine has no prefill to feed
    encoders = (config.worker.image_encoder != "step" and config.disagg.role != "decode"
                and takes_images(model_dir(config)))
    remote = encoders and config.worker.image_encoder == "remote" and own_vision_encoder
    if remote and config.disagg.kv_transfer_backend == "local" and placement != "inline":
        raise ValueError("image_encoder=remote with kv_transfer_backend=local needs every actor in one process "
                         "(--single-process); between processes use dlslime_tcp")
    actors = [
        ActorSpec(name="tokenizer", kind="tokenizer", config=common),
        ActorSpec(name="scheduler", kind="scheduler", count=dp, config={**common, "workers": "worker",
                                                                       "detokenizer": "detokenizer",
                                                                       "kv_migration": "kv_migration",
                                                                       "encoders": "encoder" if encoders else ""}),
        ActorSpec(name="worker", kind="worker", count=tp * dp, config=worker,
                  process="worker" if disagg or encoders else ""),
        ActorSpec(name="detokenizer", kind="detokenizer", config=common),
    ]
    if disagg:
        actors.append(ActorSpec(name="kv_migration", kind="kv_migration", count=tp, process="worker",
                                config={**common, "workers": "worker"}))
    if encoders:
        actors.append(ActorSpec(name="encoder", kind="encoder", count=tp * dp, process="worker",
                                config={**common, "workers": "worker", "tensor_parallel_size": tp,
                                        "vision_encoder": "vision_encoder" if remote else ""}))
    if remote:
        actors.append(ActorSpec(name="vision_encoder", kind="vision_encoder", config=common))
    if host is not None:
        actors = [msgspec.structs.replace(a, host=host) for a in actors]
    return Topology(name=name, placement=placement, options=options or RuntimeOptions(), clients=[FRONTEND],
                    actors=actors, **tcp)


def check_expert_parallel(config: EngineConfig) -> None:
    """enable_expert_parallel needs a model with routed experts, as many as a multiple of the EP size:
    refused here, before any process starts, with the reason."""
    if config.model.model is None:
        raise ValueError("enable_expert_parallel needs a MoE model; the default model has no experts")
    path = Path(config.model.model)
    if not (path / "config.json").is_file():
        return  # the worker reports the missing model
    moe = load_hf_config(path).moe
    if moe is None:
        raise ValueError(f"enable_expert_parallel needs a MoE model; {path.name} has no routed experts "
                         "(no num_experts in its config.json)")
    ep = config.parallel.expert_parallel_size
    if moe.num_experts % ep:
        over = ("data_parallel_size" if config.parallel.tensor_parallel_size == 1 else "tensor_parallel_size"
                if config.parallel.data_parallel_size == 1 else "data_parallel_size x tensor_parallel_size")
        raise ValueError(f"enable_expert_parallel: {moe.num_experts} experts cannot be split evenly over "
                         f"{over}={ep} ranks (each rank keeps num_experts / {ep} whole experts)")


class EngineClient:
    """Start the engine, submit requests, stream their text deltas, abort them."""

    def __init__(self, config: EngineConfig, placement: str = "inline", trace: bool = False,
                 options: RuntimeOptions | None = None, name: str = "engine", host: str | None = None,
                 restarts: int = 0, own_vision_encoder: bool = True,
                 restart_backoff_s: float = RESTART_BACKOFF_S) -> None:
        """host: the engine's actors listen on TCP there, for other nodes' front ends (engine_topology).
        restarts: how many times in a row a failed engine is started again before the client gives up.
        own_vision_encoder: see engine_topology."""
        if restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {restarts}")
        self.config = config
        self.name = name
        self._topology_args = (config, placement, name, options, host, own_vision_encoder)
        self._trace = trace
        self.topology = engine_topology(config, placement, name=name, options=options, host=host,
                                        own_vision_encoder=own_vision_encoder)
        self.runtime = Runtime(self.topology, trace=trace)
        self._pending: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._dead: str | None = None
        self._recv_task: asyncio.Task | None = None
        self.ready_detail: dict[str, dict[str, str]] = {}
        self.coordinator = DPCoordinator(config.parallel.data_parallel_size)
        """Which data-parallel rank takes each request; the ranks' latest scheduler reports."""
        self.expert_loads = ExpertLoads()
        """Per-expert token counts of the ranks under expert parallelism."""
        self._ranks: dict[str, int] = {}  # rid -> data-parallel rank, while it streams
        self.max_restarts = restarts
        self.restart_backoff_s = restart_backoff_s
        self.failures = 0
        """Times the engine failed (an actor died or hung, or a restart did not come up) since start."""
        self.restarts = 0
        """Times a failed engine was started again and came up."""
        self._in_a_row = 0
        self._up_since = 0.0
        self._start_s = 0.0  # how long the last start took (part of the retry estimate)
        self._retry_at: float | None = None
        self._recovery: asyncio.Task | None = None
        self._stopping = False
        self.gave_up = False
        """The engine failed with no restart left: it stays dead."""
        self.on_failure: list[Callable[[ActorFailedEvent], None]] = []
        """Called at each failure, after the waiting requests were ended (the engine's actors are stopping)."""
        self.on_restarted: list[Callable[[], None]] = []
        """Called when a restarted engine is ready (new runtime, new addresses)."""
        self.on_gave_up: list[Callable[[], None]] = []
        """Called once when the engine failed with no restart left."""

    @property
    def stats(self) -> SchedulerStatsEvent | None:
        """The schedulers' latest state, summed over the data-parallel ranks (for /metrics)."""
        return self.coordinator.total_stats()

    async def start(self) -> None:
        """Start the engine; raises (with every actor stopped) if it does not come up. No restart here: a start
        that fails is a configuration to fix, not a fault to ride out."""
        started = time.monotonic()
        ready = await self.runtime.start()
        self._start_s = time.monotonic() - started
        self._up_since = time.monotonic()
        self.ready_detail = {k: dict(ev.detail) for k, ev in ready.items()}
        eps = self.runtime.endpoints
        self.inbox = Inbox(self.runtime.zmq, eps.of(FRONTEND), (TextDelta, RequestFailedEvent, SchedulerStatsEvent,
                                                                ExpertLoadEvent))
        # (an encoder engine takes no requests: the vision encoders of other engines' encoder actors ask it)
        self.to_tokenizer = None if self.config.disagg.role == "encoder" else Outbox(self.runtime.zmq,
                                                                                    eps.of("tokenizer"))
        self._recv_task = asyncio.create_task(self._receive(), name="engine-client-recv")
        self.runtime.on_failure.append(self._engine_died)

    async def stop(self) -> None:
        self._stopping = True
        if self._recovery is not None:
            self._recovery.cancel()
            await asyncio.gather(self._recovery, return_exceptions=True)
        await self._close_channels()
        await self.runtime.stop("front end stopping")

    async def _close_channels(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None
            self.inbox.close()
            if self.to_tokenizer is not None:
                self.to_tokenizer.close()

    @property
    def restarting(self) -> bool:
        """Failed, and a restart is under way."""
        return self._dead is not None and self.max_restarts > 0 and not self.gave_up and not self._stopping

    @property
    def retry_after_s(self) -> int | None:
        """While restarting: whole seconds until the engine is expected back (at least 1); None otherwise."""
        if not self.restarting:
            return None
        wait = (self._retry_at or time.monotonic()) - time.monotonic()
        return max(1, math.ceil(wait))

    def restart_counts(self) -> dict[str, tuple[int, int]]:
        """(failures, restarts) since start, by engine id (the Fleet's shape)."""
        return {self.name: (self.failures, self.restarts)}

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{self._prefix}-{next(self._ids)}"

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._recv_task is not None

    # ---- requests ------------------------------------------------------------------------------

    def fan_out(self, req: GenerateRequest) -> list[GenerateRequest]:
        """n > 1 -> n engine requests ``rid/i``, each n=1, seeded choice_seed(seed, i) when seeded."""
        n = req.sampling.n
        if n == 1:
            return [req]
        out = []
        for i in range(n):
            seed = None if req.sampling.seed is None else choice_seed(req.sampling.seed, i)
            sp = msgspec.structs.replace(req.sampling, n=1, seed=seed)
            out.append(msgspec.structs.replace(req, rid=f"{req.rid}/{i}", sampling=sp))
        return out

    async def stream(self, req: GenerateRequest) -> AsyncIterator[SeqText]:
        """Submit one engine request (n == 1) and yield its deltas; closing the iterator early aborts it."""
        queue: asyncio.Queue = asyncio.Queue()
        outcome = Outcome()
        async with self._submitted(req, queue, outcome):
            async for item in deltas(queue, outcome):
                yield item

    async def collect(self, req: GenerateRequest) -> list[SeqText]:
        """Submit one engine request (n == 1) and return all its deltas once it has finished: no task wakes up
        per token (what the offline LLM API needs); cancelling the call aborts the request."""
        sink = _Collector(asyncio.get_running_loop())
        async with self._submitted(req, sink, sink.outcome):
            end = await sink.done
        if isinstance(end, RequestFailedEvent):
            raise RequestFailed(end)
        if end is not None:
            raise EngineDeadError(str(end))
        return sink.items

    @contextlib.asynccontextmanager
    async def _submitted(self, req: GenerateRequest, sink, outcome: Outcome):
        """Send `req` with `sink` (put_nowait(item)) receiving what the engine says about it; on leaving
        before the engine's last word the request is aborted (its blocks freed)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if req.sampling.n != 1:
            raise ValueError("one engine request is one sequence; use fan_out() for n > 1")
        self._pending[req.rid] = sink
        rank = self._ranks[req.rid] = self.coordinator.pick()
        try:
            try:
                await self.to_tokenizer.send(msgspec.structs.replace(req, dp_rank=rank) if rank else req)
            except (zmq.ZMQError, asyncio.CancelledError):
                if self._dead is None or _really_cancelled():
                    raise
                raise EngineDeadError(self._dead) from None  # the engine died while the send waited
            yield
        finally:
            self._pending.pop(req.rid, None)
            if not outcome.ended and self._dead is None:
                # the consumer went away (client disconnect, cancellation): free the sequence's blocks
                await self.abort(req.rid)
            self._ranks.pop(req.rid, None)
            self.coordinator.finished(rank)

    async def abort(self, rid: str) -> None:
        """Drop a request wherever it is (travels the request's own path: cannot overtake it)."""
        self._pending.pop(rid, None)
        try:
            await self.to_tokenizer.send(AbortCmd(rid=rid, dp_rank=self._ranks.get(rid, 0)))
        except (zmq.ZMQError, asyncio.CancelledError):
            if self._dead is None or _really_cancelled():
                raise  # (a dead engine drops every request anyway)

    async def _receive(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, TextDelta):
                for item in msg.items:
                    q = self._pending.get(item.rid)
                    if q is not None:
                        q.put_nowait(item)
            elif isinstance(msg, SchedulerStatsEvent):
                self.coordinator.observe(msg)
            elif isinstance(msg, ExpertLoadEvent):
                self.expert_loads.observe(msg)
            else:
                q = self._pending.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)

    def _engine_died(self, ev: ActorFailedEvent) -> None:
        if self._stopping or self._dead is not None:
            return
        self._dead = f"engine {self.name}: actor {ev.actor}/{ev.instance} failed: {ev.reason}"
        self.failures += 1
        for q in self._pending.values():
            q.put_nowait(self._dead)
        self.coordinator.stats = [None] * self.coordinator.dp_size  # the dead schedulers' reports are stale
        for cb in self.on_failure:
            cb(ev)
        self._recovery = asyncio.create_task(self._recover(), name=f"{self.name}-recovery")

    async def _recover(self) -> None:
        """Stop what is left of the dead engine, then start a fresh one after a backoff (or give up)."""
        await self._close_channels()
        # again, now that nothing is received: a report the dying schedulers sent after the failure may have come
        # in since, and the restarted engine, idle, may not report for a while (the router would see its old load)
        self.coordinator.stats = [None] * self.coordinator.dp_size
        await self.runtime.stop("engine failed")  # the hung or surviving actors go too: a restart is whole
        while True:
            if time.monotonic() - self._up_since >= STABLE_S:
                self._in_a_row = 0
            self._in_a_row += 1
            if self._in_a_row > self.max_restarts:
                self.gave_up = True
                if self.max_restarts:
                    log.error("engine %s: giving up after %d restarts in a row", self.name, self.max_restarts)
                for cb in self.on_gave_up:
                    cb()
                return
            delay = min(self.restart_backoff_s * 2 ** (self._in_a_row - 1), RESTART_BACKOFF_MAX_S)
            self._retry_at = time.monotonic() + delay + self._start_s
            log.warning("engine %s: restarting in %.0f s (restart %d of at most %d in a row)", self.name, delay,
                        self._in_a_row, self.max_restarts)
            await asyncio.sleep(delay)
            config, placement, name, options, host, own = self._topology_args
            self.topology = engine_topology(config, placement, name=name, options=options, host=host,
                                            own_vision_encoder=own)
            self.runtime = Runtime(self.topology, trace=self._trace)
            try:
                await self.start()
            except Exception as e:  # (the runtime stopped every actor it had started)
                self.failures += 1
                self._up_since = time.monotonic()
                log.error("engine %s: the restart failed: %s", self.name, e)
                continue
            self.restarts += 1
            self._dead = self._retry_at = None
            log.info("engine %s restarted (%d since start): %s", self.name, self.restarts,
                     " ".join(f"{k}=pid:{ev.pid}" for k, ev in sorted(self.runtime.ready.items())))
            for cb in self.on_restarted:
                cb()
            return


def ready_summary(ready_detail: dict[str, dict[str, str]], model_name: str, max_model_len: int | str,
                  scheduler: SchedulerConfig) -> str:
    """What the ready line of `serve` and of the offline LLM says about the engine: the model, the KV cache's
    capacity (and a hybrid model's recurrent-state slots: the sequences that can run at once), the batch limits, where
    it runs and which kernels were chosen (from the first worker's ready detail)."""
    w = ready_detail.get("worker/0", {})
    hybrid = w.get("state_slots", "0") not in ("0", "")
    state = f" state_slots={w['state_slots']} sequences" if hybrid else ""
    gdn = f",gdn:{w['gdn']}" if hybrid and w.get("gdn", "-") != "-" else ""
    kv_tokens = w.get("kv_tokens", "?")
    if str(max_model_len).isdigit() and kv_tokens.isdigit():
        limit, why = scheduler.length_limit(int(max_model_len), int(kv_tokens))
        if why is not None:
            max_model_len = f"{max_model_len} (sequences end at {limit}: {why})"
    return (f"model={model_name} kv_capacity={kv_tokens} tokens ({w.get('kv_blocks', '?')} blocks of "
            f"{w.get('block_size', '?')}){state} max_model_len={max_model_len} max_num_seqs={scheduler.max_num_seqs} "
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens} device={w.get('device', '?')} "
            f"dtype={w.get('dtype', '?')} kv_dtype={w.get('kv_dtype', '?')} "
            f"kernels=attention:{w.get('attention', '?')}{gdn},sampler:torch")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded request with n > 1: the request's own for the first choice (n = 1 and
    n > 1 begin alike), a splitmix64 mix of (seed, index) for the others, so that no two seeds share a choice's
    stream (seed + index would give seeds s and s + 1 the same samples, shifted by one choice)."""
    if index == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1  # (a non-negative int64)


def _really_cancelled() -> bool:
    """The current task itself is being cancelled (not merely a socket's pending future)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
