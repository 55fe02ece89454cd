"""KVMigrationActor: moves a prompt's KV blocks from a prefill engine into a decode engine, off ZeroMQ.

One per worker rank, in the worker's process group (actors/topology.py `process`), so it reaches the
rank's KV cache through `flotilla.actors.worker.local_runner` and never over a socket. At start it
registers that memory with a KV transfer engine (transport/kv_transfer.py: dlslime TCP between
processes or hosts; a local copy when both engines share one process), one region per layer.

Both roles run it. On a prefill engine it only answers KVEndpointRequest (its transfer engine serves
the reads; dlslime's reads are one-sided). On a decode engine it executes MigrateKVCmd:

  1. the first command naming a prefill rank's inbox asks that actor for its endpoint and regions
     (KVEndpointRequest -> KVEndpointEvent), connects, and checks the layouts match (layers, block bytes);
  2. the (src block, dst block) pairs become merged byte ranges per layer (`kv_block_ranges`), read in
     calls of at most 32 ranges (the transfer engine validates every range against both regions);
  3. MigrationDoneEvent goes to the scheduler, with the bytes moved, or with an error when the peer is
     unreachable, its layout differs, or the read times out (`kv_transfer_timeout_s`).

Reads from one peer run one at a time (dlslime opens a connection per range; concurrent reads on one
endpoint gain nothing on TCP), while the actor keeps receiving.

GPU KV caches: dlslime's TCP transport reads CPU addresses only. A CUDA KV cache needs either staging
through pinned host buffers (copy the blocks device->host on the prefill side before announcing them,
host->device on the decode side after the read) or a GPU-to-GPU path (CUDA IPC / NCCL within a host,
dlslime RDMA across hosts). Neither is built yet: `KVMemory.of_runner` refuses a CUDA cache with the
dlslime_tcp backend, so a GPU prefill or decode engine fails at start with that message instead of
moving wrong bytes. The `local` backend copies device tensors directly and works for one process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.worker import local_runner
from flotilla.config import EngineConfig
from flotilla.transport.kv_transfer import (
    KVTransferEngine,
    KVTransferError,
    create_kv_transfer_engine,
    kv_block_bytes,
    kv_block_ranges,
)
from flotilla.transport.messages import (
    KVEndpointEvent,
    KVEndpointRequest,
    Message,
    MigrateKVCmd,
    MigrationDoneEvent,
    RegionInfo,
)

log = logging.getLogger(__name__)

RUNNER_POLL_S = 0.05
"""How often setup looks for the worker's runner while the worker loads its model, seconds."""


class KVMemory:
    """A rank's KV cache as the data plane sees it: one contiguous tensor per layer, same block layout."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        if not caches:
            raise ValueError("a KV cache needs at least one layer")
        self.caches = caches
        self.block_bytes = kv_block_bytes(caches[0])
        if any(kv_block_bytes(c) != self.block_bytes for c in caches):
            raise ValueError("every layer's KV cache must have the same block size in bytes")

    @classmethod
    def of_runner(cls, caches: list[torch.Tensor], backend: str) -> KVMemory:
        device = caches[0].device if caches else torch.device("cpu")
        if device.type != "cpu" and backend != "local":
            raise KVTransferError(
                f"the KV cache is on {device}, and the {backend} backend moves CPU memory only: GPU KV migration "
                "(pinned-host staging, CUDA IPC / NCCL, dlslime RDMA) is not implemented yet; run prefill/decode "
                "engines on CPU, or with kv_transfer_backend=local in one process")
        return cls(caches)


@dataclass
class _Peer:
    """A prefill rank we read from."""

    info: KVEndpointEvent | None = None
    error: str | None = None
    waiting: list[MigrateKVCmd] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class KVMigrationActor(Actor):
    """The data-plane end of one worker rank."""

    kind = "kv_migration"
    inbox = (MigrateKVCmd, KVEndpointRequest, KVEndpointEvent)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.worker = str(ctx.config.get("workers", "worker"))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.rank = ctx.instance
        self.engine: KVTransferEngine | None = None
        self.memory: KVMemory | None = None
        self.regions: list[RegionInfo] = []
        self._peers: dict[str, _Peer] = {}  # prefill rank inbox -> what we know of it
        self._tasks: set[asyncio.Task] = set()
        self.bytes_moved = 0

    async def setup(self) -> dict[str, str]:
        runner = local_runner(self.worker, self.rank)
        deadline = asyncio.get_running_loop().time() + self.ctx.options.ready_timeout_s
        while runner is None:  # the worker of this process loads its model concurrently
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no worker {self.worker}/{self.rank} in this process: the KV-migration actor "
                                   "must share its worker's process group")
            await asyncio.sleep(RUNNER_POLL_S)
            runner = local_runner(self.worker, self.rank)
        dis = self.config.disagg
        self.memory = KVMemory.of_runner(runner.kv_caches, dis.kv_transfer_backend)
        options: dict[str, object] = {"timeout_s": dis.kv_transfer_timeout_s}
        if dis.kv_transfer_backend != "local":
            options["host"] = dis.kv_host
        self.engine = create_kv_transfer_engine(dis.kv_transfer_backend, **options)
        self.regions = [self.engine.register(f"kv.layer{i}", cache) for i, cache in enumerate(self.memory.caches)]
        ep = self.engine.endpoint_info()
        where = f"{ep.host}:{ep.port}" if ep.host else ep.engine_id
        return {"kv_backend": ep.backend, "kv_endpoint": where, "kv_layers": str(len(self.regions))}

    async def teardown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engine is not None:
            self.engine.close()
        await super().teardown()

    # ---- the prefill side: describe our memory ---------------------------------------------------------

    async def on_kv_endpoint_request(self, req: KVEndpointRequest) -> None:
        assert self.engine is not None and self.memory is not None
        if req.rank != self.rank:
            ev = KVEndpointEvent(rank=self.rank, key=req.key, endpoint=self.engine.endpoint_info(),
                                 error=f"asked for rank {req.rank}'s KV at rank {self.rank}'s actor")
        else:
            ev = KVEndpointEvent(rank=self.rank, key=req.key, endpoint=self.engine.endpoint_info(),
                                 regions=self.regions, block_bytes=self.memory.block_bytes)
        await self.send_to(req.reply_to, ev)

    # ---- the decode side: migrate ---------------------------------------------------------------------

    async def on_migrate_kv_cmd(self, cmd: MigrateKVCmd) -> None:
        if self.rank >= len(cmd.src_kv):
            await self._done(cmd, error=f"the prefill engine {cmd.src_engine} has no rank {self.rank} "
                                        f"({len(cmd.src_kv)} KV-migration actors)")
            return
        src = cmd.src_kv[self.rank]
        peer = self._peers.get(src)
        if peer is None:
            peer = self._peers[src] = _Peer()
            await self.send_to(src, KVEndpointRequest(rank=self.rank, reply_to=self.address, key=src))
            self._spawn(self._expire_request(src, peer))
        if peer.info is None and peer.error is None:
            peer.waiting.append(cmd)
            return
        self._spawn(self._migrate(cmd, peer))

    async def on_kv_endpoint_event(self, ev: KVEndpointEvent) -> None:
        src = ev.key
        peer = self._peers.get(src)
        if peer is None or peer.info is not None or peer.error is not None:
            log.warning("%s: unexpected KV endpoint of %s (for %s) ignored", self.label, ev.endpoint.engine_id, src)
            return
        peer.error = ev.error or self._layout_mismatch(ev)
        if peer.error is None:
            try:
                await asyncio.to_thread(self.engine.connect, ev.endpoint)  # a blocking TCP connect
                peer.info = ev
            except KVTransferError as e:
                peer.error = str(e)
        waiting, peer.waiting = peer.waiting, []
        if peer.error is not None:
            del self._peers[src]  # the next command asks again (the peer may come back)
        for cmd in waiting:
            self._spawn(self._migrate(cmd, peer))

    def _layout_mismatch(self, ev: KVEndpointEvent) -> str | None:
        assert self.memory is not None
        if len(ev.regions) != len(self.regions):
            return f"the prefill engine's KV has {len(ev.regions)} layers, this one {len(self.regions)}"
        if ev.block_bytes != self.memory.block_bytes:
            return (f"a KV block of one layer is {ev.block_bytes} bytes on the prefill engine, "
                    f"{self.memory.block_bytes} here (model, dtype or block size differ)")
        return None

    async def _expire_request(self, src: str, peer: _Peer) -> None:
        await asyncio.sleep(self.config.disagg.kv_transfer_timeout_s)
        if peer.info is None and peer.error is None:
            peer.error = f"the KV-migration actor at {src} did not answer within " \
                         f"{self.config.disagg.kv_transfer_timeout_s:g} s"
            self._peers.pop(src, None)
            waiting, peer.waiting = peer.waiting, []
            for cmd in waiting:
                await self._done(cmd, error=peer.error)

    async def _migrate(self, cmd: MigrateKVCmd, peer: _Peer) -> None:
        if peer.error is not None or peer.info is None:
            await self._done(cmd, error=peer.error or "no KV endpoint")
            return
        assert self.engine is not None and self.memory is not None
        pairs = list(zip(cmd.src_block_ids.tolist(), cmd.dst_block_ids.tolist()))
        before = self.engine.bytes_read
        error = None
        try:
            if pairs:
                ranges = kv_block_ranges(pairs, [0], [0], self.memory.block_bytes)
                async with peer.lock:
                    for remote, local in zip(peer.info.regions, self.regions):
                        await self.engine.read(remote, ranges, local)
        except KVTransferError as e:
            error = f"KV migration from {cmd.src_engine} failed: {e}"
            if self._peers.get(cmd.src_kv[self.rank]) is peer:
                del self._peers[cmd.src_kv[self.rank]]  # ask and connect again on the next command
        moved = self.engine.bytes_read - before
        self.bytes_moved += moved
        await self._done(cmd, error=error, num_bytes=moved)

    async def _done(self, cmd: MigrateKVCmd, error: str | None = None, num_bytes: int = 0) -> None:
        if error is not None:
            log.error("%s: transfer %s: %s", self.label, cmd.transfer_id, error)
        await self.send(self.scheduler, MigrationDoneEvent(transfer_id=cmd.transfer_id, error=error, rank=self.rank,
                                                           num_bytes=num_bytes))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # actor boundary (a task of this actor): log; the migration's own errors are reported
            log.exception("%s: migration task failed", self.label)

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        if isinstance(msg, MigrateKVCmd):  # the scheduler must not wait for a migration that cannot happen
            await self._done(msg, error=f"KV migration actor failed: {type(exc).__name__}: {exc}")
