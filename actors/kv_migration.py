"""KVMigrationActor: moves a prompt's KV blocks from a prefill engine into a decode engine, off ZeroMQ.

One per worker rank, in the worker's process group (actors/topology.py `process`), so it reaches the
rank's KV cache through `flotilla.actors.worker.local_runner` and never over a socket. At start it
registers memory with a KV transfer engine (transport/kv_transfer.py: dlslime TCP between processes or
hosts; CUDA IPC between GPU caches of one host; a local copy when both engines share one process): the KV
cache itself, one region for all layers when they are views of one allocation (the worker's: a migration is then
one read of every layer's ranges, one gather and one scatter under CUDA IPC), else one region per layer,
or, when the KV cache is not in memory the backend can read (a GPU cache under dlslime TCP), host
staging buffers instead (see below).

Both roles run it. On a prefill engine it answers KVEndpointRequest (and KVStageRequest when staged);
the backend's reads are one-sided. On a decode engine it executes MigrateKVCmd:

  1. the first command naming a prefill rank's inbox asks that actor for its endpoint and regions
     (KVEndpointRequest -> KVEndpointEvent), connects, and checks the layouts match (layers, block bytes);
  2. the (src block, dst block) pairs become merged byte ranges (`kv_block_table`), read in calls of as many
     ranges as the backend takes (dlslime: 32; the transfer engine validates every range against both regions);
  3. MigrationDoneEvent goes to the scheduler, with the bytes moved, or with an error when the peer is
     unreachable, its layout differs, or the read times out (`kv_transfer_timeout_s`).

Staging (`kv_staging`: auto when the cache is on a GPU and the backend reads host memory only; always
forces it, so the protocol runs and is tested on CPU too). A migration then goes in rounds of at most
`kv_staging_blocks` blocks: the decode side asks the prefill side to copy the round's blocks into slots
0..n-1 of a host buffer kept for this requester (KVStageRequest -> KVStagedEvent), reads those slots,
which are contiguous, into its own host buffer when its cache needs staging too, and copies them into
its KV blocks. The prefill side's copy runs after the step that computed the blocks returned its
sampled token (so the device finished writing them); the decode side's copy into the device finishes
before MigrationDone, so no step reads the blocks earlier. On a GPU staging uses pinned host buffers and plain
device copies (cuda_ipc and torch_dist avoid the host hop within a host; dlslime RDMA would across hosts).

torch_dist (transport/kv_transfer_torch.py) is two-sided: the KVEndpointRequest makes the prefill rank
announce a 2-rank process group for this requester alone (a TCPStore on its kv_host and a free port), which
the decode rank joins on connect (NCCL on GPUs, gloo on CPU; never the default group, which TP/EP may hold).
A migration then checks every (src, dst) pair against both caches, asks with KVSendRequest, and once the
prefill rank agrees (KVSendEvent) receives rounds of at most `kv_staging_blocks` blocks (all layers in one
buffer in the cache's memory: no host hop on a GPU) and scatters them into its blocks before MigrationDone.
The prefill rank packs each round from its blocks, which stay pinned until BlocksReleased.

The prefill side serves blocks only for the transfers its own scheduler announced: the scheduler sends each
KVReadyEvent to its KV-migration ranks before the decode side hears of it, and the BlocksReleasedEvent that ends
it; a KVStageRequest or KVSendRequest for another transfer, or for blocks the transfer does not hold, is refused
(one for a transfer not announced yet waits up to ANNOUNCE_GRACE_S for its announcement). dlslime's one-sided reads
of unstaged memory do not pass through this actor and are bounded only by the registered regions.

A hybrid model's recurrent state (Qwen3.5's delta nets) moves with the prompt's blocks: the prefill side saves it
into a snapshot slot its transfer holds (actors/disagg.py), and a migration also reads that row of every state pool
(KVEndpointEvent.state_regions) into the snapshot slot the decode side gave it (MigrateKVCmd.dst_state_slot), on
unstaged reads only for now (dlslime, cuda_ipc and local; staging and torch_dist are refused at start for such a
model).

Migrations from one peer run one at a time (dlslime opens a connection per range; concurrent reads on
one endpoint gain nothing on TCP), and all of them while this rank stages; the actor keeps receiving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.kv_memory import KVMemory
from flotilla.actors.worker import local_runner
from flotilla.config import EngineConfig
from flotilla.transport.kv_transfer import (
    KVTransferEngine,
    KVTransferError,
    create_kv_transfer_engine,
    kv_block_table,
)
from flotilla.transport.kv_transfer_torch import TorchDistEngine, check_pairs
from flotilla.transport.messages import (
    BlocksReleasedEvent,
    KVEndpointEvent,
    KVEndpointRequest,
    KVReadyEvent,
    KVSendEvent,
    KVSendRequest,
    KVStagedEvent,
    KVStageRequest,
    Message,
    MigrateKVCmd,
    MigrationDoneEvent,
    RegionInfo,
)

log = logging.getLogger(__name__)

RUNNER_POLL_S = 0.05
"""How often setup looks for the worker's runner while the worker loads its model, seconds."""
ANNOUNCE_GRACE_S = 2.0
"""How long a request for a transfer this rank has not heard of waits for its scheduler's announcement (the two
reach the inbox from different senders, so in either order), seconds."""
MAX_WAITING_REQUESTS = 1024
"""Requests for unannounced transfers held at once; more are refused at once."""


class _PeerSilent(KVTransferError):
    """The prefill rank did not answer a request in time: gone or stuck, for every migration from it."""


@dataclass
class _Peer:
    """A prefill rank we read from."""

    info: KVEndpointEvent | None = None
    error: str | None = None
    """Why no migration from it can run: its endpoint failed, or it fell silent (the migrations queued behind the
    one that found out fail at once instead of each waiting out kv_transfer_timeout_s)."""
    waiting: list[MigrateKVCmd] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class KVMigrationActor(Actor):
    """The data-plane end of one worker rank."""

    kind = "kv_migration"
    inbox = (MigrateKVCmd, KVEndpointRequest, KVEndpointEvent, KVStageRequest, KVStagedEvent, KVSendRequest,
             KVSendEvent, KVReadyEvent, BlocksReleasedEvent)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.worker = str(ctx.config.get("workers", "worker"))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.rank = ctx.instance
        self.engine: KVTransferEngine | None = None
        self.memory: KVMemory | None = None
        self.staged = False
        """This rank's KV is reached through staging buffers."""
        self.regions: list[RegionInfo] = []
        """The KV layers' regions (unstaged), or this rank's read staging region (staged)."""
        self.layer_blocks = 0
        """Unstaged with one region for every layer: blocks per layer in it (layer l's block b at l * layer_blocks +
        b); 0 with a region per layer."""
        self.state_regions: list[RegionInfo] = []
        """A hybrid model's recurrent-state pools (kv_migration moves a transfer's snapshot row of each)."""
        self._read_stage: torch.Tensor | None = None
        self._serve_stage: dict[str, tuple[torch.Tensor, RegionInfo]] = {}  # requester key -> its staging region
        self._replies: dict[tuple[str, str], asyncio.Future] = {}  # (peer key, transfer) -> staged / send answer
        self._stage_lock = asyncio.Lock()
        self._peers: dict[str, _Peer] = {}  # prefill rank inbox -> what we know of it
        self._tasks: set[asyncio.Task] = set()
        self.bytes_moved = 0
        self._announced: dict[str, frozenset[int]] = {}  # transfer id -> the blocks its scheduler said it holds
        self._unannounced: dict[str, list[KVStageRequest | KVSendRequest]] = {}  # waiting for their announcement

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
        self.memory = KVMemory(runner.kv_caches, runner.state_pools, runner.num_state_slots)
        self.staged = self.memory.needs_staging(dis)
        if self.memory.states and (self.staged or dis.kv_transfer_backend == "torch_dist"):
            raise RuntimeError(f"a model with recurrent state moves its states over unstaged reads only: "
                               f"kv_transfer_backend {dis.kv_transfer_backend!r} with staging {self.staged} does not "
                               "carry them yet (use dlslime, reading the memory where it is)")
        options: dict[str, object] = {"timeout_s": dis.kv_transfer_timeout_s}
        if dis.kv_transfer_backend != "local":
            options["host"] = dis.kv_host
        self.engine = create_kv_transfer_engine(dis.kv_transfer_backend, **options)
        if self.staged:
            self._read_stage = self.memory.staging_buffer(dis.kv_staging_blocks)
            self.regions = [self.engine.register("stage.read", self._read_stage)]
            if self.memory.device.type == "cuda":
                log.warning("%s: GPU KV moves through host staging buffers; this path has not run on a GPU yet",
                            self.label)
        elif self.memory.whole is not None and not isinstance(self.engine, TorchDistEngine):  # (it sends per layer)
            self.regions = [self.engine.register("kv", self.memory.whole)]
            self.layer_blocks = self.memory.caches[0].shape[0]
        else:
            self.regions = [self.engine.register(f"kv.layer{i}", c) for i, c in enumerate(self.memory.caches)]
        self.state_regions = [self.engine.register(f"state.{i}", t) for i, t in enumerate(self.memory.states)]
        ep = self.engine.endpoint_info()
        where = (f"{ep.host}:{ep.port}" if ep.port else ep.host) or ep.engine_id  # torch_dist: a port per pair
        return {"kv_backend": ep.backend, "kv_endpoint": where, "kv_layers": str(len(self.memory.caches)),
                "kv_staged": str(self.staged).lower()}

    async def teardown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engine is not None:
            self.engine.close()
        await super().teardown()

    # ---- the prefill side: describe our memory, stage blocks ------------------------------------------

    async def on_kv_endpoint_request(self, req: KVEndpointRequest) -> None:
        assert self.engine is not None and self.memory is not None
        ep = self.engine.endpoint_info()
        if req.rank == self.rank and isinstance(self.engine, TorchDistEngine):
            await self._announce_pair(req)
            return
        if req.rank != self.rank:
            ev = KVEndpointEvent(rank=self.rank, key=req.key, endpoint=ep,
                                 error=f"asked for rank {req.rank}'s KV at rank {self.rank}'s actor")
        elif self.staged:
            blocks = self.config.disagg.kv_staging_blocks
            if req.reply_to not in self._serve_stage:  # each requester its own region: rounds never overlap
                buf = self.memory.staging_buffer(blocks)
                self._serve_stage[req.reply_to] = (buf, self.engine.register(f"stage.{len(self._serve_stage)}", buf))
            ev = KVEndpointEvent(rank=self.rank, key=req.key, endpoint=ep, regions=[self._serve_stage[req.reply_to][1]],
                                 block_bytes=self.memory.block_bytes, staging_blocks=blocks,
                                 kv_dtype=self.memory.kv_dtype)
        else:
            ev = KVEndpointEvent(rank=self.rank, key=req.key, endpoint=ep, regions=self.regions,
                                 block_bytes=self.memory.block_bytes, layer_blocks=self.layer_blocks,
                                 kv_dtype=self.memory.kv_dtype, state_regions=self.state_regions,
                                 state_row_bytes=self.memory.state_row_bytes, state_row_base=self.memory.state_row_base)
        await self.send_to(req.reply_to, ev)

    async def _announce_pair(self, req: KVEndpointRequest) -> None:
        """torch_dist: a fresh process group for this requester; it joins the store we announce."""
        assert isinstance(self.engine, TorchDistEngine) and self.memory is not None
        try:
            ep = self.engine.listen(req.reply_to)
        except KVTransferError as e:
            await self.send_to(req.reply_to, KVEndpointEvent(rank=self.rank, key=req.key,
                                                             endpoint=self.engine.endpoint_info(), error=str(e)))
            return
        await self.send_to(req.reply_to, KVEndpointEvent(rank=self.rank, key=req.key, endpoint=ep, regions=self.regions,
                                                         block_bytes=self.memory.block_bytes,
                                                         kv_dtype=self.memory.kv_dtype))
        self._spawn(self._accept_pair(req.reply_to))

    async def _accept_pair(self, requester: str) -> None:
        assert isinstance(self.engine, TorchDistEngine)
        try:
            await self.engine.accept(requester)
        except KVTransferError as e:  # the requester's connect fails too and reports it
            log.warning("%s: KV pair with %s not built: %s", self.label, requester, e)

    async def on_kv_ready_event(self, ev: KVReadyEvent) -> None:
        """Our scheduler announces a transfer: serve its blocks until it is released."""
        self._announced[ev.transfer_id] = frozenset(ev.block_ids.tolist())
        for req in self._unannounced.pop(ev.transfer_id, []):
            await self._dispatch(req)

    async def on_blocks_released_event(self, ev: BlocksReleasedEvent) -> None:
        self._announced.pop(ev.transfer_id, None)

    async def _admitted(self, req: KVStageRequest | KVSendRequest) -> bool:
        """Whether to serve `req` now: its transfer was announced and holds its blocks. A request for a transfer not
        announced (yet) waits ANNOUNCE_GRACE_S for it; one that is refused gets its error answer here."""
        blocks = self._announced.get(req.transfer_id)
        if blocks is None:
            waiting = sum(len(v) for v in self._unannounced.values())
            if waiting < MAX_WAITING_REQUESTS:
                self._unannounced.setdefault(req.transfer_id, []).append(req)
                self._spawn(self._expire_unannounced(req))
                return False
            error = f"transfer {req.transfer_id} was not announced by this engine's scheduler"
        elif not blocks.issuperset(req.block_ids.tolist()):
            error = f"blocks asked for are not the ones transfer {req.transfer_id} holds"
        else:
            return True
        await self._refuse(req, error)
        return False

    async def _expire_unannounced(self, req: KVStageRequest | KVSendRequest) -> None:
        await asyncio.sleep(ANNOUNCE_GRACE_S)
        waiting = self._unannounced.get(req.transfer_id, [])
        if any(r is req for r in waiting):  # (not announced meanwhile)
            waiting[:] = [r for r in waiting if r is not req]
            if not waiting:
                del self._unannounced[req.transfer_id]
            await self._refuse(req, f"transfer {req.transfer_id} was not announced by this engine's scheduler")

    async def _refuse(self, req: KVStageRequest | KVSendRequest, error: str) -> None:
        log.warning("%s: refused %s from %s: %s", self.label, type(req).__name__, req.reply_to, error)
        answer = KVStagedEvent if isinstance(req, KVStageRequest) else KVSendEvent
        await self.send_to(req.reply_to, answer(key=req.key, transfer_id=req.transfer_id, error=error))

    async def on_kv_send_request(self, req: KVSendRequest) -> None:
        assert self.memory is not None
        if not await self._admitted(req):
            return
        ids = req.block_ids.tolist()
        num_blocks = self.memory.caches[0].shape[0]
        bad = [b for b in ids if not 0 <= b < num_blocks]
        error = None
        if not isinstance(self.engine, TorchDistEngine) or not self.engine.serves(req.reply_to):
            error = f"no KV pair with {req.reply_to} (ask for the endpoint first)"
        elif bad:
            error = f"blocks {bad[:8]} are outside this cache's {num_blocks} blocks"
        elif req.round_blocks < 1:
            error = f"round_blocks must be at least 1, got {req.round_blocks}"
        await self.send_to(req.reply_to, KVSendEvent(key=req.key, transfer_id=req.transfer_id, error=error))
        if error is None:  # sent in request order: the pair's lock is first come, first served
            self._spawn(self._send_blocks(req, ids))

    async def _send_blocks(self, req: KVSendRequest, ids: list[int]) -> None:
        assert isinstance(self.engine, TorchDistEngine) and self.memory is not None
        try:
            await self.engine.send_blocks(req.reply_to, [r.name for r in self.regions], ids, self.memory.block_bytes,
                                          req.round_blocks)
        except KVTransferError as e:  # the receiver's recv fails as well and reports to its scheduler
            log.warning("%s: transfer %s: sending KV to %s failed: %s", self.label, req.transfer_id, req.reply_to, e)

    async def on_kv_stage_request(self, req: KVStageRequest) -> None:
        assert self.memory is not None
        if not await self._admitted(req):
            return
        entry = self._serve_stage.get(req.reply_to)
        ids = req.block_ids.tolist()
        error = None
        if entry is None:
            error = f"no staging region for {req.reply_to} (ask for the endpoint first)"
        elif len(ids) > entry[0].shape[1] or any(not 0 <= b < self.memory.caches[0].shape[0] for b in ids):
            error = f"cannot stage blocks {ids[:8]}...: {len(ids)} blocks, {entry[0].shape[1]} slots"
        else:
            await asyncio.to_thread(self.memory.stage_out, entry[0], ids)
        await self.send_to(req.reply_to, KVStagedEvent(key=req.key, transfer_id=req.transfer_id, error=error))

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

    async def on_kv_staged_event(self, ev: KVStagedEvent | KVSendEvent) -> None:
        fut = self._replies.pop((ev.key, ev.transfer_id), None)
        if fut is not None and not fut.done():
            fut.set_result(ev.error)

    async def on_kv_send_event(self, ev: KVSendEvent) -> None:
        await self.on_kv_staged_event(ev)

    def _layout_mismatch(self, ev: KVEndpointEvent) -> str | None:
        assert self.memory is not None
        layers = len(self.memory.caches)
        per_layer = ev.staging_blocks or ev.layer_blocks  # one region of layers x per_layer blocks, or one per layer
        if not per_layer:
            theirs = len(ev.regions)
        elif ev.regions and ev.block_bytes:
            theirs = ev.regions[0].length // (ev.block_bytes * per_layer)
        else:
            theirs = 0
        if theirs != layers:
            return f"the prefill engine's KV has {theirs} layers, this one {layers}"
        if ev.kv_dtype and ev.kv_dtype != self.memory.kv_dtype:
            return (f"the prefill engine's KV cache holds {ev.kv_dtype}, this one {self.memory.kv_dtype} "
                    "(kv_cache_dtype or dtype differ)")
        if ev.block_bytes != self.memory.block_bytes:
            return (f"a KV block of one layer is {ev.block_bytes} bytes on the prefill engine, "
                    f"{self.memory.block_bytes} here (model, dtype, block size or tensor parallelism differ)")
        if ev.state_row_bytes != self.memory.state_row_bytes:
            return (f"the recurrent states differ: rows of {ev.state_row_bytes} bytes on the prefill engine, "
                    f"{self.memory.state_row_bytes} here (model, dtype or tensor parallelism differ)")
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
        error = None
        try:
            if pairs:
                staging = bool(peer.info.staging_blocks) or self.staged
                async with peer.lock:
                    if peer.error is not None:  # an earlier migration found the peer silent while this one queued
                        raise KVTransferError(peer.error)
                    if isinstance(self.engine, TorchDistEngine):
                        await self._receive(cmd, peer.info, pairs)
                    elif staging:
                        async with self._stage_lock:  # our read staging buffer is one
                            await self._read_staged(cmd, peer.info, pairs)
                    else:
                        await self._read_rounds(peer.info, pairs)
            if cmd.dst_state_slot >= 0:
                async with peer.lock:
                    await self._read_state(cmd, peer.info)
        except KVTransferError as e:
            error = f"KV migration from {cmd.src_engine} failed: {e}"
            if isinstance(e, _PeerSilent):
                peer.error = str(e)
            if self._peers.get(cmd.src_kv[self.rank]) is peer:
                del self._peers[cmd.src_kv[self.rank]]  # ask and connect again on the next command
        # what this command moved (not the engine's running count, which migrations from other peers share)
        moved = 0 if error is not None else (len(pairs) * len(self.memory.caches) * self.memory.block_bytes
                                             + (sum(self.memory.state_row_bytes) if cmd.dst_state_slot >= 0 else 0))
        self.bytes_moved += moved
        await self._done(cmd, error=error, num_bytes=moved)

    async def _read_staged(self, cmd: MigrateKVCmd, info: KVEndpointEvent, pairs: list[tuple[int, int]]) -> None:
        """Rounds of at most a staging buffer's blocks (the smaller of both sides')."""
        assert self.memory is not None
        sizes = [n for n in (info.staging_blocks, self._read_stage.shape[1] if self.staged else 0) if n]
        per_round = min(sizes)
        for start in range(0, len(pairs), per_round):
            chunk = pairs[start : start + per_round]
            if info.staging_blocks:
                await self._stage_remote(cmd, info, [s for s, _ in chunk])
            # remote blocks: staging slots 0..n-1, or the blocks themselves; local: the same choice
            src = list(range(len(chunk))) if info.staging_blocks else [s for s, _ in chunk]
            dst = list(range(len(chunk))) if self.staged else [d for _, d in chunk]
            await self._read_rounds(info, list(zip(src, dst)))
            if self.staged:
                await asyncio.to_thread(self.memory.stage_in, self._read_stage, [d for _, d in chunk])

    async def _stage_remote(self, cmd: MigrateKVCmd, info: KVEndpointEvent, block_ids: list[int]) -> None:
        src = cmd.src_kv[self.rank]
        request = KVStageRequest(key=src, transfer_id=cmd.transfer_id, reply_to=self.address,
                                 block_ids=np.asarray(block_ids, dtype=np.int32))
        error = await self._ask(src, request, "stage blocks")
        if error is not None:
            raise KVTransferError(f"the prefill rank could not stage blocks: {error}")

    async def _receive(self, cmd: MigrateKVCmd, info: KVEndpointEvent, pairs: list[tuple[int, int]]) -> None:
        """torch_dist: check every pair against both caches, ask the prefill rank to send, receive."""
        assert isinstance(self.engine, TorchDistEngine) and self.memory is not None
        check_pairs(pairs, info.regions[0].length // info.block_bytes, self.memory.caches[0].shape[0])
        src = cmd.src_kv[self.rank]
        rounds = self.config.disagg.kv_staging_blocks
        request = KVSendRequest(key=src, transfer_id=cmd.transfer_id, reply_to=self.address, round_blocks=rounds,
                                block_ids=np.asarray([s for s, _ in pairs], dtype=np.int32))
        try:
            error = await self._ask(src, request, "agree to send blocks")
        except KVTransferError:  # it may still send: a later receive on this pair would take those bytes
            self.engine.disconnect(info.endpoint.engine_id)
            raise
        if error is not None:
            raise KVTransferError(f"the prefill rank will not send blocks: {error}")
        await self.engine.recv_blocks(info.regions[0], [r.name for r in self.regions], pairs,
                                      self.memory.block_bytes, rounds)

    async def _ask(self, src: str, request: KVStageRequest | KVSendRequest, what: str) -> str | None:
        """Send `request` to the prefill rank at `src`; its answer's error (None: done / agreed)."""
        fut = asyncio.get_running_loop().create_future()
        self._replies[(src, request.transfer_id)] = fut
        timeout = self.config.disagg.kv_transfer_timeout_s
        try:
            await self.send_to(src, request)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise _PeerSilent(f"the prefill rank at {src} did not {what} within {timeout:g} s") from None
        finally:
            self._replies.pop((src, request.transfer_id), None)

    async def _read_rounds(self, info: KVEndpointEvent, pairs: list[tuple[int, int]]) -> None:
        """Read (remote index, local index) pairs of every layer: block ids, or staging slots on a staged side."""
        assert self.engine is not None and self.memory is not None
        bb = self.memory.block_bytes
        remote_blocks = info.staging_blocks or info.layer_blocks  # blocks per layer of a one-region side, else 0
        local_blocks = self._read_stage.shape[1] if self.staged else self.layer_blocks
        calls: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (remote #, local #) -> layers' offsets
        for layer in range(len(self.memory.caches)):
            remote = (0, layer * remote_blocks * bb) if remote_blocks else (layer, 0)
            local = (0, layer * local_blocks * bb) if local_blocks else (layer, 0)
            offsets = calls.setdefault((remote[0], local[0]), ([], []))
            offsets[0].append(local[1])
            offsets[1].append(remote[1])
        for (r, lo), (local_offsets, remote_offsets) in calls.items():  # one read when both sides are one region
            ranges = kv_block_table(np.asarray(pairs, dtype=np.int64), local_offsets, remote_offsets, bb)
            await self.engine.read(info.regions[r], ranges, self.regions[lo])

    async def _read_state(self, cmd: MigrateKVCmd, info: KVEndpointEvent) -> None:
        """A hybrid model's recurrent state: the prefill side's snapshot row into ours, in every pool."""
        assert self.engine is not None and self.memory is not None
        if cmd.src_state_slot < 0 or len(info.state_regions) != len(self.state_regions):
            raise KVTransferError(f"the prefill engine {cmd.src_engine} sent no recurrent state for this transfer")
        src, dst = info.state_row_base + cmd.src_state_slot, self.memory.state_row_base + cmd.dst_state_slot
        for remote, local, row in zip(info.state_regions, self.state_regions, self.memory.state_row_bytes):
            await self.engine.read(remote, [(dst * row, src * row, row)], local)

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
