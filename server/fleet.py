"""Fleet: several engines behind one front end, and the router that picks engines per request.

Each engine is an EngineClient with its own supervised runtime (one process per actor), so one engine's
death is that engine's alone: its requests end with EngineDeadError naming it, it leaves the registry,
and the others keep serving. Every engine is registered in the service registry (in memory, or Redis by
URL) with its role, model, actor addresses and KV capacity, and heartbeated with its load.

Per request the router (server/router.py) picks from the registry:
  - a prefill engine and a decode engine when both roles are live: one transfer id, the request goes to
    both (each tokenizes it; the prefill side computes the prompt and its first token, the decode side
    pulls the KV and streams the output, actors/disagg.py); the stream reads from the decode engine and
    also hears the prefill engine's failures;
  - otherwise the least loaded colocated engine (plain data parallelism).

When an engine dies mid-transfer, the fleet speaks for it so its partner frees what it holds: a dead
decode engine's transfers are released on the prefill side (BlocksReleasedEvent), a dead prefill
engine's transfers fail on the decode side (KVReadyEvent with an error).

The front end only routes to engines it started itself; the registry (Redis) shares their liveness and
load with other nodes, but a front end does not yet send requests to another front end's engines.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import numpy as np

from flotilla.actors.base import RuntimeOptions
from flotilla.config import EngineConfig
from flotilla.server.engine_client import (
    FRONTEND,
    EngineClient,
    EngineDeadError,
    Outcome,
    deltas,
)
from flotilla.server.dp_coordinator import sum_stats
from flotilla.server.router import NoEngineError, Router
from flotilla.transport.channels import Outbox
from flotilla.transport.messages import (
    AbortCmd,
    ActorFailedEvent,
    BlocksReleasedEvent,
    GenerateRequest,
    KVReadyEvent,
    SchedulerStatsEvent,
    SeqText,
    TransferPeer,
)
from flotilla.transport.registry import (
    HEARTBEAT_INTERVAL_S,
    EngineInfo,
    Heartbeat,
    InMemoryRegistry,
    Registry,
    Role,
)

log = logging.getLogger(__name__)


class RegistryView:
    """The registry as the router reads it: answers cached for `max_age_s` (no Redis round trip per request),
    and engines this process saw die left out at once, before their entry is gone."""

    def __init__(self, registry: Registry, alive: Callable[[str], bool], max_age_s: float) -> None:
        self.registry, self.alive, self.max_age_s = registry, alive, max_age_s
        self._cache: dict[tuple[str | None, str | None], tuple[float, list[EngineInfo]]] = {}

    async def engines(self, role: Role | None = None, model: str | None = None) -> list[EngineInfo]:
        now = time.monotonic()
        hit = self._cache.get((role, model))
        if hit is None or now - hit[0] > self.max_age_s:
            hit = self._cache[(role, model)] = (now, await self.registry.engines(role, model))
        return [e for e in hit[1] if self.alive(e.engine_id)]


def open_registry(url: str | None, ttl_s: float) -> Registry:
    """`memory` (or None): this process's memory; `redis://...`: a Redis server shared by several nodes."""
    if url in (None, "", "memory"):
        return InMemoryRegistry(ttl_s=ttl_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from flotilla.transport.registry import RedisRegistry

        return RedisRegistry(url, ttl_s=ttl_s)
    raise ValueError(f"registry must be `memory` or a redis:// URL, got {url!r}")


class Fleet:
    """Start engines, register them, route requests to one engine or a prefill + decode pair."""

    def __init__(self, engines: list[tuple[str, EngineConfig]], model_name: str, placement: str = "process",
                 trace: bool = False, options: RuntimeOptions | None = None, registry: str | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.model = model_name
        self.clients = {name: EngineClient(cfg, placement, trace, options, name=name) for name, cfg in engines}
        self.roles = {name: cfg.disagg.role for name, cfg in engines}
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry_url = registry or "memory"
        self.registry = open_registry(registry, heartbeat_interval_s * 3)
        self.view = RegistryView(self.registry, self._alive, max_age_s=heartbeat_interval_s / 4)
        self.router = Router(self.view, model_name)
        self._heartbeats: dict[str, Heartbeat] = {}
        self._schedulers: dict[str, Outbox] = {}
        self._transfers: dict[str, tuple[str, str]] = {}  # transfer id -> (prefill, decode) while streaming
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._tasks: set[asyncio.Task] = set()
        self.routed = {name: 0 for name in self.clients}
        """Requests the router gave each engine (a disaggregated one counts for both of its engines)."""
        self.on_all_dead: list[Callable[[], None]] = []
        """Called once no engine is left alive (until then the server answers what it can, 503 otherwise)."""

    # ---- life -----------------------------------------------------------------------------------------

    def _alive(self, engine_id: str) -> bool:
        client = self.clients.get(engine_id)
        return client is not None and client._dead is None  # engines of other front ends are not ours to route to

    async def start(self) -> None:
        await self._check_registry()  # before loading any model
        results = await asyncio.gather(*(c.start() for c in self.clients.values()), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(c.stop() for c in self.clients.values()), return_exceptions=True)
            raise failed[0]
        for name, client in self.clients.items():
            client.runtime.on_failure.append(lambda ev, name=name: self._engine_failed(name, ev))
            self._schedulers[name] = Outbox(client.runtime.zmq, client.runtime.endpoints.of("scheduler"))
            hb = Heartbeat(self.registry, self.engine_info(name), lambda c=client: self._load(c),
                           self.heartbeat_interval_s)
            await hb.start()
            self._heartbeats[name] = hb
            kv = client.ready_detail.get("kv_migration/0", {})
            log.info("engine %s (%s) registered: %s%s", name, self.roles[name], " ".join(
                f"{k}=pid:{ev.pid}" for k, ev in sorted(client.runtime.ready.items())),
                f" kv_backend={kv['kv_backend']} kv_endpoint={kv['kv_endpoint']}" if kv else "")

    async def _check_registry(self) -> None:
        errors: tuple[type[BaseException], ...] = (OSError,)
        if not isinstance(self.registry, InMemoryRegistry):
            import redis.exceptions  # the Redis registry is in use, so redis is installed

            errors += (redis.exceptions.RedisError,)
        try:
            await self.registry.engines()
        except errors as e:
            await self.registry.close()
            raise RuntimeError(f"cannot reach the registry {self.registry_url}: {e}") from None

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)  # engines being retired
        for hb in self._heartbeats.values():
            await hb.stop()
        for out in self._schedulers.values():
            out.close()
        await asyncio.gather(*(c.stop() for c in self.clients.values()), return_exceptions=True)
        await self.registry.close()

    def engine_info(self, name: str) -> EngineInfo:
        client = self.clients[name]
        addresses = {k: v for k, v in client.runtime.endpoints.actors.items() if not k.startswith(FRONTEND + "/")}
        kv_tokens = client.ready_detail.get("worker/0", {}).get("kv_tokens", "0")
        return EngineInfo(engine_id=name, role=self.roles[name], model=self.model, addresses=addresses,
                          kv_capacity_tokens=int(kv_tokens) if kv_tokens.isdigit() else 0)

    @staticmethod
    def _load(client: EngineClient) -> float:
        s = client.stats
        return float(client.num_pending + (s.num_running + s.num_waiting if s is not None else 0))

    # ---- what the HTTP app uses (EngineClient's interface) --------------------------------------------------

    @property
    def alive(self) -> bool:
        """Some request can be served: a live colocated engine, or a live prefill and a live decode engine."""
        roles = {self.roles[n] for n, c in self.clients.items() if c.alive}
        return "both" in roles or {"prefill", "decode"} <= roles

    @property
    def num_pending(self) -> int:
        return sum(c.num_pending for c in self.clients.values())

    @property
    def ready_detail(self) -> dict[str, dict[str, str]]:
        return next(iter(self.clients.values())).ready_detail

    @property
    def stats(self) -> SchedulerStatsEvent | None:
        """The live engines' state summed up (KV usage and hit rate averaged) for the model-wide gauges."""
        return sum_stats([c.stats for c in self.clients.values() if c.alive and c.stats is not None])

    def engine_stats(self) -> dict[str, tuple[str, SchedulerStatsEvent | None, bool, int]]:
        """Per engine: (role, latest stats, alive, requests routed to it)."""
        return {name: (self.roles[name], c.stats, c.alive, self.routed[name]) for name, c in self.clients.items()}

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{self._prefix}-{next(self._ids)}"

    def fan_out(self, req: GenerateRequest) -> list[GenerateRequest]:
        return next(iter(self.clients.values())).fan_out(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[SeqText]:
        """Route one engine request (n == 1) and yield its deltas."""
        try:
            roles = {e.role for e in await self.view.engines(model=self.model)}
            if "prefill" in roles and "decode" in roles:
                prefill, decode = await self.router.pick_pair()
                engines = [prefill.engine_id, decode.engine_id]
                source = self._stream_pd(req, self.clients[prefill.engine_id], self.clients[decode.engine_id])
            else:
                engines = [(await self.router.pick()).engine_id]
                source = self.clients[engines[0]].stream(req)
        except NoEngineError:
            live = ", ".join(f"{n} ({self.roles[n]})" for n, c in self.clients.items() if c.alive) or "none"
            raise EngineDeadError(f"no engine can serve this request: it needs a colocated engine or a prefill and a "
                                  f"decode engine; live engines: {live}") from None
        for name in engines:
            self.routed[name] += 1
        try:
            async for item in source:
                yield item
        finally:
            await source.aclose()
            for name in engines:
                self.router.finished(name)

    async def _stream_pd(self, req: GenerateRequest, prefill: EngineClient,
                         decode: EngineClient) -> AsyncIterator[SeqText]:
        if req.sampling.n != 1:
            raise ValueError("stream() takes one sequence; use fan_out() for n > 1")
        for c in (prefill, decode):
            if c._dead is not None:
                raise EngineDeadError(c._dead)
        tid = uuid.uuid4().hex
        # one queue hears both: the decode engine's deltas, either engine's failure or death
        queue: asyncio.Queue = asyncio.Queue()
        prefill._pending[req.rid] = decode._pending[req.rid] = queue
        self._transfers[tid] = (prefill.name, decode.name)
        outcome = Outcome()
        p_eps, d_eps = prefill.runtime.endpoints, decode.runtime.endpoints
        try:
            await decode.to_tokenizer.send(msgspec.structs.replace(req, transfer_id=tid, peer=TransferPeer(
                engine=prefill.name, scheduler=p_eps.of("scheduler"), kv=p_eps.instances("kv_migration"))))
            await prefill.to_tokenizer.send(msgspec.structs.replace(req, transfer_id=tid, peer=TransferPeer(
                engine=decode.name, scheduler=d_eps.of("scheduler"))))
            detached = False
            async for item in deltas(queue, outcome):
                if not detached:  # the decode side has the KV now: the prefill engine's fate is not this request's
                    detached = True
                    prefill._pending.pop(req.rid, None)
                    self._transfers.pop(tid, None)
                yield item
        finally:
            if prefill._dead is None and decode._dead is None:
                self._transfers.pop(tid, None)
            # else _retire speaks for the dead engine (its partner may hold blocks or a pending transfer for it)
            # and forgets the transfer, whichever of the two runs first
            prefill._pending.pop(req.rid, None)
            decode._pending.pop(req.rid, None)
            # a disconnect or a failure on one side: the other side drops the request too (aborting a request an
            # engine already finished is a no-op)
            if not outcome.ended or outcome.failed:
                for c in (prefill, decode):
                    if c._dead is None:
                        await c.to_tokenizer.send(AbortCmd(rid=req.rid))

    # ---- an engine died -----------------------------------------------------------------------------------

    def _engine_failed(self, name: str, ev: ActorFailedEvent) -> None:
        log.error("engine %s failed (actor %s/%d: %s); the other engines keep serving", name, ev.actor,
                  ev.instance, ev.reason)
        self._spawn(self._retire(name))

    async def _retire(self, name: str) -> None:
        hb = self._heartbeats.pop(name, None)
        if hb is not None:
            await hb.stop()  # out of the registry: the router picks it no more
        for tid, (p, d) in list(self._transfers.items()):
            if name not in (p, d):
                continue
            del self._transfers[tid]
            if d == name and self.clients[p].alive:
                await self._schedulers[p].send(BlocksReleasedEvent(transfer_id=tid))
            elif p == name and self.clients[d].alive:
                await self._schedulers[d].send(KVReadyEvent(
                    transfer_id=tid, block_ids=np.zeros(0, np.int32), num_tokens=0, first_token=-1,
                    src_engine=p, error=f"prefill engine {p} died"))
        out = self._schedulers.pop(name, None)
        if out is not None:
            out.close()
        await self.clients[name].stop()  # closes its sockets, then stops (kills) what is left of its actors
        if not any(c.alive for c in self.clients.values()):
            for cb in self.on_all_dead:
                cb()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
