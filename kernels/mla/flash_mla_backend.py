"""MLA decode through DeepSeek's FlashMLA (the `flash_mla` package; the GPU bundle takes it from vLLM's wheel).

FlashMLA's dense decode reads the compressed cache as [num_blocks, 64, 1, 576] (block size 64, one cache head,
kv_lora_rank 512 + rope 64): exactly kernels/mla's layout viewed with a head axis, so nothing is copied. The
query is the absorbed latent query and the roped part side by side, [B, 1, H, 576]; the output is the latent
[B, 1, H, 512]. Its tile scheduler metadata depends on the step's seq_lens, so it is computed by the first
layer's call of a step (inside the call, on the device) and reused by the other layers through the step's
AttentionMetadata.backend_state: in a CUDA graph the first layer's computation is captured and reruns on every
replay. Prefill and mixed steps (more than one new token per sequence) go to the triton MLA kernels, as vLLM's
FlashMLA backend sends prefills elsewhere.

Limits, checked with clear errors: block size 64, a bf16 cache (FlashMLA's FP8 cache is another layout, with
scales inside each row), kv_lora_rank 512 and rope_dim 64, a Hopper GPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from flotilla.kernels.attention.metadata import AttentionMetadata

BLOCK_SIZE = 64
"""The only page size FlashMLA reads."""
LATENT, ROPE = 512, 64
"""DeepSeek-V3's kv_lora_rank and qk_rope_head_dim, the only MLA shape FlashMLA's kernels are built for."""


def import_flash_mla() -> ModuleType | None:
    """The flash_mla module, or None when it is not installed or does not load here."""
    try:
        return importlib.import_module("flash_mla")
    except (ImportError, OSError, RuntimeError):
        return None


def flash_mla_usable() -> bool:
    """A Hopper GPU (compute capability 9.x) with flash_mla importable."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    return import_flash_mla() is not None


def check_cache(kv_cache: torch.Tensor) -> None:
    """ValueError unless kv_cache is a layout FlashMLA reads: [num_blocks, 64, 576], bf16."""
    if kv_cache.dim() != 3 or kv_cache.shape[1] != BLOCK_SIZE or kv_cache.shape[2] != LATENT + ROPE:
        raise ValueError(f"flash_mla reads a [blocks, {BLOCK_SIZE}, {LATENT + ROPE}] latent cache (block_size "
                         f"{BLOCK_SIZE}, kv_lora_rank {LATENT}, rope {ROPE}), not {tuple(kv_cache.shape)}")  # fmt: skip
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"the flash_mla backend reads a bfloat16 cache, not {kv_cache.dtype} (use the triton MLA "
                         "backend for an FP8 cache)")  # fmt: skip


def paged_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, *, flash_mla: ModuleType | None = None) -> torch.Tensor:
    """One new token per sequence: q_latent [B, H, 512], q_pe [B, H, 64] -> [B, H, 512] (torch_ref.paged_mla for
    max_query_len == 1). `flash_mla` stands in for the package (tests pass a torch stand-in on CPU)."""
    check_cache(kv_cache)
    fm = flash_mla or import_flash_mla()
    if fm is None:
        raise RuntimeError("the flash_mla MLA backend needs the flash_mla package")
    num_seqs, num_heads = q_latent.shape[0], q_latent.shape[1]
    if num_seqs == 0:
        return torch.empty_like(q_latent)
    query = torch.cat((q_latent, q_pe), dim=-1).view(num_seqs, 1, num_heads, LATENT + ROPE)
    sched = meta.backend_state.get("flash_mla")
    if sched is None:  # the step's first layer: FlashMLA fills it in during the call
        sched = meta.backend_state["flash_mla"] = fm.get_mla_metadata()[0]
    out, _ = fm.flash_mla_with_kvcache(query, kv_cache.view(kv_cache.shape[0], BLOCK_SIZE, 1, LATENT + ROPE),
                                       meta.block_tables, meta.seq_lens, LATENT, sched, softmax_scale=scale,
                                       causal=True)  # fmt: skip
    return out.view(num_seqs, num_heads, LATENT)


def paged_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """The backend's forward: FlashMLA for decode steps, the triton prefill kernel for the rest."""
    if meta.max_query_len == 1:
        return paged_mla_decode(q_latent, q_pe, kv_cache, meta, scale)
    from flotilla.kernels.mla import triton_mla

    return triton_mla.paged_mla_prefill(q_latent, q_pe, kv_cache, meta, scale, kv_scale)

