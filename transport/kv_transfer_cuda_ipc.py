"""CudaIpcEngine: the KV data plane between processes of one host through CUDA IPC, GPU memory to GPU memory.

The prefill side registers its KV layers (device tensors) and describes each with the CUDA IPC handle of the
allocation that holds it (`CudaIpcHandle` in its RegionInfo: the handle, where the region sits inside the
allocation, the GPU's UUID). The decode side opens each handle once, on the device with that UUID, and a read is
one gather and one scatter of the merged ranges (copy_ranges: one launch each, however many blocks) on one stream of
its own, completion polled through an event, so the event loop never blocks and the worker's streams are not
serialized with it. The same code serves two processes
on one GPU and two GPUs of one host (CUDA maps the peer device's memory with peer access on).

What it rests on:
- torch's CUDA IPC (`UntypedStorage._share_cuda_` / `_new_shared_cuda`, what torch.multiprocessing sends tensors
  with): the handle names a whole caching-allocator segment, the storage's offset inside it comes along, and torch
  keeps one mapping per handle per process, so opening a handle twice is cheap.
- IPC reaches processes of one host only: each EndpointInfo carries the kernel's boot id, and `connect` refuses a
  peer on another host (dlslime is the path between hosts).
- A handle cannot be opened by the process that made it: engines of one process copy from each other's tensors
  directly (a process-wide table of live engines, as LocalCopyEngine does).
- A copy queued on the GPU cannot be recalled: when a read runs past its deadline the error is raised once the
  copy has finished, so no byte lands after it.
- The exporting process must keep its KV cache alive while peers read it (an engine's cache lives as long as the
  engine); a peer that died leaves its mapping undefined, and the control plane fails its migrations first.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from pathlib import Path
from typing import ClassVar

import torch

from flotilla.transport.kv_transfer import (
    DEFAULT_TIMEOUT_S,
    EndpointInfo,
    KVTransferEngine,
    KVTransferError,
    Range,
    RegionInfo,
    copy_ranges,
    poll_until,
)
from flotilla.transport.data_plane import CudaIpcHandle

GPU_POLL_MAX_S = 0.0002
"""Longest sleep between checks of a copy's event (a block's copy takes microseconds on the device)."""

_engines: weakref.WeakValueDictionary[str, CudaIpcEngine] = weakref.WeakValueDictionary()


@functools.cache
def host_id() -> str:
    """The kernel's boot id: equal for processes of one host (containers included), so CUDA IPC can reach them."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def device_uuid(index: int) -> str:
    """The UUID of visible CUDA device `index` (device indices differ between processes; UUIDs do not)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_of(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise KVTransferError(f"the peer's KV is on GPU {uuid}, which this process cannot see (CUDA_VISIBLE_DEVICES)")


class CudaIpcEngine(KVTransferEngine):
    """KV transfer between processes of one host through CUDA IPC: GPU regions, device-to-device reads."""

    backend: ClassVar[str] = "cuda_ipc"
    max_ranges_per_call: ClassVar[int] = 1 << 20  # (a call is one gather and one scatter: copy_ranges)
    array_ranges: ClassVar[bool] = True

    def __init__(self, host: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """`host` is only named in errors and logs: nothing listens, the handles travel in the RegionInfos."""
        if not torch.cuda.is_available():
            raise KVTransferError("the cuda_ipc backend needs a CUDA device (use dlslime_tcp or local on CPU)")
        super().__init__(timeout_s)
        self.host = host
        self._peers: dict[str, EndpointInfo] = {}
        self._opened: dict[tuple[str, str], tuple[RegionInfo, torch.Tensor]] = {}  # (engine, region) -> bytes
        self._streams: dict[int, torch.cuda.Stream] = {}
        _engines[self.engine_id] = self

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(backend=self.backend, engine_id=self.engine_id, host=self.host, host_id=host_id())

    def connect(self, peer: EndpointInfo) -> None:
        self._check_open()
        if peer.backend != self.backend:
            raise KVTransferError(f"cannot connect a {self.backend} engine to a {peer.backend} peer")
        if peer.host_id != host_id():
            raise KVTransferError(f"KV peer {peer.engine_id} ({peer.host or 'no host named'}) is on another host: CUDA "
                                  "IPC reaches processes of one host only (use dlslime between hosts)")
        if self._peers.get(peer.engine_id) != peer:  # a new engine under an old id: map its regions again
            self._forget(peer.engine_id)
        self._peers[peer.engine_id] = peer

    def _register(self, info: RegionInfo, data: torch.Tensor) -> RegionInfo:
        if data.device.type != "cuda":
            raise KVTransferError(f"region {info.name!r} is on {data.device}: the cuda_ipc backend moves GPU memory "
                                  "only (use dlslime_tcp for host memory)")
        storage = data.untyped_storage()
        _device, handle, size, storage_offset, counter, counter_offset, _event, _sync = storage._share_cuda_()
        offset = data.data_ptr() - storage.data_ptr()
        ipc = CudaIpcHandle(device_uuid=device_uuid(data.device.index), handle=handle, storage_bytes=size,
                            storage_offset=storage_offset, offset=offset, ref_counter=counter,
                            ref_counter_offset=counter_offset)
        return RegionInfo(name=info.name, engine_id=info.engine_id, backend=info.backend, length=info.length,
                          addr=info.addr, ipc=ipc)

    def _remote_bytes(self, peer: RegionInfo) -> torch.Tensor:
        """The peer region's bytes as a uint8 tensor of this process: its own tensor when the peer engine lives
        here, else the IPC mapping (opened once per region)."""
        if peer.engine_id not in self._peers:
            raise KVTransferError(f"not connected to KV peer {peer.engine_id} (gone, or connect() not called)")
        local = _engines.get(peer.engine_id)
        if local is not None:
            if local._closed:
                raise KVTransferError(f"KV peer {peer.engine_id} is closed")
            entry = local._regions.get(peer.name)
            if entry is None or entry[0] != peer:
                raise KVTransferError(f"KV peer {peer.engine_id} has no region {peer.name!r} as described")
            return entry[1]
        known = self._opened.get((peer.engine_id, peer.name))
        if known is not None and known[0] == peer:
            return known[1]
        ipc = peer.ipc
        if ipc is None:
            raise KVTransferError(f"region {peer.name!r} of {peer.engine_id} carries no CUDA IPC handle")
        if ipc.offset < 0 or ipc.offset + peer.length > ipc.storage_bytes:
            raise KVTransferError(f"region {peer.name!r} of {peer.engine_id} ({peer.length} bytes at {ipc.offset}) "
                                  f"leaves its shared storage of {ipc.storage_bytes} bytes")
        index = _device_of(ipc.device_uuid)
        try:
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, ipc.handle, ipc.storage_bytes, ipc.storage_offset, ipc.ref_counter,
                    ipc.ref_counter_offset, b"", False)
        except RuntimeError as e:
            raise KVTransferError(f"cannot open the CUDA IPC handle of region {peer.name!r} of {peer.engine_id}: {e}"
                                  ) from e
        data = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        data.set_(storage, ipc.offset, (peer.length,), (1,))
        self._opened[(peer.engine_id, peer.name)] = (peer, data)
        return data

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    async def _read_call(
        self, peer: RegionInfo, local: RegionInfo, local_data: torch.Tensor, ranges: list[Range], deadline: float
    ) -> None:
        source = self._remote_bytes(peer)
        stream = self._stream(local_data.device)
        with torch.cuda.stream(stream):
            copy_ranges(local_data, source, ranges)
            done = torch.cuda.Event()
            done.record(stream)
        if await poll_until(lambda: True if done.query() else None, deadline, GPU_POLL_MAX_S) is None:
            await asyncio.to_thread(done.synchronize)  # a queued copy cannot be recalled: let it land first
            raise KVTransferError(f"copy of {len(ranges)} ranges from KV peer {peer.engine_id} timed out")

    def _forget(self, engine_id: str) -> None:
        for key in [k for k in self._opened if k[0] == engine_id]:
            del self._opened[key]

    def _close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        self._opened.clear()
        self._peers.clear()
        _engines.pop(self.engine_id, None)
