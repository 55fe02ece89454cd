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

Several nodes: front ends that share a Redis registry route to each other's engines too. Their engines'
actors listen on TCP at `engine_host`, and each front end binds a reply inbox there; a request for another
node's engine (server/remote_engine.py) names that inbox (`reply_to`), so its text comes back to the front end
that routed it. A prefill engine on one node and a decode engine on another make a pair like any other. An
engine of another node is dead here once it leaves the registry (within three heartbeats of its death): its
requests end with an error naming it, and the fleet speaks for it to its partners as for its own engines.
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
import zmq.asyncio

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
from flotilla.server.remote_engine import RemoteEngine
from flotilla.server.router import NoEngineError, Router
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.messages import (
    AbortCmd,
    ActorFailedEvent,
    BlocksReleasedEvent,
    GenerateRequest,
    KVReadyEvent,
    RequestFailedEvent,
    SchedulerStatsEvent,
    SeqText,
    TextDelta,
    TransferPeer,
)
from flotilla.transport.registry import (
    HEARTBEAT_INTERVAL_S,
    EngineInfo,
    Heartbeat,
    InMemoryRegistry,
    Registry,
    Role,
    shared_registry,
)

log = logging.getLogger(__name__)

VISION_ENCODER = "vision_encoder/0"
"""An encoder engine's actor, by its registry address key."""

ROUTE_ATTEMPTS = 3
"""Routings of one request whose engine dies, or whose KV hand-off fails, before its first delta (Fleet.stream)."""


class HandOffError(EngineDeadError):
    """A disaggregated request's prompt KV did not reach its decode engine (nothing was streamed yet)."""


class RegistryView:
    """The registry as the router reads it: answers cached for `max_age_s` (no Redis round trip per request),
    engines this process saw die left out at once, before their entry is gone, and this process's own engines with
    their load as it is now (`local_load`; the registry's is as old as the last heartbeat)."""

    def __init__(self, registry: Registry, alive: Callable[[str], bool], max_age_s: float,
                 local_load: Callable[[str], float | None] = lambda engine_id: None) -> None:
        self.registry, self.alive, self.max_age_s, self.local_load = registry, alive, max_age_s, local_load
        self._cache: dict[tuple[str | None, str | None], tuple[float, list[EngineInfo]]] = {}

    async def engines(self, role: Role | None = None, model: str | None = None) -> list[EngineInfo]:
        now = time.monotonic()
        hit = self._cache.get((role, model))
        if hit is None or now - hit[0] > self.max_age_s:
            hit = self._cache[(role, model)] = (now, await self.registry.engines(role, model))
        out = []
        for e in hit[1]:
            if self.alive(e.engine_id):
                load = self.local_load(e.engine_id)
                out.append(e if load is None else msgspec.structs.replace(e, load=load))
        return out


def open_registry(url: str | None, ttl_s: float) -> Registry:
    """`memory` (or None): this process's memory; `redis://...`: a Redis server shared by several nodes."""
    if not shared_registry(url):
        return InMemoryRegistry(ttl_s=ttl_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from flotilla.transport.registry import RedisRegistry

        return RedisRegistry(url, ttl_s=ttl_s)
    raise ValueError(f"registry must be `memory` or a redis:// URL, got {url!r}")


class Fleet:
    """Start engines, register them, route requests to one engine or a prefill + decode pair."""

    def __init__(self, engines: list[tuple[str, EngineConfig]], model_name: str, placement: str = "process",
                 trace: bool = False, options: RuntimeOptions | None = None, registry: str | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, engine_host: str | None = None,
                 restarts: int = 0, restart_backoff_s: float = 1.0) -> None:
        """engine_host: with a shared (Redis) registry, the address this node's engines and reply inbox listen on
        for other nodes' front ends (default 127.0.0.1: several front ends of one machine). restarts: how many times
        in a row each engine is started again after a failure (EngineClient)."""
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.model = model_name
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registry_url = registry or "memory"
        self.registry = open_registry(registry, heartbeat_interval_s * 3)
        self.shared = not isinstance(self.registry, InMemoryRegistry)
        """Other nodes' front ends see this registry: route to their engines, and let them reach ours (TCP)."""
        self.engine_host = engine_host or "127.0.0.1"
        host = self.engine_host if self.shared else None
        self.roles = {name: cfg.disagg.role for name, cfg in engines}
        # beside encoder engines (this node's, or with a shared registry another's) an engine with image_encoder =
        # remote runs no vision encoder of its own: the router names one per request
        own = "encoder" not in self.roles.values() and not self.shared
        self.clients = {name: EngineClient(cfg, placement, trace, options, name=name, host=host, restarts=restarts,
                                           restart_backoff_s=restart_backoff_s,
                                           own_vision_encoder=own)
                        for name, cfg in engines}  # fmt: skip
        self.remote: dict[str, RemoteEngine] = {}
        """Other nodes' engines this front end has routed to, by engine id (dead ones until they register again)."""
        self._remote_roles: set[str] = set()  # roles of other nodes' live engines, at the last registry read
        self._zmq: zmq.asyncio.Context | None = None
        self._reply_inbox: Inbox | None = None
        self.reply_address: str | None = None
        """The inbox other nodes' engines answer this front end's requests at (shared registry only)."""
        self._remote_schedulers: dict[str, Outbox] = {}
        self._loops: list[asyncio.Task] = []
        self.view = RegistryView(self.registry, self._alive, max_age_s=heartbeat_interval_s / 4,
                                 local_load=lambda name: self._load(self.clients[name]) if name in self.clients
                                 else None)  # fmt: skip
        self.router = Router(self.view, model_name)
        self._heartbeats: dict[str, Heartbeat] = {}
        self._schedulers: dict[str, Outbox] = {}
        self._transfers: dict[str, tuple[str, str]] = {}  # transfer id -> (prefill, decode) while streaming
        self._ids = itertools.count()
        # random too: front ends of several nodes send to the same engines, and containers started together share
        # pids and start times (an engine refuses a request id it already runs)
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}-{uuid.uuid4().hex[:6]}"
        self._tasks: set[asyncio.Task] = set()
        self.routed = {name: 0 for name in self.clients}
        """Requests the router gave each engine (a disaggregated one counts for both of its engines)."""
        self.on_all_dead: list[Callable[[], None]] = []
        """Called once no engine is left alive or coming back (until then the server answers what it can, 503
        otherwise)."""

    # ---- life -----------------------------------------------------------------------------------------

    def _alive(self, engine_id: str) -> bool:
        client = self.clients.get(engine_id)
        if client is not None:
            return client._dead is None
        remote = self.remote.get(engine_id)  # another node's engine: alive while it is in the registry
        return self.shared and (remote is None or remote.alive)

    def _engine(self, info: EngineInfo) -> EngineClient | RemoteEngine:
        """The local engine, or the object that talks to another node's, for a registry entry."""
        client = self.clients.get(info.engine_id)
        if client is not None:
            return client
        remote = self.remote.get(info.engine_id)
        if remote is None:
            assert self._zmq is not None and self.reply_address is not None, "other nodes' engines need a shared registry"
            remote = self.remote[info.engine_id] = RemoteEngine(info, self._zmq, self.reply_address)
            self.routed.setdefault(info.engine_id, 0)
            log.info("routing to engine %s (%s) of another node: tokenizer at %s", remote.name, remote.role,
                     remote.of("tokenizer"))
        return remote

    async def start(self) -> None:
        await self._check_registry()  # before loading any model
        if self.shared:
            self._zmq = new_context()
            self._reply_inbox = Inbox(self._zmq, f"tcp://{self.engine_host}:0", (TextDelta, RequestFailedEvent))
            self.reply_address = self._reply_inbox.address
        results = await asyncio.gather(*(c.start() for c in self.clients.values()), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(c.stop() for c in self.clients.values()), return_exceptions=True)
            self._end_replies()
            raise failed[0]
        for name, client in self.clients.items():
            client.on_failure.append(lambda ev, name=name: self._engine_failed(name, ev))
            client.on_restarted.append(lambda name=name: self._spawn(self._register(name)))
            client.on_gave_up.append(self._check_all_dead)
            await self._register(name)
        if self.shared:
            await self._read_registry()
            self._loops = [asyncio.create_task(self._receive_replies(), name="fleet-replies"),
                           asyncio.create_task(self._watch_registry(), name="fleet-registry")]
            log.info("front end reply inbox for other nodes' engines: %s", self.reply_address)

    async def _register(self, name: str) -> None:
        """Engine `name` is ready (at start, or restarted with new addresses): reach its scheduler, and put it in the
        registry with a heartbeat."""
        client = self.clients[name]
        if self.roles[name] != "encoder":  # (an encoder engine has no scheduler, and no transfers to speak for)
            self._schedulers[name] = Outbox(client.runtime.zmq, client.runtime.endpoints.of("scheduler"))
        hb = Heartbeat(self.registry, self.engine_info(name), lambda c=client: self._load(c), self.heartbeat_interval_s)
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
        deadline = time.monotonic() + self.heartbeat_interval_s * 3  # an earlier run's entries expire by then
        while True:
            try:
                taken = {e.engine_id for e in await self.registry.engines()} & set(self.clients)
            except errors as e:
                await self.registry.close()
                raise RuntimeError(f"cannot reach the registry {self.registry_url}: {e}") from None
            if not taken:
                return
            if time.monotonic() > deadline:
                await self.registry.close()
                raise RuntimeError(f"engine ids {', '.join(sorted(taken))} are registered by another front end in "
                                   f"{self.registry_url}: give each node's front end its own --node-name")
            await asyncio.sleep(self.heartbeat_interval_s / 4)

    async def stop(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)  # engines being retired
        for hb in self._heartbeats.values():
            await hb.stop()
        for out in [*self._schedulers.values(), *self._remote_schedulers.values()]:
            out.close()
        for remote in self.remote.values():
            remote.close()
        await asyncio.gather(*(c.stop() for c in self.clients.values()), return_exceptions=True)
        self._end_replies()
        await self.registry.close()

    def _end_replies(self) -> None:
        """Close the shared reply inbox and end its context (end_context: a context left open, or ended with a plain
        term() while a socket is open, blocks whichever thread finalizes or terminates it); idempotent."""
        if self._reply_inbox is not None:
            self._reply_inbox.close()
            self._reply_inbox = None
        if self._zmq is not None:
            end_context(self._zmq)
            self._zmq = None

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
        """Some request can be served: a live colocated engine, or a live prefill and a live decode engine (of this
        node or, with a shared registry, of another)."""
        roles = {self.roles[n] for n, c in self.clients.items() if c.alive} | self._remote_roles
        return "both" in roles or {"prefill", "decode"} <= roles

    @property
    def restarting(self) -> bool:
        """Nothing can be served now, but an engine is being restarted."""
        return not self.alive and any(c.restarting for c in self.clients.values())

    @property
    def retry_after_s(self) -> int | None:
        """While restarting: seconds until the first engine is expected back; None otherwise."""
        waits = [w for c in self.clients.values() if (w := c.retry_after_s) is not None]
        return min(waits) if waits and not self.alive else None

    def restart_counts(self) -> dict[str, tuple[int, int]]:
        """Per engine of this node: (failures, restarts) since start."""
        return {name: (c.failures, c.restarts) for name, c in self.clients.items()}

    @property
    def num_pending(self) -> int:
        return sum(c.num_pending for c in self.clients.values()) + sum(r.num_pending for r in self.remote.values())

    @property
    def ready_detail(self) -> dict[str, dict[str, str]]:
        """The first engine's that serves requests (an encoder engine's has no worker)."""
        serving = [c for n, c in self.clients.items() if self.roles[n] != "encoder"]
        return (serving or list(self.clients.values()))[0].ready_detail

    @property
    def stats(self) -> SchedulerStatsEvent | None:
        """The live engines' state summed up (KV usage and hit rate averaged) for the model-wide gauges."""
        return sum_stats([c.stats for c in self.clients.values() if c.alive and c.stats is not None])

    def engine_stats(self) -> dict[str, tuple[str, SchedulerStatsEvent | None, bool, int]]:
        """Per engine: (role, latest stats, alive, requests routed to it)."""
        out = {name: (self.roles[name], c.stats, c.alive, self.routed[name]) for name, c in self.clients.items()}
        for name, r in self.remote.items():  # other nodes' engines: their stats are their own front end's
            out[name] = (r.role, None, r.alive, self.routed.get(name, 0))
        return out

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{self._prefix}-{next(self._ids)}"

    def fan_out(self, req: GenerateRequest) -> list[GenerateRequest]:
        return next(iter(self.clients.values())).fan_out(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[SeqText]:
        """Route one engine request (n == 1) and yield its deltas. When an engine it went to dies before its first
        delta (e.g. another node's engine that died moments ago and is still in the registry), or its KV hand-off
        fails, it is routed again, up to ROUTE_ATTEMPTS times in all; a failure after the first delta ends it."""
        for attempt in range(1, ROUTE_ATTEMPTS + 1):
            started = False
            engines: list[str] = []
            # a new id per routing: what the engines say late about an earlier one (its abort) must not reach this one
            routed = req if attempt == 1 else msgspec.structs.replace(req, rid=f"{req.rid}~{attempt}")
            try:
                async for item in self._route_once(routed, engines):
                    started = True
                    yield item
                return
            except EngineDeadError as e:
                lost = isinstance(e, HandOffError) or not all(self._alive(n) for n in engines)
                if started or attempt == ROUTE_ATTEMPTS or not engines or not lost:
                    raise
                log.warning("request %s: %s before its first token; routing it again", req.rid, e)

    async def _route_once(self, req: GenerateRequest, engines: list[str]) -> AsyncIterator[SeqText]:
        """One routing of the request: `engines` gets the engines it went to."""
        try:
            roles = {e.role for e in await self.view.engines(model=self.model)}
            pair = "prefill" in roles and "decode" in roles
            if pair:
                prefill, decode = await self.router.pick_pair()
                engines += [prefill.engine_id, decode.engine_id]
            else:
                info = await self.router.pick()
                engines.append(info.engine_id)
            if req.images and "encoder" in roles and (encoder := await self.router.pick_encoder()) is not None:
                engines.append(encoder.engine_id)  # (its prefill's encoder actors ask it for the embeddings)
                req = msgspec.structs.replace(req, vision_encoder=encoder.addresses[VISION_ENCODER])
            source = (self._stream_pd(req, self._engine(prefill), self._engine(decode)) if pair
                      else self._engine(info).stream(req))
        except NoEngineError:
            live = ", ".join([f"{n} ({self.roles[n]})" for n, c in self.clients.items() if c.alive]
                             + [f"{n} ({r.role})" for n, r in self.remote.items() if r.alive]) or "none"
            raise EngineDeadError(f"no engine can serve this request: it needs a colocated engine or a prefill and a "
                                  f"decode engine; live engines: {live}") from None
        for name in engines:
            self.routed[name] = self.routed.get(name, 0) + 1
        try:
            async for item in source:
                yield item
        finally:
            await source.aclose()
            for name in engines:
                self.router.finished(name)

    async def _stream_pd(self, req: GenerateRequest, prefill: EngineClient | RemoteEngine,
                         decode: EngineClient | RemoteEngine) -> AsyncIterator[SeqText]:
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
        p_eps, d_eps = _addresses(prefill), _addresses(decode)
        if isinstance(prefill, RemoteEngine) or isinstance(decode, RemoteEngine):
            req = msgspec.structs.replace(req, reply_to=self.reply_address)  # both engines answer this front end here
        try:
            await decode.to_tokenizer.send(msgspec.structs.replace(req, transfer_id=tid, peer=TransferPeer(
                engine=prefill.name, scheduler=p_eps.of("scheduler"), kv=p_eps.instances("kv_migration"))))
            await prefill.to_tokenizer.send(msgspec.structs.replace(req, transfer_id=tid, peer=TransferPeer(
                engine=decode.name, scheduler=d_eps.of("scheduler"))))
            detached = False
            async for item in deltas(queue, outcome):
                if not detached and item.finish_reason == "error":  # the hand-off failed (a failed migration, the
                    outcome.failed = True  # prefill side's failure): say which pair, and let stream() route it again
                    why = prefill._dead or decode._dead
                    raise HandOffError(f"the prompt's KV did not reach decode engine {decode.name} from prefill "
                                       f"engine {prefill.name}" + (f" ({why})" if why else ""))
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
        """Engine `name` failed (its client stops its actors, and restarts them if it may): out of the registry, and
        its partners free what they hold for it."""
        hb = self._heartbeats.pop(name, None)
        if hb is not None:
            await hb.stop()  # out of the registry: the router picks it no more
        await self._speak_for(name)
        out = self._schedulers.pop(name, None)
        if out is not None:
            out.close()

    def _check_all_dead(self) -> None:
        if all(c.gave_up for c in self.clients.values()):
            for cb in self.on_all_dead:
                cb()

    async def _speak_for(self, name: str) -> None:
        """Engine `name` died: its partners in transfers this front end routed free what they hold for it."""
        for tid, (p, d) in list(self._transfers.items()):
            if name not in (p, d):
                continue
            del self._transfers[tid]
            out = self._scheduler_of(p if d == name else d)
            if out is None:  # both ends dead
                continue
            if d == name:
                await out.send(BlocksReleasedEvent(transfer_id=tid))
            else:
                await out.send(KVReadyEvent(transfer_id=tid, block_ids=np.zeros(0, np.int32), num_tokens=0,
                                            first_token=-1, src_engine=p, error=f"prefill engine {p} died"))  # fmt: skip

    def _scheduler_of(self, name: str) -> Outbox | None:
        """An outbox to a live engine's scheduler (this node's or another's); None when it is dead."""
        if name in self.clients:
            return self._schedulers.get(name) if self.clients[name].alive else None
        remote = self.remote.get(name)
        if remote is None or not remote.alive or self._zmq is None:
            return None
        out = self._remote_schedulers.get(name)
        if out is None:
            out = self._remote_schedulers[name] = Outbox(self._zmq, remote.of("scheduler"))
        return out

    # ---- other nodes' engines (shared registry) ----------------------------------------------------------

    async def _receive_replies(self) -> None:
        """Other nodes' engines' answers (and, for a pair with one of them, this node's engine's too), to the
        queue of the request they name."""
        assert self._reply_inbox is not None
        while True:
            msg = await self._reply_inbox.recv()
            for item in msg.items if isinstance(msg, TextDelta) else [msg]:
                queue = self._queue_of(item.rid)
                if queue is not None:
                    queue.put_nowait(item)

    def _queue_of(self, rid: str):
        for engine in itertools.chain(self.clients.values(), self.remote.values()):
            queue = engine._pending.get(rid)
            if queue is not None:
                return queue
        return None

    async def _watch_registry(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self._read_registry()
            except Exception as e:  # a registry outage: keep the engines known so far, try again
                log.warning("cannot read the registry %s: %s", self.registry_url, e)

    async def _read_registry(self) -> None:
        """Other nodes' live engines: their roles count for `alive`; those that left the registry are dead."""
        live = {e.engine_id: e for e in await self.registry.engines(model=self.model)}
        self._remote_roles = {e.role for name, e in live.items() if name not in self.clients}
        for name, remote in list(self.remote.items()):
            entry = live.get(name)
            if remote.alive and entry is None:
                reason = (f"engine {name} (of another node) left the registry {self.registry_url}: it missed its "
                          "heartbeats, or its front end retired it")  # fmt: skip
            elif remote.alive and dict(entry.addresses) != remote.endpoints.actors:
                reason = f"engine {name} (of another node) was restarted"  # between two reads of the registry
            else:
                reason = None
            if reason is not None:
                log.error("%s; the other engines keep serving", reason)
                remote.died(reason)
                await self._speak_for(name)
                out = self._remote_schedulers.pop(name, None)
                if out is not None:
                    out.close()
                remote.close()
            if entry is not None and not remote.alive:  # registered again (restarted): a fresh one when next routed
                del self.remote[name]
                if reason is None:
                    remote.close()
            # (one that left is kept, dead, for /metrics: flotilla_engine_alive 0)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _addresses(engine: EngineClient | RemoteEngine):
    """Where an engine's actors listen (`of(actor)`, `instances(actor)`): a local engine's Endpoints, or the
    addresses another node's engine registered."""
    return engine.runtime.endpoints if isinstance(engine, EngineClient) else engine
