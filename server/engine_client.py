"""EngineClient: the front end's side of the engine (used by the HTTP server and the offline LLM).

It starts the engine's actors (tokenizer -> scheduler -> worker -> scheduler -> detokenizer) as a
supervised topology, owns the front end's inbox, and runs ONE receive loop that routes every
TextDelta item to its request's asyncio.Queue (SGLang's pattern). Requests with n > 1 fan out here
into n engine requests (seed + i each, so seeded choices differ yet reproduce). If any actor dies,
every waiting request gets EngineDeadError at once: the front end fails fast, never hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator

import msgspec

from flotilla.actors.base import RuntimeOptions
from flotilla.actors.runtime import Runtime
from flotilla.actors.topology import ActorSpec, Topology
from flotilla.config import EngineConfig
from flotilla.transport.channels import Inbox, Outbox
from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.messages import (
    AbortCmd,
    ActorFailedEvent,
    GenerateRequest,
    RequestFailedEvent,
    SchedulerStatsEvent,
    SeqText,
    TextDelta,
)

log = logging.getLogger(__name__)

FRONTEND = "frontend"


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


def engine_topology(config: EngineConfig, placement: str = "inline", name: str = "engine",
                    options: RuntimeOptions | None = None) -> Topology:
    """The actors of one engine, wired by name; each gets the whole EngineConfig.

    A prefill or decode engine also runs a KV-migration actor per worker rank, in the worker's process
    (process group "worker") so it can register the rank's KV cache with the data plane. Tensor parallelism
    runs tensor_parallel_size worker instances (instance = rank), one process each, that meet at a
    rendezvous address chosen here (torch.distributed's tcp:// init)."""
    engine = config.to_dict()
    common = {"engine": engine, "scheduler": "scheduler", "frontend": FRONTEND, "engine_id": name}
    disagg = config.disagg.role != "both"
    tp = config.parallel.tensor_parallel_size
    worker = common
    if tp > 1:
        if placement != "process":
            raise ValueError(f"tensor_parallel_size={tp} runs one process per rank: use placement='process' "
                             "(--placement process; flotilla serve without --single-process)")
        worker = {**common, "dist_init_method": f"tcp://127.0.0.1:{free_tcp_port()}"}
    actors = [
        ActorSpec(name="tokenizer", kind="tokenizer", config=common),
        ActorSpec(name="scheduler", kind="scheduler", config={**common, "workers": "worker",
                                                             "detokenizer": "detokenizer",
                                                             "kv_migration": "kv_migration"}),
        ActorSpec(name="worker", kind="worker", count=tp, config=worker, process="worker" if disagg else ""),
        ActorSpec(name="detokenizer", kind="detokenizer", config=common),
    ]
    if disagg:
        actors.append(ActorSpec(name="kv_migration", kind="kv_migration", count=tp, process="worker",
                                config={**common, "workers": "worker"}))
    return Topology(name=name, placement=placement, options=options or RuntimeOptions(), clients=[FRONTEND],
                    actors=actors)


class EngineClient:
    """Start the engine, submit requests, stream their text deltas, abort them."""

    def __init__(self, config: EngineConfig, placement: str = "inline", trace: bool = False,
                 options: RuntimeOptions | None = None, name: str = "engine") -> None:
        self.config = config
        self.name = name
        self.topology = engine_topology(config, placement, name=name, options=options)
        self.runtime = Runtime(self.topology, trace=trace)
        self._pending: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._dead: str | None = None
        self._recv_task: asyncio.Task | None = None
        self.ready_detail: dict[str, dict[str, str]] = {}
        self.stats: SchedulerStatsEvent | None = None
        """The scheduler's latest state (for /metrics)."""

    async def start(self) -> None:
        self.runtime.on_failure.append(self._engine_died)
        ready = await self.runtime.start()
        self.ready_detail = {k: dict(ev.detail) for k, ev in ready.items()}
        eps = self.runtime.endpoints
        self.inbox = Inbox(self.runtime.zmq, eps.of(FRONTEND), (TextDelta, RequestFailedEvent, SchedulerStatsEvent))
        self.to_tokenizer = Outbox(self.runtime.zmq, eps.of("tokenizer"))
        self._recv_task = asyncio.create_task(self._receive(), name="engine-client-recv")

    async def stop(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self.inbox.close()
            self.to_tokenizer.close()
        await self.runtime.stop("front end stopping")

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
        """n > 1 -> n engine requests ``rid/i``, each n=1, seeded seed+i when seeded."""
        n = req.sampling.n
        if n == 1:
            return [req]
        out = []
        for i in range(n):
            seed = None if req.sampling.seed is None else req.sampling.seed + i
            sp = msgspec.structs.replace(req.sampling, n=1, seed=seed)
            out.append(msgspec.structs.replace(req, rid=f"{req.rid}/{i}", sampling=sp))
        return out

    async def stream(self, req: GenerateRequest) -> AsyncIterator[SeqText]:
        """Submit one engine request (n == 1) and yield its deltas; closing the iterator early aborts it."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if req.sampling.n != 1:
            raise ValueError("stream() takes one sequence; use fan_out() for n > 1")
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[req.rid] = queue
        outcome = Outcome()
        try:
            await self.to_tokenizer.send(req)
            async for item in deltas(queue, outcome):
                yield item
        finally:
            self._pending.pop(req.rid, None)
            if not outcome.ended and self._dead is None:
                # the consumer went away (client disconnect, cancellation): free the sequence's blocks
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        """Drop a request wherever it is (travels the request's own path: cannot overtake it)."""
        self._pending.pop(rid, None)
        await self.to_tokenizer.send(AbortCmd(rid=rid))

    async def _receive(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, TextDelta):
                for item in msg.items:
                    q = self._pending.get(item.rid)
                    if q is not None:
                        q.put_nowait(item)
            elif isinstance(msg, SchedulerStatsEvent):
                self.stats = msg
            else:
                q = self._pending.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)

    def _engine_died(self, ev: ActorFailedEvent) -> None:
        self._dead = f"engine {self.name}: actor {ev.actor}/{ev.instance} failed: {ev.reason}"
        for q in self._pending.values():
            q.put_nowait(self._dead)
