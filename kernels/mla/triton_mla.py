"""Triton MLA over the paged latent cache: the "triton" MLA backend (decode kernel, cache store).

With the key projection absorbed into the query (models/deepseek_v3_mla.py), decode attention is multi-query over
one cache "head" per token: row = [c_kv (kv_lora_rank) || k_pe (rope_dim)], keys are whole rows, values their
first kv_lora_rank entries (kernels/mla/torch_ref.py is the oracle). Flash-decoding, as the GQA kernel in
kernels/triton/attention.py: a program owns (sequence, tile of BLOCK_H query heads, split of the context), so
each row of the context is read once per head tile; the score is q_latent . c_kv + q_pe . k_pe (two dots, no
padding of 576 to 1024); long contexts are cut into splits merged by log-sum-exp in a second launch, the GQA
kernel's merge (kernels/triton/attention.py _decode_merge_kernel). Tokens are gathered through
the block table one by one (page = table[pos // block_size]), so any block size works with any tile. An FP8 (e4m3)
cache is converted on load, kv_scale folded into the softmax scale and the output.

Prefill and mixed steps (several new tokens per sequence) run a causal flash-attention kernel whose rows are
(new token, head) pairs of one sequence, so a tile of keys serves BLOCK_M rows; the store is one program per
new token (no host sync, so it can sit in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX, is_fp8
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.triton.attention import (
    _LOG2E,
    _MIN_DOT,
    _decode_merge_kernel,
    _decode_num_splits,
    _dot_precision,
    _finish_decode,
    _pages,
    _split_range,
    merge_chunk,
)

FP8_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def _store_latent_kernel(c_ptr, pe_ptr, cache_ptr, slot_ptr, stride_ct, stride_pt, stride_cb, stride_cs,
                         kv_lora_rank, rope_dim, block_size, kv_scale,
                         BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """One program per new token: its cache row c_kv || k_pe, or nothing for slot -1; QUANT: / kv_scale."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(c_ptr + token * stride_ct + offs_l, mask=offs_l < kv_lora_rank).to(tl.float32)
    pe = tl.load(pe_ptr + token * stride_pt + offs_r, mask=offs_r < rope_dim).to(tl.float32)
    if QUANT:
        c = tl.clamp(c / kv_scale, -FP8_MAX, FP8_MAX)
        pe = tl.clamp(pe / kv_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < kv_lora_rank)
    tl.store(dst + kv_lora_rank + offs_r, pe.to(cache_ptr.dtype.element_ty), mask=offs_r < rope_dim)


@triton.jit
def _mla_tile(
    qn, qp, acc, m_i, l_i, cache_ptr, bt_row_ptr, pos, in_range, score_mask, offs_l, mask_l, offs_r, mask_r,
    kv_lora_rank, sm_scale_log2, stride_cb, stride_cs, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of the query rows (qn [M, L], qp [M, R]) over the cache rows at context positions
    pos [N] (gathered through the block table), scores masked by score_mask [M, N]; returns (acc, m_i, l_i).
    Callers make every row see a key in its first tile, so the running max is finite from then on."""
    page = _pages(bt_row_ptr, pos, in_range, PAGE_SIZE)
    row = page * stride_cb + (pos % PAGE_SIZE).to(tl.int64) * stride_cs
    # keys transposed ([D, N]) for the score dots; the latent part again as [N, D] for the value dot
    kl = tl.load(cache_ptr + row[None, :] + offs_l[:, None], mask=mask_l[:, None] & in_range[None, :], other=0.0)
    kp = tl.load(cache_ptr + row[None, :] + kv_lora_rank + offs_r[:, None],
                 mask=mask_r[:, None] & in_range[None, :], other=0.0)  # fmt: skip
    qk = tl.dot(qn, kl.to(qn.dtype), input_precision=DOT_PRECISION)
    qk += tl.dot(qp, kp.to(qp.dtype), input_precision=DOT_PRECISION)
    qk = tl.where(score_mask, qk * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(cache_ptr + row[:, None] + offs_l[None, :], mask=in_range[:, None] & mask_l[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(qn.dtype), v.to(qn.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _head_queries(
    qn_ptr, qp_ptr, token, heads, mask_h, kv_lora_rank, rope_dim, stride_qnt, stride_qnh, stride_qpt, stride_qph,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One token's query rows for `heads`: (qn [H, BLOCK_L], qp [H, BLOCK_R], offs_l, mask_l, offs_r, mask_r)."""
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < kv_lora_rank
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    qn = tl.load(qn_ptr + token * stride_qnt + heads[:, None] * stride_qnh + offs_l[None, :],
                 mask=mask_h[:, None] & mask_l[None, :], other=0.0)  # fmt: skip
    qp = tl.load(qp_ptr + token * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :],
                 mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
    return qn, qp, offs_l, mask_l, offs_r, mask_r


@triton.jit
def _mla_decode_kernel(
    qn_ptr, qp_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, kv_scale, num_splits, num_heads, kv_lora_rank, rope_dim,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (sequence, head tile, split): BLOCK_H query heads over this split's share of the context; one
    split writes the output, several write normalized partials and their log2-sum-exp, which _decode_merge_kernel
    merges."""
    seq = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    token, start, end, single = _split_range(qsl_ptr, seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    qn, qp, offs_l, mask_l, offs_r, mask_r = _head_queries(
        qn_ptr, qp_ptr, token, heads, mask_h, kv_lora_rank, rope_dim, stride_qnt, stride_qnh, stride_qpt, stride_qph,
        BLOCK_L, BLOCK_R)  # fmt: skip
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        in_range = pos < end
        acc, m_i, l_i = _mla_tile(qn, qp, acc, m_i, l_i, cache_ptr, bt_row_ptr, pos, in_range, in_range[None, :],
                                  offs_l, mask_l, offs_r, mask_r, kv_lora_rank, sm_scale_log2, stride_cb, stride_cs,
                                  PAGE_SIZE, DOT_PRECISION)  # fmt: skip

    _finish_decode(acc, m_i, l_i, kv_scale, out_ptr, part_o_ptr, part_lse_ptr, seq, token, split, heads, mask_h,
                   offs_l, mask_l, kv_lora_rank, num_heads, num_splits, stride_ot, stride_oh, single,
                   DIRECT_OUT)  # fmt: skip


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, kv_scale, num_heads, kv_lora_rank, rope_dim,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (sequence, tile of BLOCK_M (new token, head) rows): flash attention of those rows over the
    sequence's cached context and its own earlier new tokens (causal), keys read once per tile."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * num_heads:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < q_len * num_heads
    token = rows // num_heads  # the row's new token (0-based within this sequence's query)
    head = rows % num_heads
    tok = (q_start + token).to(tl.int64)
    last_key = cached + token  # causal: a new token sees keys up to its own position
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < kv_lora_rank
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rope_dim
    qn = tl.load(qn_ptr + tok[:, None] * stride_qnt + head[:, None] * stride_qnh + offs_l[None, :],
                 mask=mask_m[:, None] & mask_l[None, :], other=0.0)  # fmt: skip
    qp = tl.load(qp_ptr + tok[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
                 mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    end = tl.minimum(cached + (tile * BLOCK_M + BLOCK_M - 1) // num_heads + 1, seq_len)  # the tile's last key + 1
    for tile_start in range(0, end, BLOCK_N):
        pos = tile_start + offs_n
        in_range = pos < end
        visible = (pos[None, :] <= last_key[:, None]) & in_range[None, :]  # every row sees key 0 in the first tile
        acc, m_i, l_i = _mla_tile(qn, qp, acc, m_i, l_i, cache_ptr, bt_row_ptr, pos, in_range, visible,
                                  offs_l, mask_l, offs_r, mask_r, kv_lora_rank, sm_scale_log2, stride_cb, stride_cs,
                                  PAGE_SIZE, DOT_PRECISION)  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * kv_scale
    dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_l[None, :])


def store_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: float = 1.0) -> None:
    """torch_ref.store_latent in one launch: c_kv [T, kv_lora_rank] || k_pe [T, rope_dim] into kv_cache
    [num_blocks, block_size, kv_lora_rank + rope_dim] at slot_mapping (-1 = padding, not stored)."""
    num_tokens, kv_lora_rank = c_kv.shape
    rope_dim = k_pe.shape[-1]
    if kv_cache.shape[-1] != kv_lora_rank + rope_dim or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} rows are not {kv_lora_rank} + {rope_dim} contiguous values")
    if num_tokens == 0:
        return
    if c_kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("c_kv and k_pe need a contiguous last dim")
    _store_latent_kernel[(num_tokens,)](
        c_kv, k_pe, kv_cache, slot_mapping, c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_lora_rank, rope_dim, kv_cache.shape[1], float(kv_scale),
        BLOCK_L=triton.next_power_of_2(kv_lora_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
        QUANT=is_fp8(kv_cache.dtype),
    )  # fmt: skip


def _check(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, kv_lora_rank, rope_dim) of a step's queries, checked against the cache's rows."""
    num_tokens, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    if kv_cache.shape[-1] != kv_lora_rank + rope_dim or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} rows are not {kv_lora_rank} + {rope_dim} contiguous values")
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("q_latent and q_pe need a contiguous last dim")
    return num_tokens, num_heads, kv_lora_rank, rope_dim


def paged_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, kv_scale: float = 1.0, *, num_splits: int | None = None,
                     block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """One new token per sequence: q_latent [T, H, kv_lora_rank], q_pe [T, H, rope_dim] -> [T, H, kv_lora_rank]
    (torch_ref.paged_mla for max_query_len == 1). num_splits (default: sized to fill the GPU) may be fixed, e.g.
    for a CUDA graph; any value is correct for any seq_lens."""
    if meta.max_query_len > 1:
        raise ValueError(f"MLA decode takes one new token per sequence, not up to {meta.max_query_len}")
    num_tokens, num_heads, kv_lora_rank, rope_dim = _check(q_latent, q_pe, kv_cache)
    out = torch.empty_like(q_latent)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_h = max(_MIN_DOT, min(block_h, triton.next_power_of_2(num_heads)))
    head_tiles = triton.cdiv(num_heads, block_h)
    splits = num_splits if num_splits is not None else _decode_num_splits(num_seqs, head_tiles, meta.max_seq_len)
    block_l = max(_MIN_DOT, triton.next_power_of_2(kv_lora_rank))
    if splits > 1:
        part_o = torch.empty(num_seqs, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q_latent.device)
    else:  # unused (DIRECT_OUT), but the kernel needs pointers
        part_o = part_lse = out
    kv_scale = float(kv_scale) if is_fp8(kv_cache.dtype) else 1.0
    block_s = triton.next_power_of_2(splits)
    _mla_decode_kernel[(num_seqs, head_tiles, splits)](
        q_latent, q_pe, kv_cache, out, part_o, part_lse, meta.query_start_loc, meta.seq_lens,
        meta.block_tables, scale * kv_scale * _LOG2E, kv_scale, splits, num_heads, kv_lora_rank, rope_dim,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=max(_MIN_DOT, block_n), BLOCK_L=block_l,
        BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(rope_dim)), DIRECT_OUT=splits == 1,
        DOT_PRECISION=_dot_precision(q_latent.dtype),
    )  # fmt: skip
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, meta.query_start_loc, meta.seq_lens, splits, num_heads, kv_lora_rank, out.stride(0),
            out.stride(1), BLOCK_S=block_s, BLOCK_D=block_l, CHUNK_S=merge_chunk(block_s, block_l),
            BLOCK_N=max(_MIN_DOT, block_n),
        )  # fmt: skip
    return out


def paged_mla_prefill(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, kv_scale: float = 1.0, *, block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """Any number of new tokens per sequence (prefill chunks over a cached prefix, decodes, mixed): q_latent
    [T, H, kv_lora_rank], q_pe [T, H, rope_dim] -> [T, H, kv_lora_rank], causal (torch_ref.paged_mla)."""
    num_tokens, num_heads, kv_lora_rank, rope_dim = _check(q_latent, q_pe, kv_cache)
    out = torch.empty_like(q_latent)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(_MIN_DOT, block_m)
    tiles = triton.cdiv(meta.max_query_len * num_heads, block_m)
    kv_scale = float(kv_scale) if is_fp8(kv_cache.dtype) else 1.0
    _mla_prefill_kernel[(num_seqs, tiles)](
        q_latent, q_pe, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * kv_scale * _LOG2E, kv_scale, num_heads, kv_lora_rank, rope_dim,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_M=block_m, BLOCK_N=max(_MIN_DOT, block_n),
        BLOCK_L=max(_MIN_DOT, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(rope_dim)), DOT_PRECISION=_dot_precision(q_latent.dtype),
    )  # fmt: skip
    return out


def paged_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_scale: float = 1.0, select: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's forward: sparse attention over `select`'s positions (dsa_triton.sparse_mla) when given, else
    the split-context decode kernel when every sequence has one new token, the causal prefill kernel otherwise."""
    if select is not None:
        from flotilla.kernels.mla.dsa_triton import sparse_mla  # (it builds on this module's tile)

        return sparse_mla(q_latent, q_pe, kv_cache, meta, scale, kv_scale, select)
    if meta.max_query_len == 1:
        return paged_mla_decode(q_latent, q_pe, kv_cache, meta, scale, kv_scale)
    return paged_mla_prefill(q_latent, q_pe, kv_cache, meta, scale, kv_scale)
