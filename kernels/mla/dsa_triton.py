"""DeepSeek Sparse Attention in triton (DeepSeek-V3.2, GLM-5): the lightning indexer's scores, the top-k choice
and sparse MLA over the chosen positions, for the "triton" MLA backend (kernels/mla/dsa_ref.py is the oracle).

- index_logits: program (token, tile of BLOCK_N context positions): the tile's indexer keys are read once through
  the block table and scored against all the token's indexer heads, logit = sum_h w_h * ReLU(scale * q_h . k);
  positions after the token's own (causal) or past its sequence score -inf.
- select_topk: torch.topk over those logits, a fixed [T, min(topk, S)] answer with -1 where fewer positions are
  visible; rows are scored in bounded slices, so a long prefill never holds T x S logits at once.
- sparse_mla: program (token, tile of BLOCK_H heads, split of the token's index list): the online softmax of
  triton_mla's kernels over the rows the indices name (one cache row per index, gathered through the block table),
  so prefill chunks, decodes and verify steps are one kernel and the work per token is bounded by topk, not by
  the context. Small batches split the index list to fill the GPU; the splits merge by log-sum-exp.

Every shape depends on the host's ints only (no device-to-host read), so decode steps can replay in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX, is_fp8
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.mla.dsa_ref import key_scales
from flotilla.kernels.mla.triton_mla import _check, _head_queries, _mla_tile
from flotilla.kernels.triton.attention import _LOG2E, _MIN_DOT, _dot_precision, _pages
from flotilla.kernels.triton.list_splits import NO_SCORE, merge_splits, plan_splits

LOGITS_BYTES = 256 << 20
"""Most bytes of indexer logits held at once: rows are scored and reduced to their top-k in slices of this size."""
_MIN_INDICES_PER_SPLIT = 256


def token_sequences(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """int32 [num_tokens]: each new token's sequence (row of the block table), from query_start_loc on the device."""
    tokens = torch.arange(num_tokens, device=meta.query_start_loc.device, dtype=meta.query_start_loc.dtype)
    seq = torch.searchsorted(meta.query_start_loc[1:].contiguous(), tokens, right=True)
    return seq.clamp_(max=max(meta.num_seqs - 1, 0)).to(torch.int32)


@triton.jit
def _store_rows_kernel(row_ptr, cache_ptr, slot_ptr, stride_rt, stride_cb, stride_cs, width, block_size,
                       BLOCK_D: tl.constexpr):  # fmt: skip
    """One program per new token: its row into its cache slot, or nothing for slot -1."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_D)
    row = tl.load(row_ptr + token * stride_rt + offs, mask=offs < width)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + offs
    tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=offs < width)


@triton.jit
def _store_fp8_keys_kernel(key_ptr, cache_ptr, scale_ptr, slot_ptr, stride_kt, stride_cb, stride_cs, stride_sb,
                           stride_ss, head_dim, block_size, FP8_MAX: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """One program per new token: its key / its scale in e4m3 into its cache slot and the scale (largest magnitude /
    FP8_MAX) beside it; nothing for slot -1."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_D)
    key = tl.load(key_ptr + token * stride_kt + offs, mask=offs < head_dim, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(key), 0), 1e-10) / FP8_MAX
    quantized = tl.minimum(tl.maximum(key / scale, -FP8_MAX), FP8_MAX)
    block, at = slot // block_size, slot % block_size
    tl.store(cache_ptr + block * stride_cb + at * stride_cs + offs, quantized.to(cache_ptr.dtype.element_ty),
             mask=offs < head_dim)
    tl.store(scale_ptr + block * stride_sb + at * stride_ss, scale)


def store_index_keys(keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """dsa_ref.store_index_keys in one launch (no host sync): the keys [T, D] into the rows' indexer part, an FP8
    cache's quantized over a scale per key."""
    scales = key_scales(index_cache, keys.shape[-1])
    if scales is None:
        store_rows(keys, index_cache, slot_mapping)
        return
    num_tokens, head_dim = keys.shape
    if num_tokens == 0:
        return
    if keys.stride(-1) != 1 or index_cache.stride(-1) != 1:
        raise ValueError("keys and index_cache need a contiguous last dim")
    _store_fp8_keys_kernel[(num_tokens,)](
        keys, index_cache, scales, slot_mapping, keys.stride(0), index_cache.stride(0), index_cache.stride(1),
        scales.stride(0), scales.stride(1), head_dim, index_cache.shape[1], FP8_MAX=FP8_KV_MAX,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each new token's row [T, D] into the cache view `cache` [num_blocks, block_size, D] (any row stride) at its
    slot (-1 = not stored), in one launch: no host sync, so decode steps can replay it in a CUDA graph. The indexer's
    keys (dsa_ref.store_index_keys' job) and DeepSeek-V4's whole cache rows are stored with it."""
    num_tokens, width = rows.shape
    if num_tokens == 0:
        return
    if rows.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("rows and cache need a contiguous last dim")
    _store_rows_kernel[(num_tokens,)](
        rows, cache, slot_mapping, rows.stride(0), cache.stride(0), cache.stride(1), width, cache.shape[1],
        BLOCK_D=triton.next_power_of_2(width),
    )  # fmt: skip


@triton.jit
def _index_logits_kernel(
    q_ptr, w_ptr, cache_ptr, key_scale_ptr, out_ptr, seq_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, scale, first_token,
    num_heads, head_dim, width, rate, stride_qt, stride_qh, stride_wt, stride_ot, stride_bt, stride_cb, stride_cs,
    stride_sb, stride_ss, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, KEY_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (row, key tile): row r of the slice is token first_token + r; its logits over the tile's keys, -inf
    where it cannot attend. Key i sits at position i * rate + rate - 1 (rate 1: every position). KEY_SCALES: each
    key is stored over its own scale (an FP8 cache)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    token = first_token + row
    seq = tl.load(seq_ptr + token).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    last = seq_len - tl.load(qsl_ptr + seq + 1) + token  # the token's own position: it sees keys up to there
    key = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = key * rate + rate - 1
    visible = (pos <= last) & (pos < seq_len)
    logits = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if tile * BLOCK_N * rate + rate - 1 <= last:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        page = _pages(bt_ptr + seq * stride_bt, pos, visible, PAGE_SIZE)
        rows = page * stride_cb + (pos % PAGE_SIZE).to(tl.int64) * stride_cs
        keys = tl.load(cache_ptr + rows[None, :] + offs_d[:, None], mask=mask_d[:, None] & visible[None, :],
                       other=0.0)  # [D, N]
        key_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        if KEY_SCALES:
            key_scale = tl.load(key_scale_ptr + page * stride_sb + (pos % PAGE_SIZE).to(tl.int64) * stride_ss,
                                mask=visible, other=0.0)
        total = tl.zeros([BLOCK_N], tl.float32)
        for h0 in range(0, num_heads, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            mask_h = heads < num_heads
            q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + token * stride_wt + heads, mask=mask_h, other=0.0)
            s = tl.dot(q, keys.to(q.dtype), input_precision=DOT_PRECISION) * (scale * key_scale)[None, :]  # [H, N]
            total += tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        logits = tl.where(visible, total, float("-inf"))
    tl.store(out_ptr + row * stride_ot + key, logits, mask=key < width)


def index_logits(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, *, rate: int = 1, seq: torch.Tensor | None = None, first: int = 0,
                 count: int | None = None, block_n: int = 64) -> torch.Tensor:
    """float32 [count, meta.max_seq_len // rate]: the indexer's logits of tokens first..first+count-1 (default: all)
    over their sequences' cached keys, -inf where a token cannot attend. q [T, H, D], weights [T, H] (float32);
    index_cache [num_blocks, block_size, >= D] (the indexer part of the cache rows: any row stride, the key's D values
    first and contiguous; an FP8 one's with its keys' scales, dsa_ref.key_scales). rate: key i is the one in the row
    of position i * rate + rate - 1 (DeepSeek-V4's compressed entries, one per window of rate tokens, in the row of
    the window's last token); 1: a key per position."""
    num_tokens, num_heads, head_dim = q.shape
    count = num_tokens - first if count is None else count
    if first < 0 or count < 0 or first + count > num_tokens:
        raise ValueError(f"tokens {first}..{first + count - 1} are not among the step's {num_tokens}")
    width = meta.max_seq_len // rate
    out = torch.empty(count, width, dtype=torch.float32, device=q.device)
    if count == 0 or width == 0:
        return out
    if q.stride(-1) != 1 or index_cache.stride(-1) != 1 or index_cache.shape[-1] < head_dim:
        raise ValueError(f"index_cache {tuple(index_cache.shape)} rows must begin with {head_dim} contiguous values, "
                         "as q's")
    scales = key_scales(index_cache, head_dim)
    seq = token_sequences(meta, num_tokens) if seq is None else seq
    weights = weights.float()
    block_n = max(_MIN_DOT, block_n)
    _index_logits_kernel[(count, triton.cdiv(width, block_n))](
        q, weights, index_cache, index_cache if scales is None else scales, out, seq, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, float(scale), first, num_heads, head_dim, width, rate, q.stride(0),
        q.stride(1), weights.stride(0), out.stride(0), meta.block_tables.stride(0), index_cache.stride(0),
        index_cache.stride(1), 0 if scales is None else scales.stride(0), 0 if scales is None else scales.stride(1),
        PAGE_SIZE=index_cache.shape[1], BLOCK_H=max(_MIN_DOT, min(64, triton.next_power_of_2(num_heads))),
        BLOCK_N=block_n, BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)), KEY_SCALES=scales is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    return out


def select_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
                topk: int, scale: float, *, rate: int = 1, logits_bytes: int = LOGITS_BYTES) -> torch.Tensor:
    """int32 [T, min(topk, max_seq_len // rate)]: the keys each new token attends to (positions, or with `rate` the
    index_logits key numbers; dsa_ref.select_positions' set), -1 where fewer are visible. The tokens' keys must be
    stored already (store_index_keys)."""
    num_tokens = q.shape[0]
    width = meta.max_seq_len // rate
    k = min(topk, width)
    chosen = torch.full((num_tokens, k), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0 or k == 0:
        return chosen
    seq = token_sequences(meta, num_tokens)
    rows = max(1, logits_bytes // (4 * width))
    for first in range(0, num_tokens, rows):
        count = min(rows, num_tokens - first)
        logits = index_logits(q, weights, index_cache, meta, scale, rate=rate, seq=seq, first=first, count=count)
        best, where = logits.topk(k, dim=-1, sorted=False)
        chosen[first:first + count] = torch.where(best == float("-inf"), -1, where).to(torch.int32)
    return chosen


@triton.jit
def _sparse_mla_kernel(
    qn_ptr, qp_ptr, cache_ptr, idx_ptr, seq_ptr, bt_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    sm_scale_log2, kv_scale, num_heads, kv_lora_rank, rope_dim, num_indices, per_split,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_it, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (token, head tile, split): BLOCK_H heads of one token over the split's share of its index list
    (-1 entries skipped). One split writes the output; several write their normalized partials and log2-sum-exp
    (-inf for a split without a valid index), merged by list_splits.merge_splits."""
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ptr + token).to(tl.int64)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    qn, qp, offs_l, mask_l, offs_r, mask_r = _head_queries(
        qn_ptr, qp_ptr, token, heads, mask_h, kv_lora_rank, rope_dim, stride_qnt, stride_qnh, stride_qpt, stride_qph,
        BLOCK_L, BLOCK_R)  # fmt: skip
    m_i = tl.full([BLOCK_H], NO_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row_ptr = bt_ptr + seq * stride_bt
    start = split * per_split
    end = tl.minimum(start + per_split, num_indices)
    for tile_start in range(start, end, BLOCK_N):
        j = tile_start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + token * stride_it + j, mask=j < end, other=-1)
        valid = idx >= 0
        acc, m_i, l_i = _mla_tile(qn, qp, acc, m_i, l_i, cache_ptr, bt_row_ptr, tl.where(valid, idx, 0), valid,
                                  valid[None, :], offs_l, mask_l, offs_r, mask_r, kv_lora_rank, sm_scale_log2,
                                  stride_cb, stride_cs, PAGE_SIZE, DOT_PRECISION)  # fmt: skip
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = mask_h[:, None] & mask_l[None, :]
    if DIRECT_OUT:
        dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_l[None, :]
        tl.store(dst, (out * kv_scale).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # part_* are [T, H, splits(, L)]
        part = (token * num_heads + heads) * tl.num_programs(2) + split
        tl.store(part_o_ptr + part[:, None] * kv_lora_rank + offs_l[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
                 mask=mask_h)


def sparse_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scale: float, indices: torch.Tensor, *, num_splits: int | None = None,
               block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """MLA of each new token over the cache rows at its `indices` (int32 [T, K] positions in its sequence, -1 =
    none; select_topk's): q_latent [T, H, kv_lora_rank], q_pe [T, H, rope_dim] -> [T, H, kv_lora_rank]
    (torch_ref.paged_mla with `select`). The new tokens must be stored already; kv_scale dequantizes an FP8 cache."""
    num_tokens, num_heads, kv_lora_rank, rope_dim = _check(q_latent, q_pe, kv_cache)
    out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out
    if indices.shape[0] != num_tokens or indices.stride(-1) != 1:
        raise ValueError(f"indices {tuple(indices.shape)} must give each of the {num_tokens} tokens a contiguous row")
    num_indices = indices.shape[1]
    block_h = max(_MIN_DOT, min(block_h, triton.next_power_of_2(num_heads)))
    block_n = max(_MIN_DOT, block_n)
    head_tiles = triton.cdiv(num_heads, block_h)
    plan = plan_splits(out, num_indices, head_tiles, block_n, num_splits, _MIN_INDICES_PER_SPLIT)
    kv_scale = float(kv_scale) if is_fp8(kv_cache.dtype) else 1.0
    _sparse_mla_kernel[(num_tokens, head_tiles, plan.splits)](
        q_latent, q_pe, kv_cache, indices, token_sequences(meta, num_tokens), meta.block_tables, out, plan.part_o,
        plan.part_lse, scale * kv_scale * _LOG2E, kv_scale, num_heads, kv_lora_rank, rope_dim, num_indices,
        plan.per_split,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), indices.stride(0), out.stride(0),
        out.stride(1), meta.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=max(_MIN_DOT, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(rope_dim)), DIRECT_OUT=plan.splits == 1,
        DOT_PRECISION=_dot_precision(q_latent.dtype),
    )  # fmt: skip
    if plan.splits > 1:
        out.copy_(merge_splits(plan.part_o, plan.part_lse) * kv_scale)
    return out
