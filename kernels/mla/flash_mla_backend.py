"""MLA decode through DeepSeek's FlashMLA (the `flash_mla` package; the GPU bundle takes it from vLLM's wheel).

FlashMLA's dense decode reads the compressed cache as [num_blocks, 64, 1, 576] (block size 64, one cache head,
kv_lora_rank 512 + rope 64): exactly kernels/mla's layout viewed with a head axis, so nothing is copied. The
query is the absorbed latent query and the roped part side by side, [B, s, H, 576] for s new tokens per sequence
(1 in a decode step, up to 4 in a speculating step's verify pass, causal within them); the output is the latent
[B, s, H, 512]. Its tile scheduler metadata depends on the step's seq_lens, so it is computed by the first layer's
call of a step (inside the call, on the device) and reused by the other layers through the step's
AttentionMetadata.backend_state: in a CUDA graph the first layer's computation is captured and reruns on every
replay. Prefill and mixed steps (sequences with different numbers of new tokens, or more than 4) go to triton's
MLA prefill kernel, as vLLM's FlashMLA backend sends prefills elsewhere.

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
MAX_UNIFORM_QUERY = 4
"""The most new tokens per sequence sent to FlashMLA's decode kernel (a speculating step with up to 3 drafts; its
causal mask covers each sequence's last s_q positions). Longer uniform steps (a batch of equal prefill chunks) go
to the triton prefill kernel, which is built for them."""


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


def uniform_query_len(num_tokens: int, meta: AttentionMetadata) -> int:
    """The number of new tokens every sequence of the step has when it is the same for all and at most
    MAX_UNIFORM_QUERY (what FlashMLA's decode kernel takes), else 0. (num_tokens == B * max_query_len holds exactly
    when every sequence has max_query_len tokens.)"""
    q = meta.max_query_len
    return q if 1 <= q <= MAX_UNIFORM_QUERY and num_tokens == meta.num_seqs * q else 0


def paged_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, *, flash_mla: ModuleType | None = None) -> torch.Tensor:
    """The same number s of new tokens for each of B sequences (s = 1 for decode steps; a speculating step verifies
    s - 1 drafts): q_latent [B * s, H, 512], q_pe [B * s, H, 64] -> [B * s, H, 512], causal within each sequence's s
    new tokens (torch_ref.paged_mla). `flash_mla` stands in for the package (tests pass a torch stand-in on CPU)."""
    check_cache(kv_cache)
    fm = flash_mla or import_flash_mla()
    if fm is None:
        raise RuntimeError("the flash_mla MLA backend needs the flash_mla package")
    num_tokens, num_heads = q_latent.shape[0], q_latent.shape[1]
    if num_tokens == 0:
        return torch.empty_like(q_latent)
    s_q = uniform_query_len(num_tokens, meta)
    if not s_q:
        raise ValueError(f"flash_mla's decode takes the same number of new tokens (at most {MAX_UNIFORM_QUERY}) for "
                         f"every sequence, not {num_tokens} tokens over {meta.num_seqs} sequences")
    num_seqs = num_tokens // s_q
    query = torch.cat((q_latent, q_pe), dim=-1).view(num_seqs, s_q, num_heads, LATENT + ROPE)
    sched = meta.backend_state.get("flash_mla")
    if sched is None:  # the step's first layer: FlashMLA fills it in during the call
        sched = meta.backend_state["flash_mla"] = fm.get_mla_metadata()[0]
    out, _ = fm.flash_mla_with_kvcache(query, kv_cache.view(kv_cache.shape[0], BLOCK_SIZE, 1, LATENT + ROPE),
                                       meta.block_tables, meta.seq_lens, LATENT, sched, softmax_scale=scale,
                                       causal=True)  # fmt: skip
    return out.view(num_tokens, num_heads, LATENT)


def paged_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """The backend's forward: FlashMLA for decode steps and uniform speculating steps (the same few new tokens per
    sequence), triton's prefill kernel for the rest."""
    if uniform_query_len(q_latent.shape[0], meta):
        return paged_mla_decode(q_latent, q_pe, kv_cache, meta, scale)
    from flotilla.kernels.mla import triton_mla

    return triton_mla.paged_mla_prefill(q_latent, q_pe, kv_cache, meta, scale, kv_scale)

