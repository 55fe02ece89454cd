"""Paged attention backends and the dispatch that picks one by name or by capability.

Every backend reads the same AttentionMetadata and the same per-layer KV cache layout
(kv_cache_shape), so the worker allocates caches once whatever backend runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flotilla.kernels.attention import torch_ref
from flotilla.kernels.attention.metadata import AttentionMetadata, positions_from_lists

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_attention_backends",
    "get_attention_backend",
    "kv_cache_shape",
    "positions_from_lists",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One attention implementation: store_kv(key, value, kv_cache, slot_mapping) writes the new tokens'
    K/V; forward(query, kv_cache, meta, scale) -> [T, Hq, D] attends over the paged cache."""

    name: str
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


_BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend(name="torch", store_kv=torch_ref.store_kv, forward=torch_ref.paged_attention),
}
# Preference order for "auto": the first importable/usable one wins (triton, flashinfer go first later).
_AUTO_ORDER: tuple[str, ...] = ("torch",)
_logged_auto_choice = False


def available_attention_backends() -> list[str]:
    """Names accepted by get_attention_backend, "auto" included."""
    return ["auto", *_BACKENDS]


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """The backend called `name`; "auto" picks the best one this machine supports (logged once)."""
    global _logged_auto_choice
    if name == "auto":
        backend = _BACKENDS[next(n for n in _AUTO_ORDER if n in _BACKENDS)]
        if not _logged_auto_choice:
            logger.info("attention backend: %s (auto)", backend.name)
            _logged_auto_choice = True
        return backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choices: {', '.join(available_attention_backends())}")
    return _BACKENDS[name]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's paged KV cache: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]."""
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)
