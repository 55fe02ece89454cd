"""TorchDistEngine: the KV data plane over torch.distributed send/recv (NCCL between GPUs, gloo on CPU).

The other backends read the peer's memory one-sidedly. This one is two-sided: a prefill rank `send`s the
blocks a decode rank asked for, and the decode rank `recv`s them, over a process group of two ranks that
belongs to that (prefill rank, decode rank) pair alone:

  1. prefill (rank 0): `listen(requester)` binds a TCPStore to this engine's host on a free port and returns
     an EndpointInfo naming host:port (it rides in KVEndpointEvent over ZeroMQ); `accept(requester)` then
     builds the group (blocking, in a thread) and takes a one-element handshake;
  2. decode (rank 1): `connect(endpoint)` joins the store, builds its side and sends the handshake, which
     also creates the NCCL communicator there and then, not inside the first migration;
  3. per migration the decode side checks every (src, dst) block pair against both caches (`check_pairs`),
     asks the prefill side over ZeroMQ (the KV-migration actor's KVSendRequest), and `recv_blocks`; the
     prefill side checks the ids again and `send_blocks`. Both cut the blocks into the same rounds of at most
     `round_blocks` blocks; a round is one contiguous buffer [layers, blocks, block_bytes] in the caches'
     memory (device memory on a GPU: no host hop), packed with index_select and unpacked with index_copy_.

The groups are built directly (ProcessGroupGloo / ProcessGroupNCCL over their own store), never through
torch.distributed's default group, which tensor or expert parallelism of the same process may own. The
store listens on `host` only (a socket bound here and handed over; TCPStore alone binds every interface).

Waiting never blocks the event loop: gloo's send/recv works complete only inside `wait`, so that runs in a
thread with the time left; NCCL works are polled with `is_completed`. A wait that fails or runs past the
deadline raises KVTransferError and drops the pair (gloo closes it on a timeout; NCCL's communicator is
aborted, so no late byte lands); the decode side asks for a new endpoint on its next migration. NCCL's
watchdog is told not to tear the process down on a failed pair (TORCH_NCCL_ASYNC_ERROR_HANDLING=0 while the
pair's group is built): the deadline here is what fails a migration, and the engine keeps serving.

On a GPU, packs, unpacks and the handshake run on a side stream of the engine's own (NCCL's stream waits for
it when a send or recv is posted), not on the legacy default stream, which would serialize with the
worker's streams; the decode side synchronizes it before a migration is reported done. The prefill side
reads blocks the step that computed them finished writing (its first token reached the host first).
The NCCL tests are marked gpu.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from flotilla.transport.kv_transfer import (
    DEFAULT_TIMEOUT_S,
    EndpointInfo,
    KVTransferEngine,
    KVTransferError,
    Range,
    RegionInfo,
    poll_until,
    refuse_wildcard,
)

HANDSHAKE = 0x6B76  # "kv": the decode side's first message on a new pair
SEND_TAG = 0
ROUNDS_IN_FLIGHT = 1
"""Rounds posted ahead of the one being waited for, NCCL only (double buffering: one round on the wire while the
next is packed, or unpacked): each costs a round's buffer of device memory on both sides."""
GPU_POLL_MAX_S = 0.0002
"""Longest sleep between completion checks of NCCL work and unpacks: a round moves in about a millisecond over
NVLink, so the default backoff (up to 5 ms) would leave the link idle most of the time."""
"""Tag of every KV send/recv (one pair carries one migration at a time, in order)."""
_nccl_env_lock = threading.Lock()


def group_backend(device: torch.device) -> str:
    """The process-group backend for KV in memory of this kind: nccl for CUDA, gloo for CPU."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise KVTransferError(f"torch_dist moves KV in CPU (gloo) or CUDA (NCCL) memory, not {device.type}")


def check_pairs(pairs: Sequence[tuple[int, int]], src_blocks: int, dst_blocks: int) -> None:
    """Raise KVTransferError naming the first (src, dst) pair whose block is outside either cache."""
    for i, (src, dst) in enumerate(pairs):
        if not 0 <= src < src_blocks:
            raise KVTransferError(f"pair #{i}: block {src} is outside the prefill cache's {src_blocks} blocks")
        if not 0 <= dst < dst_blocks:
            raise KVTransferError(f"pair #{i}: block {dst} is outside the decode cache's {dst_blocks} blocks")


def rounds(num_blocks: int, round_blocks: int) -> list[tuple[int, int]]:
    """(start, stop) of each round; both ends of a pair cut a migration the same way."""
    if round_blocks < 1:
        raise KVTransferError(f"round_blocks must be at least 1, got {round_blocks}")
    return [(start, min(start + round_blocks, num_blocks)) for start in range(0, num_blocks, round_blocks)]


@dataclass
class _Pair:
    """One end of a 2-rank group: rank 0 on the prefill side (sends), rank 1 on the decode side (receives)."""

    key: str
    """The requester's name (prefill side) or the peer's engine id (decode side)."""
    rank: int
    backend: str
    store: dist.TCPStore | None = None
    group: dist.ProcessGroup | None = None
    ready: asyncio.Future | None = None
    """Prefill side: done when the group is built and the handshake arrived (or failed)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    broken: bool = False

    def close(self) -> None:
        """Abort the group (nothing lands any more) and let go of it and its store (the store's listening
        socket closes with the store)."""
        self.broken = True
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except RuntimeError:  # already aborted or never connected
                pass
        self.store = None


class TorchDistEngine(KVTransferEngine):
    """KV transfer between processes over torch.distributed send/recv, one 2-rank group per rank pair.

    Regions are registered as for the other backends (one per layer, all on one device): they are what
    `send_blocks` and `recv_blocks` pack from and unpack into, and what a peer's RegionInfo lengths are
    checked against. There are no one-sided reads: `read` raises; use the send/recv pair.
    """

    backend: ClassVar[str] = "torch_dist"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        refuse_wildcard(host)
        super().__init__(timeout_s)
        self.host = host
        self.device: torch.device | None = None
        self._cuda_stream: torch.cuda.Stream | None = None
        self._serving: dict[str, _Pair] = {}  # requester -> our rank-0 end
        self._peers: dict[str, _Pair] = {}  # prefill engine id -> our rank-1 end

    # ---- setup ---------------------------------------------------------------------------------------

    def _register(self, info: RegionInfo, data: torch.Tensor) -> None:
        if self.device is not None and data.device != self.device:
            raise KVTransferError(f"region {info.name!r} is on {data.device}, earlier ones on {self.device}: "
                                  "one engine's regions share one device")
        group_backend(data.device)
        self.device = data.device
        if data.device.type == "cuda" and self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(data.device)

    @property
    def group_backend(self) -> str:
        if self.device is None:
            raise KVTransferError("register the KV memory before connecting")
        return group_backend(self.device)

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(backend=self.backend, engine_id=self.engine_id, host=self.host,
                            device=str(self.device) if self.device is not None else "")

    def listen(self, requester: str) -> EndpointInfo:
        """Prefill side: a fresh pair for `requester` (replacing an old one), its store on host:free port."""
        self._check_open()
        backend = self.group_backend
        self._drop(self._serving, requester)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        fd = -1
        try:
            with socket.socket(family, socket.SOCK_STREAM) as listener:
                listener.bind((self.host, 0))
                listener.listen(16)
                port = listener.getsockname()[1]
                fd = listener.detach()  # the store owns the socket from here (and closes it when it goes)
            store = dist.TCPStore(self.host, port, 2, True, self._timedelta(), wait_for_workers=False,
                                  master_listen_fd=fd)
        except (OSError, RuntimeError) as e:
            if fd >= 0:
                os.close(fd)
            raise KVTransferError(f"cannot listen for a KV pair on {self.host}: {e}") from e
        pair = _Pair(key=requester, rank=0, backend=backend, store=store)
        self._serving[requester] = pair
        return EndpointInfo(backend=self.backend, engine_id=self.engine_id, host=self.host, port=port,
                            device=str(self.device))

    def serves(self, requester: str) -> bool:
        """Prefill side: whether a pair for `requester` was announced and is not broken."""
        pair = self._serving.get(requester)
        return pair is not None and not pair.broken

    async def accept(self, requester: str) -> None:
        """Prefill side: build the pair `listen` announced once the requester joins; KVTransferError if it
        does not within the timeout. Sends to the requester wait for this."""
        pair = self._serving.get(requester)
        if pair is None or pair.ready is not None:
            raise KVTransferError(f"no pair announced for {requester}")
        pair.ready = asyncio.get_running_loop().create_future()
        try:
            pair.group = await asyncio.to_thread(self._build, pair)
        except (KVTransferError, asyncio.CancelledError) as e:
            if isinstance(e, KVTransferError):
                pair.ready.set_exception(e)
                pair.ready.exception()  # retrieved here; senders see it through `ready` too
            else:
                pair.ready.cancel()
            self._drop(self._serving, requester, pair)
            raise
        pair.ready.set_result(None)

    def connect(self, peer: EndpointInfo) -> None:
        """Decode side: join the pair `peer` (a `listen` answer) announced. Blocks until the prefill side
        builds its end (call it off the event loop); KVTransferError when it cannot."""
        self._check_open()
        if peer.backend != self.backend:
            raise KVTransferError(f"cannot connect a {self.backend} engine to a {peer.backend} peer")
        if not peer.port:
            raise KVTransferError(f"KV peer {peer.engine_id} announced no pair port")
        if self.device is not None and peer.device:
            if peer.device.partition(":")[0] != self.device.type:
                raise KVTransferError(f"the prefill engine's KV is in {peer.device} memory, this one's in "
                                      f"{self.device.type}: torch_dist pairs gloo with gloo (CPU) and NCCL with NCCL "
                                      "(CUDA)")
            if self.device.type == "cuda" and peer.device == str(self.device) and peer.host == self.host:
                raise KVTransferError(f"the prefill engine's KV is on {peer.device} of this host too: NCCL pairs need "
                                      "two GPUs (give each engine its own --device)")
        pair = _Pair(key=peer.engine_id, rank=1, backend=self.group_backend)
        try:
            pair.store = dist.TCPStore(peer.host, peer.port, 2, False, self._timedelta())
        except (RuntimeError, OSError) as e:  # torch raises DistNetworkError / DistStoreError (RuntimeErrors)
            raise KVTransferError(f"cannot reach KV peer {peer.engine_id} at {peer.host}:{peer.port}: {e}") from e
        pair.group = self._build(pair)
        self._drop(self._peers, peer.engine_id)
        self._peers[peer.engine_id] = pair

    def disconnect(self, peer_engine_id: str) -> None:
        """Decode side: drop the pair with a peer (when it may be out of step: asked to send, no answer)."""
        self._drop(self._peers, peer_engine_id)

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _build(self, pair: _Pair) -> dist.ProcessGroup:
        """Construct this end's group over the pair's store and exchange the handshake (blocking)."""
        assert self.device is not None and pair.store is not None
        try:
            if pair.backend == "gloo":
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                options._timeout = self._timedelta()
                group = dist.ProcessGroupGloo(pair.store, pair.rank, 2, options)
            else:
                options = dist.ProcessGroupNCCL.Options()
                # the deadline here fails a migration; NCCL's watchdog must not act (and kill the process) first
                options._timeout = datetime.timedelta(seconds=self.timeout_s * 4 + 60)
                with _nccl_env_lock:
                    saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
                    try:
                        group = dist.ProcessGroupNCCL(pair.store, pair.rank, 2, options)
                    finally:
                        if saved is None:
                            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
                        else:
                            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
            with self._stream():
                hello = torch.full((1,), HANDSHAKE if pair.rank else 0, dtype=torch.int64, device=self.device)
                work = group.send([hello], 0, SEND_TAG) if pair.rank else group.recv([hello], 1, SEND_TAG)
                work.wait(self._timedelta())
                self._synchronize()
        except RuntimeError as e:
            raise KVTransferError(f"cannot build the KV pair's {pair.backend} group: {e}") from e
        if not pair.rank and int(hello.item()) != HANDSHAKE:
            group.abort()
            raise KVTransferError(f"KV pair with {pair.key}: unexpected handshake {int(hello.item())}")
        return group

    # ---- moving blocks -------------------------------------------------------------------------------

    def _layers(self, names: Sequence[str], block_bytes: int) -> list[torch.Tensor]:
        """The named regions as [blocks, block_bytes] uint8 views."""
        if block_bytes < 1:
            raise KVTransferError(f"block_bytes must be positive, got {block_bytes}")
        layers = []
        for name in names:
            if name not in self._regions:
                raise KVTransferError(f"no local region named {name!r}")
            data = self._regions[name][1]
            if data.numel() % block_bytes:
                raise KVTransferError(f"region {name!r} of {data.numel()} bytes is not whole {block_bytes}-byte blocks")
            layers.append(data.view(-1, block_bytes))
        if not layers:
            raise KVTransferError("no regions to move blocks of")
        return layers

    async def send_blocks(self, requester: str, regions: Sequence[str], block_ids: Sequence[int],
                          block_bytes: int, round_blocks: int) -> int:
        """Prefill side: send blocks `block_ids` of every region (layer order) to `requester`; bytes sent."""
        self._check_open()
        layers = self._layers(regions, block_bytes)
        for i, block in enumerate(block_ids):
            if not 0 <= block < layers[0].shape[0]:
                raise KVTransferError(f"block #{i} ({block}) is outside this cache's {layers[0].shape[0]} blocks")
        pair = self._serving.get(requester)
        if pair is None or pair.ready is None:
            raise KVTransferError(f"no KV pair with {requester} (it must ask for the endpoint first)")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with pair.lock:
            try:
                await asyncio.wait_for(asyncio.shield(pair.ready), timeout=max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise KVTransferError(f"the KV pair with {requester} was not built in time") from None
            sent = 0
            in_flight: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()
            ahead = ROUNDS_IN_FLIGHT if pair.backend == "nccl" else 0
            what = f"sending blocks to {requester}"
            all_ids = self._upload_ids(block_ids)
            for start, stop in rounds(len(block_ids), round_blocks):

                def pack_and_send(idx: torch.Tensor = all_ids[start:stop]) -> tuple[dist.Work, torch.Tensor]:
                    with self._stream():  # NCCL's stream waits for this one: the pack lands before the send
                        buf = torch.empty((len(layers), len(idx), block_bytes), dtype=torch.uint8, device=self.device)
                        for layer, out in zip(layers, buf):
                            torch.index_select(layer, 0, idx, out=out)
                        return self._group(pair).send([buf], 1, SEND_TAG), buf

                in_flight.append(await self._issue(pair, pack_and_send))
                sent += in_flight[-1][1].numel()
                while len(in_flight) > ahead:  # the next round packs while this one is on the wire
                    await self._wait(pair, in_flight.popleft()[0], deadline, what)
            while in_flight:
                await self._wait(pair, in_flight.popleft()[0], deadline, what)
            return sent

    async def recv_blocks(self, peer: RegionInfo, regions: Sequence[str], pairs: Sequence[tuple[int, int]],
                          block_bytes: int, round_blocks: int) -> int:
        """Decode side: receive (src, dst) pairs' blocks from the engine owning `peer` (one of its layer
        regions, whose length bounds src) into the named regions; bytes received. Call it once the prefill
        side was asked to send the same src ids in the same rounds."""
        self._check_open()
        layers = self._layers(regions, block_bytes)
        check_pairs(pairs, peer.length // block_bytes, layers[0].shape[0])
        pair = self._peers.get(peer.engine_id)
        if pair is None or pair.broken:
            raise KVTransferError(f"not connected to KV peer {peer.engine_id} (gone, or connect() not called)")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        received = 0
        nccl = pair.backend == "nccl"
        what = f"receiving blocks from {peer.engine_id}"
        # NCCL: round r + 1 is posted and round r's unpack queued behind its receive on our stream before anything
        # waits; a round's buffer is let go once its unpack is done. gloo: one round at a time, waited in a thread.
        in_flight: collections.deque[tuple[dist.Work, torch.cuda.Event | None, torch.Tensor]] = collections.deque()
        async with pair.lock:
            all_dst = self._upload_ids([d for _, d in pairs])
            for start, stop in rounds(len(pairs), round_blocks):

                def post(n: int = stop - start) -> tuple[dist.Work, torch.Tensor]:
                    with self._stream():
                        buf = torch.empty((len(layers), n, block_bytes), dtype=torch.uint8, device=self.device)
                        return self._group(pair).recv([buf], 0, SEND_TAG), buf

                work, buf = await self._issue(pair, post)
                if not nccl:
                    await self._wait(pair, work, deadline, what)

                def unpack(buf: torch.Tensor = buf, work: dist.Work = work,
                           idx: torch.Tensor = all_dst[start:stop]) -> torch.cuda.Event | None:
                    with self._stream():
                        if nccl:
                            work.wait()  # our stream waits for NCCL's before reading the buffer (the host does not)
                        for layer, data in zip(layers, buf):
                            layer.index_copy_(0, idx, data)
                        if self._cuda_stream is None:
                            return None
                        done = torch.cuda.Event()
                        done.record(self._cuda_stream)
                        return done

                in_flight.append((work, await asyncio.to_thread(unpack), buf))
                received += buf.numel()
                while len(in_flight) > (ROUNDS_IN_FLIGHT if nccl else 0):
                    await self._landed(pair, *in_flight.popleft()[:2], deadline, what)
            while in_flight:  # every block landed before MigrationDone
                await self._landed(pair, *in_flight.popleft()[:2], deadline, what)
        self.bytes_read += received
        return received

    async def _landed(self, pair: _Pair, work: dist.Work, unpacked: torch.cuda.Event | None, deadline: float,
                      what: str) -> None:
        """Wait until a round's receive completed and its unpack ran (the pair is dropped on a timeout)."""
        if pair.backend == "nccl":
            await self._wait(pair, work, deadline, what)
        if unpacked is not None and await poll_until(lambda: True if unpacked.query() else None, deadline,
                                                     GPU_POLL_MAX_S) is None:  # fmt: skip
            self._fail(pair)
            raise KVTransferError(f"{what}: unpacking timed out; the pair was dropped")

    def _upload_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 tensor on this engine's device, queued on its side stream in one copy from pinned
        memory: a copy from pageable memory would make the host wait for everything queued on the stream before it
        (the previous round's unpack, so its receive), and rounds could then never overlap."""
        host = torch.tensor(list(ids), dtype=torch.long)
        if self._cuda_stream is None:
            return host
        with self._stream():
            return host.pin_memory().to(self.device, non_blocking=True)

    def _stream(self) -> contextlib.AbstractContextManager:
        """On a GPU, a side stream of this engine's own for packs, unpacks and handshakes: off the legacy default
        stream, which would serialize with the worker's streams. Nothing on CPU."""
        if self._cuda_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._cuda_stream)

    def _synchronize(self) -> None:
        """Wait for this engine's side stream (GPU only)."""
        if self._cuda_stream is not None:
            self._cuda_stream.synchronize()

    def _group(self, pair: _Pair) -> dist.ProcessGroup:
        if pair.group is None or pair.broken:
            raise KVTransferError(f"the KV pair with {pair.key} was dropped")
        return pair.group

    async def _issue(self, pair: _Pair, start):
        """Run `start` (pack + post a send, or post a recv) in a thread: a CPU pack is a real copy."""
        try:
            return await asyncio.to_thread(start)
        except RuntimeError as e:
            self._fail(pair)
            raise KVTransferError(f"KV pair with {pair.key} failed, the peer is gone? ({e}); "
                                  "the pair was dropped") from e

    async def _wait(self, pair: _Pair, work: dist.Work, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        if pair.backend == "gloo":  # gloo's works complete only inside wait(): a thread, bounded by the deadline
            remaining = max(deadline - loop.time(), 0.001)
            try:
                await asyncio.to_thread(work.wait, datetime.timedelta(seconds=remaining))
            except RuntimeError as e:
                self._fail(pair)
                reason = "timed out" if "Timed out" in str(e) else f"failed, the peer is gone? ({e})"
                raise KVTransferError(f"{what} {reason}; the pair was dropped") from e
            return
        if await poll_until(lambda: True if work.is_completed() else None, deadline, GPU_POLL_MAX_S) is None:
            self._fail(pair)
            raise KVTransferError(f"{what} timed out; the pair was dropped (NCCL communicator aborted)")
        try:  # completed: wait() returns at once, or raises what NCCL reported (Work.exception() has no binding)
            work.wait()
        except RuntimeError as e:
            self._fail(pair)
            raise KVTransferError(f"{what} failed, the peer is gone? ({e}); the pair was dropped") from e

    def _fail(self, pair: _Pair) -> None:
        table = self._serving if pair.rank == 0 else self._peers
        self._drop(table, pair.key, pair)

    @staticmethod
    def _drop(table: dict[str, _Pair], key: str, only: _Pair | None = None) -> None:
        pair = table.get(key)
        if pair is None or (only is not None and pair is not only):
            if only is not None:
                only.close()
            return
        del table[key]
        pair.close()

    async def _read_call(
        self, peer: RegionInfo, local: RegionInfo, local_data: torch.Tensor, ranges: list[Range], deadline: float
    ) -> None:
        raise KVTransferError("torch_dist has no one-sided reads: the prefill side send_blocks, this side "
                              "recv_blocks (actors/kv_migration.py runs the protocol)")

    def _close(self) -> None:
        for table in (self._serving, self._peers):
            for key in list(table):
                self._drop(table, key)
