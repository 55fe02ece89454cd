"""A worker rank's KV cache as the KV data plane sees it (actors/kv_migration.py moves it): its layers' block layout,
whether they lie in one allocation (then one registered region reaches them all), the host staging buffers for
backends that read host memory only, and a hybrid model's recurrent-state pools."""

from __future__ import annotations

import mmap

import torch

from flotilla.config import DisaggConfig
from flotilla.transport.kv_transfer import kv_block_bytes


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), one allocation; on a CPU from anonymous memory, which the OS hands out zeroed as each page
    is first touched: a CPU engine's cache (1 GiB by default) then costs neither the time to write it nor resident
    memory for blocks no sequence has used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1))  # (the tensor keeps the mapping alive)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVMemory:
    """A rank's KV cache as the data plane sees it: one contiguous tensor per layer, same block layout (`whole`:
    all of them as one tensor when they lie back to back in one allocation); and a hybrid model's recurrent-state
    pools (`states`, row `state_row_base + s` holding snapshot slot s)."""

    def __init__(self, caches: list[torch.Tensor], states: list[torch.Tensor] = (), state_row_base: int = 0) -> None:
        if not caches:
            raise ValueError("a KV cache needs at least one layer")
        self.caches = caches
        self.block_bytes = kv_block_bytes(caches[0])
        if any(kv_block_bytes(c) != self.block_bytes for c in caches):
            raise ValueError("every layer's KV cache must have the same block size in bytes")
        self.states = list(states)
        self.state_row_base = state_row_base
        self.state_row_bytes = [kv_block_bytes(t) for t in self.states]
        self.whole = _back_to_back(caches)
        """The layers as one tensor [layers, *layer shape] sharing their memory, or None when they are apart."""

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def kv_dtype(self) -> str:
        """The cache's element type ("bfloat16", "float8_e4m3fn", ...): both ends of a migration must agree."""
        return str(self.caches[0].dtype).removeprefix("torch.")

    def needs_staging(self, config: DisaggConfig) -> bool:
        """Whether the backend must reach this cache through host staging buffers."""
        if config.kv_staging != "auto":
            return config.kv_staging == "always"
        return self.device.type != "cpu" and config.kv_transfer_backend not in ("local", "torch_dist", "cuda_ipc")

    def staging_buffer(self, blocks: int) -> torch.Tensor:
        """A host buffer of `blocks` slots per layer, [layers, blocks, *block shape] (pinned when a GPU is there)."""
        shape = (len(self.caches), blocks, *self.caches[0].shape[1:])
        return torch.empty(shape, dtype=self.caches[0].dtype, pin_memory=self.device.type == "cuda")

    # Blocks move as bytes (uint8 views): the data plane never looks at values, and index_copy_ has no kernel
    # for every cache dtype (none for float8_e4m3fn on the CPU).

    def stage_out(self, buffer: torch.Tensor, block_ids: list[int]) -> None:
        """KV blocks -> staging slots 0..n-1 of every layer."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.caches):
            buffer[layer, : len(block_ids)].view(torch.uint8).copy_(cache.view(torch.uint8).index_select(0, idx))

    def stage_in(self, buffer: torch.Tensor, block_ids: list[int]) -> None:
        """Staging slots 0..n-1 of every layer -> KV blocks (finished when this returns)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.caches):
            staged = buffer[layer, : len(block_ids)].view(torch.uint8).to(self.device)
            cache.view(torch.uint8).index_copy_(0, idx, staged)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _back_to_back(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one tensor when each starts where the one before ends, in one storage; else None."""
    first = caches[0]
    size = first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    for i, c in enumerate(caches):
        if (c.shape != first.shape or c.dtype != first.dtype or not c.is_contiguous()
                or c.untyped_storage().data_ptr() != storage or c.data_ptr() != first.data_ptr() + i * size):
            return None
    return first.as_strided((len(caches), *first.shape), (first.numel(), *first.stride()))
