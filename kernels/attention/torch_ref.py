"""Torch reference for paged attention: the CPU backend and the oracle GPU backends are tested against.

KV cache of one layer: ONE tensor [num_blocks, 2, block_size, num_kv_heads, head_dim] (flashinfer's
NHD paged layout; index 0 of dim 1 = K, 1 = V). Everything is vectorized over the batch: K/V are
gathered through the block tables into a padded [B, max_seq_len, ...] tensor and one masked SDPA runs
over all sequences, so there is no python loop over sequences or tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.attention.fp8_kv import dequantize_kv, is_fp8, quantize_kv
from flotilla.kernels.attention.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] of the new tokens into kv_cache at slot_mapping [T] (-1 = skip); an FP8
    cache stores key / k_scale and value / v_scale (kernels/attention/fp8_kv.py)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = quantize_kv(key[keep], k_scale, kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = quantize_kv(value[keep], v_scale, kv_cache.dtype)


def _token_coordinates(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index within that sequence's new tokens) of every flat token, each int64 [T]."""
    qsl = meta.query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=qsl.device), query_lens, output_size=num_tokens
    )
    pos_in_query = torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]
    return seq_idx, pos_in_query


def gather_kv(kv_cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype | None = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V), each [B, Hkv, max_seq_len, D] in `dtype` (default: the cache's; float32 for FP8): each sequence's
    context read through its block table (an FP8 cache dequantized with k_scale / v_scale); slots at or beyond its
    seq_len are zeroed so stale or uninitialized cache memory (NaN) cannot leak in.

    Each of K and V is one index_select of whole blocks (rows of a [num_blocks, block_size * Hkv * D] view), whose
    copy is already in [B, S, Hkv, D] order, and only the stale slots are written: on a CPU this path is the
    engine's decode attention, where a permuting copy and a masked pass over the context cost more than SDPA."""
    num_seqs = meta.num_seqs
    num_cache_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    max_len = meta.max_seq_len
    num_blocks = -(-max_len // block_size)
    blocks = meta.block_tables[:, :num_blocks].reshape(-1).long()
    out_dtype = dtype or (torch.float32 if is_fp8(kv_cache.dtype) else kv_cache.dtype)
    slots = torch.arange(num_blocks * block_size, device=kv_cache.device)
    stale = (slots[None, :] >= meta.seq_lens.long()[:, None]).view(-1).nonzero().squeeze(1)
    rows = kv_cache.view(num_cache_blocks, 2, block_size * num_kv_heads * head_dim)
    out = []
    for i, scale in ((0, k_scale), (1, v_scale)):
        x = rows[:, i].index_select(0, blocks)  # a copy: the in-place fill below never touches the cache
        x = dequantize_kv(x, scale, out_dtype) if is_fp8(x.dtype) else x.to(out_dtype)
        x = x.view(num_seqs * num_blocks * block_size, num_kv_heads * head_dim).index_fill_(0, stale, 0)
        out.append(x.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len].transpose(1, 2))
    return out[0], out[1]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context plus the new tokens up to
    itself; query [T, Hq, D] (Hq a multiple of Hkv: GQA) -> [T, Hq, D] in query's dtype.

    The new tokens' K/V must already be in kv_cache (store_kv first), which lets one code path serve
    prefill, chunked prefill over a cached prefix, and decode alike.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = meta.num_seqs
    max_q = meta.max_query_len
    one_each = max_q == 1 and num_tokens == num_seqs  # a decode batch: the rows are the sequences already
    if one_each:
        q = query.unsqueeze(1).transpose(1, 2)  # [B, Hq, 1, D]
    else:
        seq_idx, pos_in_query = _token_coordinates(meta, num_tokens)
        q = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q[seq_idx, pos_in_query] = query
        q = q.transpose(1, 2)  # [B, Hq, Lq, D]

    k, v = gather_kv(kv_cache, meta, query.dtype, k_scale, v_scale)  # [B, Hkv, S, D]

    seq_lens = meta.seq_lens.long()
    qsl = meta.query_start_loc.long()
    cached_lens = seq_lens - (qsl[1:] - qsl[:-1])  # [B] context before this step's tokens
    # New token i of sequence b sits at absolute position cached_b + i and sees keys at <= that position.
    last_visible = cached_lens[:, None] + torch.arange(max_q, device=query.device)[None, :]  # [B, Lq]
    key_pos = torch.arange(meta.max_seq_len, device=query.device)
    mask = key_pos[None, None, :] <= last_visible[:, :, None]  # [B, Lq, S]; padded rows still see key 0

    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads != k.shape[1]
    )  # [B, Hq, Lq, D]
    if one_each:
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
    return out.transpose(1, 2)[seq_idx, pos_in_query]
