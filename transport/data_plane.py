"""What a peer needs to reach an engine's registered memory on the KV data plane (transport/kv_transfer.py): the
engine's endpoint and each region's description. Plain msgspec structs, so they ride inside control-plane messages
(transport/messages.py: KVEndpointEvent, ImageEmbeddingsEvent) while the bytes they describe never do."""

from __future__ import annotations

import msgspec


class EndpointInfo(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """How a peer reaches a KV transfer engine (transport/kv_transfer.py); given to the peer's `connect`."""

    backend: str
    """Backend name (`local`, `dlslime_tcp`, `torch_dist`); a peer of another backend cannot connect."""
    engine_id: str
    """Unique id of the transfer engine; RegionInfo.engine_id names its owner with it."""
    host: str = ""
    """Address the engine serves reads on (network backends only)."""
    port: int = 0
    """TCP port the engine serves reads on (network backends only); torch_dist: the pair's TCPStore."""
    device: str = ""
    """Device the engine's KV is on ("cpu", "cuda:1"; torch_dist only: gloo pairs with gloo, NCCL with NCCL,
    and NCCL needs two GPUs)."""
    host_id: str = ""
    """The kernel boot id of the engine's host (cuda_ipc only: IPC reaches processes of one host)."""


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where a GPU region lives, for a process of the same host to map it (transport/kv_transfer_cuda_ipc.py)."""

    device_uuid: str
    """The GPU's UUID (device indices differ between processes)."""
    handle: bytes
    """cudaIpcMemHandle of the allocation segment that holds the region."""
    storage_bytes: int
    """Size of the tensor storage the region belongs to."""
    storage_offset: int
    """Offset of that storage inside the allocation segment, bytes."""
    offset: int
    """Offset of the region inside its storage, bytes."""
    ref_counter: bytes
    """torch's shared reference-counter file of the handle (the exporter keeps the segment while it counts)."""
    ref_counter_offset: int


class RegionInfo(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """One registered memory region, as its owner describes it to a peer that will read from it."""

    name: str
    """Region name, unique within its engine (e.g. `kv.layer3` or `kv`)."""
    engine_id: str
    """The owning engine (EndpointInfo.engine_id)."""
    backend: str
    """Backend that registered it."""
    length: int
    """Size of the region, bytes; every range must stay inside it."""
    addr: int = 0
    """Start address in the owner's process (network backends address remote memory with it)."""
    ipc: CudaIpcHandle | None = None
    """cuda_ipc only: how a process of the same host maps the region."""
