"""Torch reference for paged multi-head latent attention (MLA, DeepSeek-V2/V3): the CPU backend and the
oracle later GPU backends (flash_mla, flashinfer's MLA, triton) are tested against.

The compressed cache of one layer is ONE tensor [num_blocks, block_size, kv_lora_rank + rope_dim]: per
token the normalised latent c_kv, then the roped shared key part k_pe (one cache "head"). With the key
projection absorbed into the query (q_latent = q_nope W_UK, see models/deepseek_v3_mla.py) attention is
multi-query over that cache: the keys are whole rows, the values their first kv_lora_rank entries, and
the output stays in the latent space (the caller projects it with W_UV). One code path serves prefill
chunks (causal among a chunk's own tokens, over the cached prefix) and decodes alike; like the GQA
reference it is vectorized over the batch, with no python loop over sequences or tokens.

An FP8 (e4m3) cache holds whole rows / kv_scale (one scale for the latent and the rope part, like vLLM's
MLA k_scale), clamped to +-448; reading multiplies by kv_scale (kernels/attention/fp8_kv.py).
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention.fp8_kv import dequantize_kv, is_fp8, quantize_kv
from flotilla.kernels.attention.metadata import AttentionMetadata


def store_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: float = 1.0) -> None:
    """Write the new tokens' latent c_kv [T, kv_lora_rank] and roped k_pe [T, rope_dim] into kv_cache
    [num_blocks, block_size, kv_lora_rank + rope_dim] at slot_mapping [T] (-1 = padding, not stored); an
    FP8 cache gets them / kv_scale."""
    block_size, kv_lora_rank = kv_cache.shape[1], c_kv.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, offsets, :kv_lora_rank] = quantize_kv(c_kv[keep], kv_scale, kv_cache.dtype)
    kv_cache[blocks, offsets, kv_lora_rank:] = quantize_kv(k_pe[keep], kv_scale, kv_cache.dtype)


def gather_latent(kv_cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype | None = None,
                  kv_scale: float = 1.0) -> torch.Tensor:
    """[B, max_seq_len, kv_lora_rank + rope_dim] in `dtype` (default: the cache's; float32 for FP8): each
    sequence's cached rows read through its block table (an FP8 cache dequantized with kv_scale); rows at or
    beyond its seq_len are zeroed so stale or never-written (NaN) memory cannot leak in."""
    num_seqs = meta.num_seqs
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    max_len = meta.max_seq_len
    num_blocks = -(-max_len // block_size)
    rows = kv_cache[meta.block_tables[:, :num_blocks].long()]  # [B, nb, bs, D]
    rows = rows.reshape(num_seqs, num_blocks * block_size, width)[:, :max_len]
    fp8 = is_fp8(kv_cache.dtype)  # (masked_fill has no e4m3 kernel: dequantize first)
    rows = dequantize_kv(rows, kv_scale, dtype or (torch.float32 if fp8 else kv_cache.dtype))
    valid = torch.arange(max_len, device=rows.device)[None, :] < meta.seq_lens.long()[:, None]
    return rows.masked_fill(~valid[:, :, None], 0)


def paged_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_scale: float = 1.0, select: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MQA of every new token over its sequence's latent cache: q_latent [T, H, kv_lora_rank] (the
    absorbed no-rope query) and q_pe [T, H, rope_dim] (the roped query) -> [T, H, kv_lora_rank] in
    q_latent's dtype; softmax in float32. The new tokens must already be stored (store_latent first);
    kv_scale dequantizes an FP8 cache. select: int32 [T, K], the only positions each new token attends to (-1 =
    none; sparse attention, dsa_ref.select_positions)."""
    num_tokens, num_heads, kv_lora_rank = q_latent.shape
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    qsl = meta.query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=qsl.device), query_lens, output_size=num_tokens)
    pos_in_query = torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]

    query = torch.cat((q_latent, q_pe), dim=-1)
    q = query.new_zeros(num_seqs, max_q, num_heads, query.shape[-1])
    q[seq_idx, pos_in_query] = query
    ctx = gather_latent(kv_cache, meta, query.dtype, kv_scale)  # [B, S, D]: keys; values are ctx[..., :kv_lora_rank]

    scores = torch.einsum("bqhd,bsd->bhqs", q, ctx).float() * scale
    cached_lens = meta.seq_lens.long() - query_lens  # context before this step's tokens
    # New token i of sequence b sits at position cached_b + i and sees keys at <= that position.
    last_visible = cached_lens[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, Lq]
    key_pos = torch.arange(meta.max_seq_len, device=q.device)
    mask = key_pos[None, None, :] <= last_visible[:, :, None]  # [B, Lq, S]; padded rows still see key 0
    if select is not None:
        from flotilla.kernels.mla.dsa_ref import selection_mask  # (dsa_ref reads this module's gather)

        mask = mask & selection_mask(select, meta)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.einsum("bhqs,bsl->bqhl", probs, ctx[..., :kv_lora_rank])  # [B, Lq, H, kv_lora_rank]
    return out[seq_idx, pos_in_query]
