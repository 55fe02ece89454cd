"""Paged attention backends and the dispatch that picks one by name or by capability.

Every backend reads the same AttentionMetadata and the same per-layer KV cache layout
(kv_cache_shape), so the worker allocates caches once whatever backend runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flotilla import envs
from flotilla.kernels.attention import flashinfer_backend, torch_ref
from flotilla.kernels.attention.fp8_kv import KV_CACHE_DTYPES, check_fp8_kv_support, kv_cache_torch_dtype
from flotilla.kernels.attention.metadata import AttentionMetadata, positions_from_lists
from flotilla.kernels.attention.mixed_split import mixed_split
from flotilla.kernels.triton_support import triton_usable

__all__ = [
    "KV_CACHE_DTYPES",
    "AttentionBackend",
    "AttentionMetadata",
    "available_attention_backends",
    "best_attention_backend",
    "check_fp8_kv_support",
    "get_attention_backend",
    "kv_cache_shape",
    "kv_cache_torch_dtype",
    "positions_from_lists",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One attention implementation: store_kv(key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0)
    writes the new tokens' K/V; forward(query, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0) -> [T, Hq, D]
    attends over the paged cache. The k/v scales matter only for an FP8 cache (kernels/attention/fp8_kv.py):
    the store quantizes with them, the read dequantizes."""

    name: str
    store_kv: Callable[..., None]
    forward: Callable[..., torch.Tensor]


_BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend(name="torch", store_kv=torch_ref.store_kv, forward=torch_ref.paged_attention),
}
_logged_auto_choice = False


_OPTIONAL = ("flashinfer", "triton", "flashinfer_triton")
"""Backends built on first use, when their package and device are there."""


def available_attention_backends() -> list[str]:
    """Names accepted by get_attention_backend, "auto" included."""
    return ["auto", *_BACKENDS, *(n for n in _OPTIONAL if n not in _BACKENDS)]


FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""Head sizes flashinfer's prebuilt / JIT kernels cover."""

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
"""Model dtypes flashinfer's attention kernels take (its queries are 16-bit)."""

def best_attention_backend(device: torch.device, head_dim: int | None = None,
                           dtype: torch.dtype | None = None) -> str:
    """The fastest backend usable on `device` for this head size and model dtype: on CUDA with flashinfer
    importable, flashinfer_triton (FlashInfer's prefill, triton's decode; flashinfer alone without triton), then
    triton on CUDA (flashinfer missing, a head size it lacks, or float32, which its kernels do not take), else the
    torch reference, which gathers every sequence's KV per layer and so only suits CPUs and tests. flashinfer_triton
    rather than flashinfer, since triton's decode kernel in CUDA graphs is faster than FlashInfer's at small batches
    and as fast at large ones."""
    flashinfer_dtype = dtype is None or dtype in FLASHINFER_DTYPES
    if device.type == "cuda" and flashinfer_backend.importable() and head_dim in FLASHINFER_HEAD_DIMS \
            and flashinfer_dtype:
        return "flashinfer_triton" if triton_usable() else "flashinfer"
    if device.type == "cuda" and triton_usable():
        return "triton"
    return "torch"


def get_attention_backend(name: str = "auto", device: torch.device | None = None,
                          head_dim: int | None = None, dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend called `name`; "auto" picks the best one for `device` (default: torch's current default
    device), head size and model dtype, and logs the choice once."""
    global _logged_auto_choice
    if name == "auto":
        name = best_attention_backend(device or torch.get_default_device(), head_dim, dtype)
        if not _logged_auto_choice:
            logger.info("attention backend: %s (auto)", name)
            _logged_auto_choice = True
    if name in ("flashinfer", "flashinfer_triton") and dtype is not None and dtype not in FLASHINFER_DTYPES:
        raise ValueError(f"attention backend {name!r} takes float16 or bfloat16 models, not {dtype}: "
                         "choose triton (or auto) for this dtype")
    if name == "flashinfer" and name not in _BACKENDS:
        if not flashinfer_backend.importable():
            raise ValueError("attention backend 'flashinfer' needs CUDA and the flashinfer package")
        impl = flashinfer_backend.shared()
        _BACKENDS[name] = AttentionBackend(name=name, store_kv=impl.store_kv, forward=impl.forward)
    if name == "triton" and name not in _BACKENDS:
        if not triton_usable():
            raise ValueError("attention backend 'triton' needs the triton package and CUDA (or TRITON_INTERPRET=1)")
        # Optional dependency (CPU-only installs lack it), so imported only when this backend is chosen.
        from flotilla.kernels.triton import attention as triton_attention

        _BACKENDS[name] = AttentionBackend(
            name=name, store_kv=triton_attention.store_kv, forward=triton_attention.forward
        )
    if name == "flashinfer_triton" and name not in _BACKENDS:
        if not flashinfer_backend.importable() or not triton_usable():
            raise ValueError("attention backend 'flashinfer_triton' needs CUDA with the flashinfer and triton packages")
        _BACKENDS[name] = _flashinfer_triton()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choices: {', '.join(available_attention_backends())}")
    return _BACKENDS[name]


FLASHINFER_DECODE_ABOVE = envs.FLOTILLA_FLASHINFER_DECODE_ABOVE
"""flashinfer_triton decodes batches of more sequences than this with FlashInfer's kernel, smaller ones with
triton's, the faster one at small batches (a lone sequence most of all); 64 measured best on the nano workload.
Read once at import, since every layer's decode asks; tests patch this constant."""


def decodes_with_flashinfer(num_seqs: int) -> bool:
    """Whether flashinfer_triton runs a pure-decode step of `num_seqs` sequences on FlashInfer's kernel."""
    return num_seqs > FLASHINFER_DECODE_ABOVE


def _flashinfer_triton() -> AttentionBackend:
    """FlashInfer for the prompt rows of a step and for decode steps of more than FLASHINFER_DECODE_ABOVE sequences,
    triton's decode kernel for smaller pure-decode steps and for the decode rows beside prompt rows (mixed_split.py),
    over the one cache layout they share; triton's prefill kernel for a chunk whose metadata has no host copies (a
    prefill graph's), which FlashInfer could not plan. Decode graphs capture the triton kernel over static tables
    (actors/cuda_graphs.py), with no host planning per step, and FlashInfer's planned per step above the split.
    Triton's is faster at small and middle batches, at short and long contexts, which is why "auto" picks this
    backend."""
    from flotilla.kernels.triton import attention as triton_attention

    impl = flashinfer_backend.shared()

    def forward(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if meta.max_query_len == 1 and not decodes_with_flashinfer(meta.num_seqs):
            return triton_attention.paged_decode_attention(query, kv_cache, meta, scale, **scales)
        if meta.max_query_len > 1 and meta.host is None:  # a prefill graph's (actors/prefill_graphs.py); a decode
            # graph's FlashInfer sizes have no host copies either, but are planned before each replay (cuda_graphs.py)
            return triton_attention.paged_prefill_attention(query, kv_cache, meta, scale, **scales)
        split = mixed_split(meta)
        if split is None:
            return impl.forward(query, kv_cache, meta, scale, k_scale, v_scale)
        out = torch.empty_like(query)
        triton_attention.paged_decode_attention(query, kv_cache, split.decode, scale, out=out, **scales)
        rows = split.prefill_rows
        if isinstance(rows, slice):
            impl.forward(query[rows], kv_cache, split.prefill, scale, k_scale, v_scale, out=out[rows])
        else:
            out.index_copy_(0, rows, impl.forward(query.index_select(0, rows), kv_cache, split.prefill, scale,
                                                  k_scale, v_scale))
        return out

    return AttentionBackend(name="flashinfer_triton", store_kv=impl.store_kv, forward=forward)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's paged KV cache: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]."""
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)
