"""Paged MLA (multi-head latent attention) backends over the compressed latent cache, picked by name or
by capability like kernels/attention's.

Every backend shares one cache layout per layer, mla_cache_shape: [num_blocks, block_size, kv_lora_rank +
rope_dim], the latent c_kv then the roped k_pe of each token. flash_mla reads it as [num_blocks, block_size,
1, 576] (block size 64) and flashinfer's MLA as its two views [..., :kv_lora_rank] / [..., kv_lora_rank:], so
adding them changes no allocation. An FP8 (e4m3) cache keeps the layout: the store quantizes whole rows with one
kv_scale, the read dequantizes (kernels/attention/fp8_kv.py).

- "torch": torch_ref, the reference and the CPU path ("auto" without CUDA).
- "triton": triton_mla, a flash-decoding kernel for decode steps, a one-launch store (no host sync) and
  a causal flash-attention kernel for prefill and mixed steps. "auto" on CUDA where FlashMLA cannot run, and for
  sparse attention (DeepSeek-V3.2, GLM-5: dsa_triton's indexer, top-k and sparse MLA kernels).
- "flash_mla": DeepSeek's FlashMLA for decode steps (flash_mla_backend.py; block size 64, bf16 cache, Hopper),
  the triton kernels for prefill and the store. "auto" on a Hopper GPU for DeepSeek-V3's latent (kv_lora_rank
  512, rope 64) in bfloat16, whose decode at large batches and long contexts reads the cache several times faster
  than triton's kernel. The engine then pages the cache in blocks of 64 (DeepseekV3ForCausalLM.settle_kv_layout);
  an FP8 cache or another forced block size makes "auto" fall back to triton.
- "flashinfer": FlashInfer's BatchMLAPagedAttentionWrapper for every step (flashinfer_mla_backend.py; bf16 / fp16
  cache, eager), the triton store. Forced by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flotilla.kernels.mla import torch_ref

__all__ = ["MLABackend", "available_mla_backends", "best_mla_backend", "get_mla_backend", "mla_cache_shape"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MLABackend:
    """One MLA implementation: store_latent(c_kv, k_pe, kv_cache, slot_mapping, kv_scale=1.0) writes the new
    tokens' cache rows; forward(q_latent, q_pe, kv_cache, meta, scale, kv_scale=1.0) -> [T, H, kv_lora_rank]
    attends over the cache (kv_scale matters only for an FP8 cache); the torch and triton backends also take
    select=, the positions sparse attention reads (int32 [T, K], -1 = none: kernels/mla/dsa_ref.py)."""

    name: str
    store_latent: Callable[..., None]
    forward: Callable[..., torch.Tensor]


_BACKENDS: dict[str, MLABackend] = {
    "torch": MLABackend(name="torch", store_latent=torch_ref.store_latent, forward=torch_ref.paged_mla),
}
_logged_auto_choice = False


def _triton_backend() -> MLABackend:
    from flotilla.kernels.mla import triton_mla  # optional dependency: imported only when chosen

    return MLABackend(name="triton", store_latent=triton_mla.store_latent, forward=triton_mla.paged_mla)


def _flash_mla_backend() -> MLABackend:
    from flotilla.kernels.mla import flash_mla_backend as fm
    from flotilla.kernels.mla import triton_mla  # the same cache layout: triton's store

    return MLABackend(name="flash_mla", store_latent=triton_mla.store_latent, forward=fm.paged_mla)


def _flashinfer_backend() -> MLABackend:
    from flotilla.kernels.mla import flashinfer_mla_backend as fi
    from flotilla.kernels.mla import triton_mla  # the same cache layout: triton's store

    return MLABackend(name="flashinfer", store_latent=triton_mla.store_latent, forward=fi.paged_mla)


def available_mla_backends() -> list[str]:
    """Names accepted by get_mla_backend, "auto" included (triton where it can run)."""
    from flotilla.kernels.attention import triton_usable
    from flotilla.kernels.mla.flash_mla_backend import flash_mla_usable
    from flotilla.kernels.mla.flashinfer_mla_backend import flashinfer_mla_usable

    on_gpu = triton_usable() and torch.cuda.is_available()  # (their stores are the triton kernel)
    return ["auto", *_BACKENDS, *(["triton"] if triton_usable() else []),
            *(["flash_mla"] if on_gpu and flash_mla_usable() else []),
            *(["flashinfer"] if on_gpu and flashinfer_mla_usable() else [])]


def best_mla_backend(device: torch.device, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                     dtype: torch.dtype | None = None) -> str:
    """The fastest backend usable on `device`: FlashMLA for its shapes (a latent of 512 + 64 in bfloat16, on a
    Hopper GPU with flash_mla importable), else triton on CUDA, else the torch reference. flashinfer's MLA is
    offered by name only: it decodes eager, without CUDA graphs."""
    from flotilla.kernels.attention import triton_usable
    from flotilla.kernels.mla.flash_mla_backend import LATENT, ROPE, flash_mla_usable

    if device.type != "cuda" or not triton_usable():
        return "torch"
    if (kv_lora_rank, rope_dim, dtype) == (LATENT, ROPE, torch.bfloat16) and flash_mla_usable():
        return "flash_mla"
    return "triton"


def get_mla_backend(name: str = "auto", device: torch.device | None = None, *, kv_lora_rank: int | None = None,
                    rope_dim: int | None = None, dtype: torch.dtype | None = None) -> MLABackend:
    """The backend called `name`; "auto" picks the best one for `device` (default: torch's current default
    device) and the model's latent shape and dtype (FlashMLA only for its own), and logs the choice once."""
    global _logged_auto_choice
    if name == "auto":
        name = best_mla_backend(device or torch.get_default_device(), kv_lora_rank, rope_dim, dtype)
        if not _logged_auto_choice:
            logger.info("MLA backend: %s (auto)", name)
            _logged_auto_choice = True
    if name == "triton" and "triton" in available_mla_backends():
        return _triton_backend()
    if name == "flash_mla" and "flash_mla" in available_mla_backends():
        return _flash_mla_backend()
    if name == "flashinfer" and "flashinfer" in available_mla_backends():
        return _flashinfer_backend()
    if name not in _BACKENDS:
        raise ValueError(f"unknown MLA backend {name!r}; choices: {', '.join(available_mla_backends())}")
    return _BACKENDS[name]


def mla_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
    """Shape of one layer's compressed cache: [num_blocks, block_size, kv_lora_rank + rope_dim]."""
    return (num_blocks, block_size, kv_lora_rank + rope_dim)
