"""Attention of each token over a list of cached vectors, with learned sinks: DeepSeek-V4's attention (one key-value
head, K = V, a sliding window of raw tokens plus compressed entries, per-head sink logits in the softmax's
denominator).

A token's keys are named by element offsets into the flat cache (-1 = none), so one kernel reads window rows and
entries wherever their columns sit in a row, for prefill chunks and decodes alike, and the work per token is bounded
by its list, not by the context. Program (token, tile of BLOCK_H heads, split of the list): an online softmax whose
keys are loaded once per tile for the score and the value dots. With one split the sink joins the denominator in
the kernel; with several, the splits' partials merge with the sink as one more term (list_splits.merge_splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.triton.attention import _LOG2E, _MIN_DOT, _dot_precision
from flotilla.kernels.triton.list_splits import NO_SCORE, merge_splits, plan_splits

_MIN_KEYS_PER_SPLIT = 128


@triton.jit
def _sink_attention_kernel(
    q_ptr, cache_ptr, off_ptr, sink_ptr, out_ptr, part_o_ptr, part_lse_ptr, sm_scale_log2, num_heads, head_dim,
    num_keys, per_split, stride_qt, stride_qh, stride_ft, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_H], NO_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    start = split * per_split
    end = tl.minimum(start + per_split, num_keys)
    for tile_start in range(start, end, BLOCK_N):
        j = tile_start + tl.arange(0, BLOCK_N)
        off = tl.load(off_ptr + token * stride_ft + j, mask=j < end, other=-1)
        valid = off >= 0
        keys = tl.load(cache_ptr + tl.where(valid, off, 0)[:, None] + offs_d[None, :],
                       mask=valid[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [N, D]: keys and values
        s = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * sm_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), keys, input_precision=DOT_PRECISION)
        m_i = m_new
    out_mask = mask_h[:, None] & mask_d[None, :]
    if DIRECT_OUT:  # the sink: one more logit in the denominator, no value
        sink = tl.load(sink_ptr + heads, mask=mask_h, other=0.0) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        scale = tl.exp2(m_i - top)
        out = acc * (scale / (l_i * scale + tl.exp2(sink - top)))[:, None]
        dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # part_* are [T, H, splits(, D)]
        empty = l_i == 0.0
        part = (token * num_heads + heads) * tl.num_programs(2) + split
        tl.store(part_o_ptr + part[:, None] * head_dim + offs_d[None, :],
                 acc / tl.where(empty, 1.0, l_i)[:, None], mask=out_mask)  # fmt: skip
        tl.store(part_lse_ptr + part, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
                 mask=mask_h)


def sink_attention(q: torch.Tensor, cache: torch.Tensor, offsets: torch.Tensor, sinks: torch.Tensor, scale: float, *,
                   num_splits: int | None = None, block_h: int = 16, block_n: int = 32) -> torch.Tensor:
    """softmax([q . k_j * scale for each listed key j] + [sink]) over the keys, times the keys (K = V): q [T, H, D],
    cache a flat view of the cached rows (any dtype), offsets int64 [T, K] where each key's D values start in it
    (-1 = none), sinks [H] (float32 logits) -> [T, H, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if offsets.shape[0] != num_tokens or offsets.stride(-1) != 1 or q.stride(-1) != 1 or cache.dim() != 1:
        raise ValueError(f"offsets {tuple(offsets.shape)} need a contiguous row per token of q {tuple(q.shape)}, "
                         "and the cache a flat view")
    num_keys = offsets.shape[1]
    block_h = max(_MIN_DOT, min(block_h, triton.next_power_of_2(num_heads)))
    block_n = max(_MIN_DOT, block_n)
    head_tiles = triton.cdiv(num_heads, block_h)
    plan = plan_splits(out, num_keys, head_tiles, block_n, num_splits, _MIN_KEYS_PER_SPLIT)
    sinks = sinks.detach().float().contiguous()
    _sink_attention_kernel[(num_tokens, head_tiles, plan.splits)](
        q, cache, offsets, sinks, out, plan.part_o, plan.part_lse, scale * _LOG2E, num_heads, head_dim, num_keys,
        plan.per_split,
        q.stride(0), q.stride(1), offsets.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        DIRECT_OUT=plan.splits == 1, DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    if plan.splits > 1:
        out.copy_(merge_splits(plan.part_o, plan.part_lse, sinks * _LOG2E))
    return out
