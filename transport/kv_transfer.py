"""KV data plane: move KV-cache bytes between engines, apart from the ZeroMQ control plane.

A decode engine pulls the KV blocks a prefill engine computed. Both sides register the memory that holds
their blocks; the prefill side sends its `EndpointInfo` and `RegionInfo`s over the control plane (they are
msgspec Structs, so they ride inside any message); the decode side `connect`s and issues batched
`(local_offset, remote_offset, length)` reads that complete asynchronously. KV bytes never touch ZeroMQ.

Backends (chosen by name with `create_kv_transfer_engine`):

  local        LocalCopyEngine: both engines in one process (colocated roles, tests): a tensor copy.
  dlslime_tcp  DlslimeTCPEngine: CPU buffers over dlslime's TCP transport (transport/kv_transfer_dlslime.py).
  cuda_ipc     CudaIpcEngine: GPU caches of processes on one host (one GPU or several), device-to-device copies
               through CUDA IPC mappings (transport/kv_transfer_cuda_ipc.py).
  torch_dist   TorchDistEngine: two-sided send/recv over a 2-rank torch.distributed group per rank pair, NCCL
               between GPU caches, gloo on CPU (transport/kv_transfer_torch.py). It has no one-sided `read`:
               the prefill side `send_blocks`, the decode side `recv_blocks` (actors/kv_migration.py asks).

Every read goes through `plan_reads` first: each range is checked against both registered regions (the
backends do no bounds checks, and dlslime would happily read any address of the peer process), adjacent
ranges are merged (dlslime opens one TCP connection per range), and the result is cut into calls of at
most `MAX_RANGES_PER_CALL` (dlslime signals completion through a 32-bit mask: more ranges in one call can
report completion before all data landed).

`kv_block_ranges` turns (src_block, dst_block) pairs into byte ranges for the paged KV layout of
kernels/attention/metadata.py: one tensor per layer, [num_blocks, 2, block_size, num_kv_heads, head_dim],
so block b of layer l starts at the layer's offset + b * block_bytes.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Self, TypeVar

import numpy as np
import torch

from flotilla.transport.data_plane import EndpointInfo, RegionInfo

Range = tuple[int, int, int]
"""(local_offset, remote_offset, length), bytes, offsets relative to the start of each registered region."""

MAX_RANGES_PER_CALL = 32
"""Most ranges handed to a backend in one call (dlslime's completion mask has 32 bits)."""
DEFAULT_TIMEOUT_S = 30.0
"""A read that has not completed after this long fails with KVTransferError, seconds."""

Buffer = torch.Tensor | np.ndarray | bytearray | memoryview
"""Memory a backend can register: a contiguous tensor or array, or a writable byte buffer."""


class KVTransferError(RuntimeError):
    """The one error of the data plane: bad ranges, unknown regions, timeouts, a peer that is gone."""


POLL_MIN_S = 0.0001
"""First sleep between completion polls, seconds (a small transfer completes in well under a millisecond)."""
POLL_MAX_S = 0.005
"""Longest sleep between completion polls, seconds (bounds the latency added to a long transfer)."""
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_T = TypeVar("_T")


def refuse_wildcard(host: str) -> None:
    """KV memory is served on one named interface, never on every interface of the host."""
    if host in _WILDCARD_HOSTS:
        raise KVTransferError(f"refusing to serve KV memory on wildcard address {host!r}: name one interface")


async def poll_until(check: Callable[[], _T | None], deadline: float, max_sleep: float | None = None) -> _T | None:
    """check()'s first result that is not None, polled from asyncio with sleeps doubling from POLL_MIN_S to
    max_sleep (default POLL_MAX_S; the backends' completion calls must not block the event loop); None once the
    loop's clock passes `deadline`."""
    loop = asyncio.get_running_loop()
    sleep, cap = POLL_MIN_S, POLL_MAX_S if max_sleep is None else max_sleep
    while (result := check()) is None:
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(sleep)
        sleep = min(sleep * 2, cap)
    return result


def as_byte_tensor(buffer: Buffer) -> torch.Tensor:
    """A flat uint8 tensor sharing `buffer`'s memory (so ranges are byte offsets, whatever the dtype)."""
    if isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise KVTransferError("cannot register a non-contiguous tensor: its bytes are not one range")
        return buffer.detach().reshape(-1).view(torch.uint8)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise KVTransferError("cannot register a non-contiguous array: its bytes are not one range")
        return torch.from_numpy(buffer.reshape(-1).view(np.uint8))
    view = memoryview(buffer)
    if view.readonly:
        raise KVTransferError("cannot register a read-only buffer: reads land in local regions")
    return torch.from_numpy(np.frombuffer(view, dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# range math (pure)


def _table(ranges: Sequence[Range]) -> np.ndarray:
    """The ranges as an int64 array [n, 3] (local offset, remote offset, length)."""
    return np.asarray(ranges, dtype=np.int64).reshape(-1, 3)


def validate_ranges(ranges: Sequence[Range], local: RegionInfo, remote: RegionInfo) -> None:
    """Raise KVTransferError naming the first range that is malformed or leaves either region."""
    t = _table(ranges)
    bad = ((t[:, 2] <= 0) | (t[:, 0] < 0) | (t[:, 1] < 0) | (t[:, 0] + t[:, 2] > local.length)
           | (t[:, 1] + t[:, 2] > remote.length))
    if not bad.any():  # (checked at once: a migration's read is a range per block per layer)
        return
    first = int(np.argmax(bad))
    for i, (local_offset, remote_offset, length) in enumerate(ranges[first:first + 1], start=first):
        where = f"range #{i} (local_offset={local_offset}, remote_offset={remote_offset}, length={length})"
        if length <= 0:
            raise KVTransferError(f"{where}: length must be positive")
        if local_offset < 0 or remote_offset < 0:
            raise KVTransferError(f"{where}: offsets must not be negative")
        if local_offset + length > local.length:
            raise KVTransferError(f"{where} leaves local region {local.name!r} of {local.length} bytes")
        if remote_offset + length > remote.length:
            raise KVTransferError(f"{where} leaves remote region {remote.name!r} of {remote.length} bytes")


def merge_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Sort by local offset and join ranges that continue each other on both sides (fewer connections)."""
    merged: list[Range] = []
    for local_offset, remote_offset, length in sorted(ranges):
        if merged:
            last_local, last_remote, last_length = merged[-1]
            if last_local + last_length == local_offset and last_remote + last_length == remote_offset:
                merged[-1] = (last_local, last_remote, last_length + length)
                continue
        merged.append((local_offset, remote_offset, length))
    return merged


def split_ranges(ranges: Sequence[Range], max_per_call: int = MAX_RANGES_PER_CALL) -> list[list[Range]]:
    """Cut `ranges` into consecutive calls of at most `max_per_call` ranges each."""
    if max_per_call <= 0:
        raise ValueError(f"max_per_call must be positive, got {max_per_call}")
    return [list(ranges[i : i + max_per_call]) for i in range(0, len(ranges), max_per_call)]


def merge_table(table: np.ndarray) -> np.ndarray:
    """merge_ranges over an int64 array [n, 3], at once: sorted, runs that continue on both sides joined."""
    if not len(table):
        return table.reshape(0, 3)
    t = table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]
    ends = t[:-1, :2] + t[:-1, 2:]
    starts = np.flatnonzero(np.concatenate(([True], (ends != t[1:, :2]).any(axis=1))))  # (where a run begins)
    merged = t[starts]
    merged[:, 2] = np.add.reduceat(t[:, 2], starts)
    return merged


def plan_reads(
    ranges: Sequence[Range] | np.ndarray, local: RegionInfo, remote: RegionInfo,
    max_per_call: int = MAX_RANGES_PER_CALL,
) -> list[list[Range]] | list[np.ndarray]:
    """Validate, merge and split: the backend calls that perform `ranges`, each safe to hand to a backend. Ranges
    given as an int64 array [n, 3] (kv_block_table's) are planned at once and come back as arrays."""
    validate_ranges(ranges, local, remote)
    if isinstance(ranges, np.ndarray):
        merged = merge_table(_table(ranges))
        return [merged[i : i + max_per_call] for i in range(0, len(merged), max_per_call)]
    return split_ranges(merge_ranges(ranges), max_per_call)


MIN_GATHER_UNIT = 256
"""copy_ranges moves ranges as one gather and one scatter when they share a divisor of at least this many bytes."""


def copy_ranges(dst: torch.Tensor, src: torch.Tensor, ranges: Sequence[Range]) -> None:
    """Copy each validated (dst_offset, src_offset, length) of the flat uint8 `src` into the flat uint8 `dst`, on the
    current stream. Ranges of one device that share a divisor of at least MIN_GATHER_UNIT bytes (KV blocks: a block's
    bytes) move as one gather and one scatter of such units: a copy per range costs a launch each (~10 us on a GPU),
    and a migration of 256 blocks of 36 layers is 9,216 ranges. Otherwise one copy per range."""
    table = _table(ranges)
    unit = int(np.gcd.reduce(table.ravel())) if len(table) else 0
    if len(ranges) < 2 or unit < MIN_GATHER_UNIT or src.device != dst.device:
        for d, s, n in ranges:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return
    wide = unit % 8 == 0 and all(t.data_ptr() % 8 == 0 and t.storage_offset() % 8 == 0 for t in (dst, src))
    dtype, word = (torch.int64, 8) if wide else (torch.uint8, 1)  # (8-byte words: fewer, wider loads)

    def units(t: torch.Tensor) -> torch.Tensor:
        return t[: len(t) // unit * unit].view(dtype).view(-1, unit // word)  # (every range ends inside this prefix)

    table = table // unit  # [n, 3]: dst, src, length in units
    counts = table[:, 2]
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    index = torch.from_numpy(np.stack((np.repeat(table[:, 0], counts), np.repeat(table[:, 1], counts))) + within)
    index = index.to(dst.device, non_blocking=True)
    units(dst).index_copy_(0, index[0], units(src).index_select(0, index[1]))


# ---------------------------------------------------------------------------------------------
# KV block ids -> byte ranges


def kv_block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block of one layer's cache: blocks first, each one contiguous run of bytes — the GQA layout
    [num_blocks, 2, block_size, num_kv_heads, head_dim] or MLA's latent rows [num_blocks, block_size,
    kv_lora_rank + rope_dim] alike (the data plane moves bytes and never looks inside a block)."""
    if cache.dim() < 2:
        raise ValueError(f"expected a KV cache [num_blocks, ...block], got {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError("KV cache must be contiguous: block b of a layer starts at b * block_bytes")
    return cache[0].numel() * cache.element_size()


def kv_layer_offsets(caches: Sequence[torch.Tensor], region_base: int) -> list[int]:
    """Offset of each layer's cache inside a region that starts at address `region_base` and holds them all."""
    return [cache.data_ptr() - region_base for cache in caches]


def kv_block_table(block_pairs: Sequence[tuple[int, int]] | np.ndarray, local_layer_offsets: Sequence[int],
                   remote_layer_offsets: Sequence[int], block_bytes: int) -> np.ndarray:
    """kv_block_ranges as an int64 array [n, 3], built at once (a migration's read is a range per block per layer:
    thousands of them)."""
    if len(local_layer_offsets) != len(remote_layer_offsets):
        raise ValueError(f"{len(local_layer_offsets)} local layers but {len(remote_layer_offsets)} remote layers")
    pairs = np.asarray(block_pairs, dtype=np.int64).reshape(-1, 2)
    if (pairs < 0).any():
        src, dst = pairs[int(np.argmax((pairs < 0).any(axis=1)))].tolist()
        raise KVTransferError(f"block pair ({src}, {dst}) has a negative block id")
    runs = merge_table(np.stack((pairs[:, 1], pairs[:, 0], np.ones(len(pairs), np.int64)), axis=1))  # dst, src, n
    local = np.asarray(local_layer_offsets, dtype=np.int64)[:, None] + runs[:, 0] * block_bytes  # [layers, runs]
    remote = np.asarray(remote_layer_offsets, dtype=np.int64)[:, None] + runs[:, 1] * block_bytes
    return np.stack((local, remote, np.broadcast_to(runs[:, 2] * block_bytes, local.shape)), axis=-1).reshape(-1, 3)


def kv_block_ranges(
    block_pairs: Sequence[tuple[int, int]],
    local_layer_offsets: Sequence[int],
    remote_layer_offsets: Sequence[int],
    block_bytes: int,
) -> list[Range]:
    """Byte ranges that copy remote block `src` into local block `dst` in every layer, for each (src, dst).

    The reader is the local side (decode pulls from prefill), so `src` blocks live in the remote region and
    `dst` blocks in the local one. Runs where both src and dst ids are consecutive become one range per layer.
    Offsets come from `kv_layer_offsets` (all layers in one region) or are 0 (one region per layer).
    """
    if len(local_layer_offsets) != len(remote_layer_offsets):
        raise ValueError(f"{len(local_layer_offsets)} local layers but {len(remote_layer_offsets)} remote layers")
    runs: list[tuple[int, int, int]] = []  # (src_start, dst_start, num_blocks)
    for src, dst in sorted(block_pairs):
        if src < 0 or dst < 0:
            raise KVTransferError(f"block pair ({src}, {dst}) has a negative block id")
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return [
        (local_base + dst * block_bytes, remote_base + src * block_bytes, count * block_bytes)
        for local_base, remote_base in zip(local_layer_offsets, remote_layer_offsets)
        for src, dst, count in runs
    ]


# ---------------------------------------------------------------------------------------------
# the interface


class KVTransferEngine(ABC):
    """One engine's end of the data plane: registered regions, connected peers, batched one-sided reads.

    Subclasses implement `_register`, `endpoint_info`, `connect`, `_read_call` and `_close`; the base owns
    validation, merging and splitting so no backend ever sees a range that leaves a registered region.
    """

    backend: ClassVar[str]
    max_ranges_per_call: ClassVar[int] = MAX_RANGES_PER_CALL
    """Most ranges one _read_call gets (dlslime's completion mask: 32; a backend copying on a GPU takes them all)."""
    array_ranges: ClassVar[bool] = False
    """_read_call takes ranges given as an array [n, 3] as they are (copy_ranges does); else as (int, int, int)s."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.engine_id = f"{self.backend}-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self._regions: dict[str, tuple[RegionInfo, torch.Tensor]] = {}
        self._closed = False
        self.bytes_read = 0
        """Bytes this engine has pulled from peers (for /metrics)."""

    def register(self, name: str, buffer: Buffer) -> RegionInfo:
        """Register `buffer` under `name` and describe it for peers. The engine keeps `buffer` alive."""
        self._check_open()
        if name in self._regions:
            raise KVTransferError(f"region {name!r} is already registered")
        data = as_byte_tensor(buffer)
        if data.numel() == 0:
            raise KVTransferError(f"region {name!r} is empty")
        info = RegionInfo(
            name=name, engine_id=self.engine_id, backend=self.backend, length=data.numel(), addr=data.data_ptr()
        )
        info = self._register(info, data) or info
        self._regions[name] = (info, data)
        return info

    def region(self, name: str) -> RegionInfo:
        """The RegionInfo of a local region."""
        if name not in self._regions:
            raise KVTransferError(f"no local region named {name!r}")
        return self._regions[name][0]

    @abstractmethod
    def endpoint_info(self) -> EndpointInfo:
        """What a peer needs to connect to this engine."""

    @abstractmethod
    def connect(self, peer: EndpointInfo) -> None:
        """Make the peer readable; raise KVTransferError when it cannot be reached."""

    async def read(
        self,
        peer_region: RegionInfo,
        ranges: Sequence[Range] | np.ndarray,
        local_region: RegionInfo | str,
        timeout_s: float | None = None,
    ) -> None:
        """Copy each (local_offset, remote_offset, length) of `peer_region` into `local_region` (a sequence of them,
        or an int64 array [n, 3]: kv_block_table's).

        Returns when every byte has landed; raises KVTransferError on a bad range, an unknown region, a
        peer that is gone, or when `timeout_s` (default: the engine's) passes first.
        """
        self._check_open()
        name = local_region if isinstance(local_region, str) else local_region.name
        local = self.region(name)
        if peer_region.backend != self.backend:
            raise KVTransferError(f"region {peer_region.name!r} is a {peer_region.backend} region, not {self.backend}")
        calls = plan_reads(ranges, local, peer_region, self.max_ranges_per_call)
        if isinstance(ranges, np.ndarray) and not self.array_ranges:
            calls = [list(map(tuple, call.tolist())) for call in calls]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for call in calls:
            await self._read_call(peer_region, local, self._regions[name][1], call, deadline)
            self.bytes_read += int(_table(call)[:, 2].sum())

    def close(self) -> None:
        """Stop serving and reading; registered buffers are released. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()
            self._regions.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transfer engine {self.engine_id} is closed")

    @abstractmethod
    def _register(self, info: RegionInfo, data: torch.Tensor) -> RegionInfo | None:
        """Backend registration of a validated region (`data` is its flat uint8 view); may return `info` with
        what the backend adds for peers (cuda_ipc: the IPC handle)."""

    @abstractmethod
    async def _read_call(
        self, peer: RegionInfo, local: RegionInfo, local_data: torch.Tensor, ranges: list[Range], deadline: float
    ) -> None:
        """One backend call of at most max_ranges_per_call validated, merged ranges; done by `deadline`
        (event-loop time) or KVTransferError."""

    @abstractmethod
    def _close(self) -> None:
        """Release backend resources."""


# ---------------------------------------------------------------------------------------------
# same-process backend

_local_engines: weakref.WeakValueDictionary[str, LocalCopyEngine] = weakref.WeakValueDictionary()


class LocalCopyEngine(KVTransferEngine):
    """Both engines in one process: a read is a tensor copy (host or device memory, any mix).

    The colocated path and the reference the network backends are tested against. Peers find each other
    through a process-wide table of live engines keyed by engine_id.
    """

    backend: ClassVar[str] = "local"
    array_ranges: ClassVar[bool] = True

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(timeout_s)
        self._peers: dict[str, LocalCopyEngine] = {}
        _local_engines[self.engine_id] = self

    def endpoint_info(self) -> EndpointInfo:
        return EndpointInfo(backend=self.backend, engine_id=self.engine_id)

    def connect(self, peer: EndpointInfo) -> None:
        self._check_open()
        if peer.backend != self.backend:
            raise KVTransferError(f"cannot connect a {self.backend} engine to a {peer.backend} peer")
        engine = _local_engines.get(peer.engine_id)
        if engine is None or engine._closed:
            raise KVTransferError(f"local peer {peer.engine_id} is not in this process (or closed)")
        self._peers[peer.engine_id] = engine

    def _register(self, info: RegionInfo, data: torch.Tensor) -> None:
        pass  # nothing to pin: the peer copies straight from the tensor

    async def _read_call(
        self, peer: RegionInfo, local: RegionInfo, local_data: torch.Tensor, ranges: list[Range], deadline: float
    ) -> None:
        engine = self._peers.get(peer.engine_id)
        if engine is None:
            raise KVTransferError(f"not connected to {peer.engine_id}")
        if engine._closed:
            raise KVTransferError(f"peer {peer.engine_id} is gone (closed)")
        entry = engine._regions.get(peer.name)
        if entry is None or entry[0] != peer:
            raise KVTransferError(f"peer {peer.engine_id} has no region {peer.name!r} as described")
        remote_data = entry[1]

        def copy() -> None:
            copy_ranges(local_data, remote_data, ranges)
            if local_data.device.type == "cuda" or remote_data.device.type == "cuda":
                torch.cuda.current_stream(local_data.device if local_data.device.type == "cuda"
                                          else remote_data.device).synchronize()

        remaining = deadline - asyncio.get_running_loop().time()
        try:  # torch copies release the GIL: large ones run off the event loop
            await asyncio.wait_for(asyncio.to_thread(copy), timeout=max(remaining, 0.0))
        except TimeoutError as e:
            raise KVTransferError(f"local copy from {peer.engine_id} timed out") from e

    def _close(self) -> None:
        self._peers.clear()
        _local_engines.pop(self.engine_id, None)


# ---------------------------------------------------------------------------------------------
# backend choice


def create_kv_transfer_engine(backend: str, **options: Any) -> KVTransferEngine:
    """Build a transfer engine by backend name (`local`, `dlslime_tcp`, `cuda_ipc`, `torch_dist`); options go to
    its constructor."""
    if backend == LocalCopyEngine.backend:
        return LocalCopyEngine(**options)
    if backend == "dlslime_tcp":
        try:  # dlslime is an optional extra (`pd`): import it only when this backend is chosen
            from flotilla.transport.kv_transfer_dlslime import DlslimeTCPEngine
        except ImportError as e:
            raise KVTransferError(
                f"the dlslime_tcp backend needs dlslime (pip install 'flotilla[pd]') and libibverbs1: {e}"
            ) from e
        return DlslimeTCPEngine(**options)
    if backend == "torch_dist":
        from flotilla.transport.kv_transfer_torch import TorchDistEngine  # that module imports this one

        return TorchDistEngine(**options)
    if backend == "cuda_ipc":
        from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine

        return CudaIpcEngine(**options)
    raise KVTransferError(
        f"unknown KV transfer backend {backend!r} (known: local, dlslime_tcp, cuda_ipc, torch_dist)")


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_RANGES_PER_CALL",
    "copy_ranges",
    "EndpointInfo",
    "KVTransferEngine",
    "KVTransferError",
    "LocalCopyEngine",
    "Range",
    "RegionInfo",
    "as_byte_tensor",
    "create_kv_transfer_engine",
    "kv_block_bytes",
    "kv_block_ranges",
    "kv_block_table",
    "kv_layer_offsets",
    "merge_ranges",
    "merge_table",
    "plan_reads",
    "split_ranges",
    "validate_ranges",
]
