"""DlslimeTCPEngine: the KV data plane over dlslime's TCP transport (CPU memory; tests and RDMA-less hosts).

Facts about dlslime 0.1.23 this backend is built around (its behaviour, and its csrc/engine/tcp):

- `import dlslime` needs libibverbs1 even for TCP; this module is imported only when the backend is chosen.
- A `TcpEndpoint` has one peer: `connect` sets the single host:port its reads go to. So this engine keeps one
  listening endpoint that serves its memory, plus one client endpoint per connected peer for reading.
- The server side of a read copies from whatever address the header names: no bounds or access checks.
  Ranges are validated by the base class against both regions; the listener binds only to `host`
  (never a wildcard), so only peers that can reach that interface can read.
- `read(assign)` takes (local_handle, remote_handle, remote_offset, local_offset, length) tuples, opens one
  pooled TCP connection per tuple, and signals completion through a 32-bit mask — the base class merges
  ranges and never passes more than 32 per call. The call itself connects synchronously, so it runs in a
  thread; the future's `wait_for` spins holding the GIL, so it is polled with `wait_for(0)` and short sleeps.
- Only CPU addresses work over TCP: GPU blocks must be staged through (pinned) host memory by the caller.
- A future cannot be cancelled. On a timeout the peer's client endpoint is shut down (its io thread is
  stopped and joined), so no byte of the abandoned read lands in local memory after the error is raised.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from typing import ClassVar

import torch
from dlslime import TcpEndpoint
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

_STATUS_SUCCESS = 0
"""dlslime's TCP_SUCCESS completion status."""


def _check_bindable(host: str, port: int) -> None:
    """Fail early when `host` is not a local address: dlslime only logs a failed bind and then listens on
    an ephemeral port of every interface, which would expose this process's memory beyond `host`."""
    refuse_wildcard(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            reason = "port in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise KVTransferError(f"cannot bind the KV data plane to {host}:{port}: {reason}") from e


class _Peer:
    """The client side of one connection: a dlslime endpoint aimed at one peer, plus its region handles."""

    def __init__(self, info: EndpointInfo, endpoint: TcpEndpoint) -> None:
        self.info = info
        self.endpoint = endpoint
        self.local_handles: dict[str, int] = {}
        self.remote_handles: dict[str, tuple[RegionInfo, int]] = {}
        self.abandoned = False
        """Set when a read on this peer timed out: a read still being issued shuts the endpoint down."""
        self.lock = threading.Lock()

    def register_local(self, info: RegionInfo) -> None:
        handle = self.endpoint.register_memory_region(info.name, info.addr, 0, info.length)
        if handle < 0:
            raise KVTransferError(f"dlslime refused to register local region {info.name!r}")
        self.local_handles[info.name] = handle

    def remote_handle(self, region: RegionInfo) -> int:
        known = self.remote_handles.get(region.name)
        if known is not None and known[0] == region:
            return known[1]
        # Same name again (the peer re-registered it): dlslime updates that handle's address in place.
        mr = {"name": region.name, "addr": region.addr, "length": region.length}
        handle = self.endpoint.register_remote_memory_region(region.name, mr)
        if handle < 0:
            raise KVTransferError(f"dlslime refused to register remote region {region.name!r}")
        self.remote_handles[region.name] = (region, handle)
        return handle

    def issue_read(self, assign: list[tuple[int, int, int, int, int]]) -> object | None:
        """Start a read (runs in a worker thread: dlslime connects synchronously). None once abandoned."""
        with self.lock:
            future = None if self.abandoned else self.endpoint.read(assign)
        if self.abandoned:  # dropped while connecting: stop the io thread before any byte lands
            self.endpoint.shutdown()
            return None
        return future

    def shutdown(self) -> None:
        """Stop the endpoint's io thread (no more bytes land locally) and close its sockets; never blocks
        on a read being issued: that thread sees `abandoned` after it lets go of the lock and stops it."""
        self.abandoned = True
        if self.lock.acquire(blocking=False):
            try:
                self.endpoint.shutdown()
            finally:
                self.lock.release()


class DlslimeTCPEngine(KVTransferEngine):
    """KV transfer between processes (or hosts) over dlslime's TCP transport, CPU buffers only."""

    backend: ClassVar[str] = "dlslime_tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        _check_bindable(host, port)
        super().__init__(timeout_s)
        self.host = host
        self._server = TcpEndpoint(host, port)
        self.port = int(self._server.endpoint_info()["port"])
        self._peers: dict[str, _Peer] = {}

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(backend=self.backend, engine_id=self.engine_id, host=self.host, port=self.port)

    def connect(self, peer: EndpointInfo) -> None:
        """Open a client endpoint aimed at `peer` (a blocking TCP connect: call it off the event loop)."""
        self._check_open()
        if peer.backend != self.backend:
            raise KVTransferError(f"cannot connect a {self.backend} engine to a {peer.backend} peer")
        old = self._peers.get(peer.engine_id)
        if old is not None and old.info == peer and old.endpoint.is_connected() and not old.abandoned:
            return
        if old is not None:
            self._drop_peer(peer.engine_id)
        client = _Peer(peer, TcpEndpoint(self.host, 0))
        try:
            for info, _ in self._regions.values():
                client.register_local(info)
            client.endpoint.connect({"host": peer.host, "port": peer.port})
            if not client.endpoint.is_connected():
                raise KVTransferError(f"cannot reach KV peer {peer.engine_id} at {peer.host}:{peer.port}")
        except BaseException:
            client.shutdown()
            raise
        self._peers[peer.engine_id] = client

    def _register(self, info: RegionInfo, data: torch.Tensor) -> None:
        if data.device.type != "cpu":
            raise KVTransferError(
                f"region {info.name!r} is on {data.device}: dlslime TCP reads CPU memory only, stage GPU blocks "
                "through pinned host memory"
            )
        for peer in self._peers.values():
            peer.register_local(info)

    async def _read_call(
        self, peer: RegionInfo, local: RegionInfo, local_data: torch.Tensor, ranges: list[Range], deadline: float
    ) -> None:
        client = self._peers.get(peer.engine_id)
        if client is None:
            raise KVTransferError(f"not connected to KV peer {peer.engine_id} (gone, or connect() not called)")
        remote_handle = client.remote_handle(peer)
        local_handle = client.local_handles[local.name]
        assign = [(local_handle, remote_handle, remote_off, local_off, n) for local_off, remote_off, n in ranges]
        loop = asyncio.get_running_loop()
        issue = asyncio.ensure_future(asyncio.to_thread(client.issue_read, assign))
        try:
            future = await asyncio.wait_for(asyncio.shield(issue), timeout=max(deadline - loop.time(), 0.0))
        except TimeoutError:
            issue.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved: no warning
            self._drop_peer(peer.engine_id)
            raise KVTransferError(f"timed out connecting to KV peer {peer.engine_id}") from None
        except RuntimeError as e:  # dlslime: invalid handle / empty assignment
            raise KVTransferError(f"dlslime read from {peer.engine_id} failed: {e}") from e
        if future is None:
            raise KVTransferError(f"KV peer {peer.engine_id} was dropped during the read")
        status = await poll_until(lambda: future.wait_for(0), deadline)
        if status is None:
            self._drop_peer(peer.engine_id)
            raise KVTransferError(
                f"read of {len(ranges)} ranges from KV peer {peer.engine_id} timed out; connection dropped"
            )
        if status != _STATUS_SUCCESS:
            self._drop_peer(peer.engine_id)
            raise KVTransferError(
                f"read from KV peer {peer.engine_id} at {client.info.host}:{client.info.port} failed "
                f"(dlslime status {status}): the peer is gone or the connection was lost"
            )

    def _drop_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            peer.shutdown()

    def _close(self) -> None:
        for engine_id in list(self._peers):
            self._drop_peer(engine_id)
        self._server.shutdown()
