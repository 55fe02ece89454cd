"""Greedy sampling's argmax over the vocabulary in two small launches.

torch's argmax runs one row of a 129,280-token vocabulary (DeepSeek-V3's float32 logits at batch 1) as a single
reduction in one program, a visible part of a batch-1 decode step. Here each row is cut into `splits` contiguous
ranges: one program per (row, range) keeps, lane by lane, the first largest value it meets and its index, then
reduces to the range's (max, first index); a second launch takes, per row, the max over the ranges and the first
index holding it. The result is torch.argmax's: the first index of the maximum
(NaN is not treated as the maximum, as torch does; a row of NaNs gives index 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
TARGET_PROGRAMS = 256
"""Ranges per row: enough for about this many programs in all (about two per SM of a Hopper GPU), at least BLOCK
values each."""


@triton.jit
def _argmax_partial_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, PER_SPLIT, SPLITS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    base = x_ptr + row.to(tl.int64) * stride_row
    start = split * PER_SPLIT
    end = tl.minimum(start + PER_SPLIT, V)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.full((BLOCK,), 0, tl.int32) + start
    for step in range(0, PER_SPLIT, BLOCK):
        i = start + step + offs
        v = tl.load(base + i, mask=i < end, other=float("-inf")).to(tl.float32)
        better = v > best  # strict: a lane keeps the first index of its largest value
        best = tl.where(better, v, best)
        where = tl.where(better, i, where)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, where, 2147483647), 0)
    tl.store(val_ptr + row * SPLITS + split, top)
    tl.store(idx_ptr + row * SPLITS + split, first)


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, SPLITS, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < SPLITS
    vals = tl.load(val_ptr + row * SPLITS + offs, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * SPLITS + offs, mask=ok, other=2147483647)
    top = tl.max(vals, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (vals == top), idx, 2147483647), 0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (rows contiguous) -> int64 [B], torch.argmax(x, dim=-1) (first index of each row's maximum)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, rows), triton.cdiv(vocab, BLOCK)))
    per_split = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, per_split)
    vals = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, splits, dtype=torch.int32, device=x.device)
    _argmax_partial_kernel[(rows, splits)](x, vals, idx, vocab, x.stride(0), per_split, splits, BLOCK=BLOCK,
                                           num_warps=4)  # fmt: skip
    _argmax_final_kernel[(rows,)](vals, idx, out, splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=1)
    return out
