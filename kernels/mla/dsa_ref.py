"""DeepSeek Sparse Attention's lightning indexer, the torch reference (DeepSeek-V3.2, GLM-5): which cached positions
each query's MLA attends to.

Each token writes one indexer key (index_head_dim, LayerNorm'd and roped) into its row of the layer's paged cache,
after the latent (models/deepseek_v3_mla.py: the row is [c_kv | k_pe | index key | its scale]). An FP8 cache keeps
the key in e4m3 over a float32 scale of its own (its largest magnitude / 448, as DeepSeek's FP8 indexer and vLLM
keep it), in the row's last four bytes; a 16- or 32-bit cache keeps the key as it is and leaves those columns
unused. A query's score of a cached position s is sum_h w_h * ReLU(scale * q_h . k_s) over the indexer's heads (w
from the hidden state); the query attends to the `topk` best-scored positions at or before its own (all of them
while there are fewer). The result is their list per token, int32 [T, min(topk, S)] (-1 where fewer are visible),
which paged_mla (torch_ref) and the triton backend's sparse kernel (dsa_triton) read. transformers computes the same
in float32, skipping DeepSeek's FP8 scoring and Hadamard rotation (an orthogonal transform leaves the dot products as they are).
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX, is_fp8
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.mla.torch_ref import gather_latent

SCALE_COLUMNS = 4
"""Cache columns after an indexer key that hold its float32 scale in an FP8 cache (the row's last four)."""


def index_part_width(latent_width: int, head_dim: int) -> int:
    """Columns of a cache row's indexer part after a latent of latent_width: the key, padding that keeps the scale
    4-byte aligned, the scale."""
    return head_dim + (-(latent_width + head_dim)) % SCALE_COLUMNS + SCALE_COLUMNS


def key_scales(index_cache: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """float32 [num_blocks, block_size, 1]: the scales of an FP8 index cache's keys, a view of its last four columns;
    None for a cache of another dtype, whose keys are stored unscaled. index_cache: the rows' indexer part."""
    if not is_fp8(index_cache.dtype):
        return None
    if index_cache.shape[-1] < head_dim + SCALE_COLUMNS:
        raise ValueError(f"an FP8 index cache needs {SCALE_COLUMNS} columns after each {head_dim}-wide key for its "
                         f"scale; its rows' indexer part is {index_cache.shape[-1]} wide")
    return index_cache[..., -SCALE_COLUMNS:].view(torch.float32)


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [T, D] / scale clamped to e4m3's range, float32; scale [T, 1] = each key's largest magnitude / 448)."""
    keys = keys.float()
    scale = keys.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_KV_MAX
    return (keys / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX), scale


def store_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' indexer keys [T, D] into index_cache [num_blocks, block_size, >= D] (the indexer part of
    the layer's cache rows; an FP8 one's with its keys' scales) at slot_mapping [T] (-1 = padding, not stored)."""
    block_size, dim = index_cache.shape[1], keys.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    keys = keys[keep]
    scales = key_scales(index_cache, dim)
    if scales is not None:
        keys, scales[blocks, offsets] = quantize_keys(keys)
    index_cache[blocks, offsets, :dim] = keys.to(index_cache.dtype)


def select_positions(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
                     topk: int, scale: float) -> torch.Tensor:
    """int32 [T, min(topk, max_seq_len)]: the positions each new token attends to, -1 where fewer are visible.
    q [T, H, D] and the head weights [T, H] are the new tokens' (their keys stored already); index_cache as
    store_index_keys' (an FP8 one's keys dequantized with their scales)."""
    num_tokens = q.shape[0]
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    qsl = meta.query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=qsl.device), query_lens, output_size=num_tokens)
    pos_in_query = torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]
    qb = q.new_zeros(num_seqs, max_q, *q.shape[1:], dtype=torch.float32)
    qb[seq_idx, pos_in_query] = q.float()
    wb = weights.new_zeros(num_seqs, max_q, weights.shape[1], dtype=torch.float32)
    wb[seq_idx, pos_in_query] = weights.float()
    dim = q.shape[-1]
    keys = gather_latent(index_cache[..., :dim], meta, torch.float32)  # [B, S, D], zero past each sequence's length
    scales = key_scales(index_cache, dim)
    if scales is not None:
        keys = keys * gather_latent(scales, meta, torch.float32)
    scores = torch.relu(torch.einsum("bqhd,bsd->bqhs", qb, keys) * scale)
    scores = torch.einsum("bqhs,bqh->bqs", scores, wb)
    cached_lens = meta.seq_lens.long() - query_lens
    last_visible = cached_lens[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, Lq]
    visible = torch.arange(meta.max_seq_len, device=q.device)[None, None, :] <= last_visible[:, :, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    best, where = scores.topk(min(topk, meta.max_seq_len), dim=-1)  # [B, Lq, K]
    chosen = torch.where(best == float("-inf"), -1, where)
    return chosen[seq_idx, pos_in_query].to(torch.int32)


def selection_mask(select: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """bool [B, max_query_len, max_seq_len]: select_positions' lists as the mask paged_mla applies."""
    num_tokens = select.shape[0]
    qsl = meta.query_start_loc.long()
    seq_idx = torch.repeat_interleave(torch.arange(meta.num_seqs, device=qsl.device), qsl[1:] - qsl[:-1],
                                      output_size=num_tokens)
    pos_in_query = torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]
    width = meta.max_seq_len
    rows = torch.zeros(num_tokens, width + 1, dtype=torch.bool, device=select.device)  # column `width`: the -1s
    rows.scatter_(1, torch.where(select < 0, width, select.long()), True)
    mask = torch.zeros(meta.num_seqs, meta.max_query_len, width, dtype=torch.bool, device=select.device)
    mask[seq_idx, pos_in_query] = rows[:, :width]
    return mask
