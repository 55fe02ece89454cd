"""Splitting each token's list of keys across programs, for the kernels that attend over listed keys (DSA's sparse
MLA in kernels/mla/dsa_triton.py, DeepSeek-V4's sink attention): how many splits fill the GPU, the buffers of the
splits' partials, and their log-sum-exp merge."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 512
"""A list is split until tokens * head tiles * splits reaches this (~4 programs per SM of an H100/H200)."""
NO_SCORE = tl.constexpr(-1.0e30)
"""The online softmax's starting maximum: finite, so a tile whose keys are all -1 leaves the state as it was."""


@dataclass(frozen=True, slots=True)
class ListSplits:
    """A launch's split of its token's lists: `splits` programs of `per_split` keys each (a multiple of the key
    tile); with more than one split, partial outputs [T, H, splits, width] and log2-sum-exps [T, H, splits] (with
    one, both are the output, unused by a kernel that writes directly)."""

    splits: int
    per_split: int
    part_o: torch.Tensor
    part_lse: torch.Tensor


def plan_splits(out: torch.Tensor, num_keys: int, head_tiles: int, block_n: int, num_splits: int | None,
                min_keys_per_split: int) -> ListSplits:
    """The split of lists of `num_keys` for out [T, H, width]: num_splits, or as many as fill the GPU with at least
    min_keys_per_split keys each."""
    num_tokens, num_heads, width = out.shape
    if num_splits is None:
        by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(num_tokens * head_tiles, 1))
        num_splits = max(1, min(by_occupancy, triton.cdiv(num_keys, min_keys_per_split)))
    per_split = triton.cdiv(triton.cdiv(max(num_keys, 1), num_splits), block_n) * block_n
    splits = max(1, triton.cdiv(num_keys, per_split))
    if splits == 1:
        return ListSplits(1, per_split, out, out)
    part_o = torch.empty(num_tokens, num_heads, splits, width, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=out.device)
    return ListSplits(splits, per_split, part_o, part_lse)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, sink_lse: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, width]: the splits' normalized partials [T, H, S, width] weighted by their log2-sum-exps [T, H, S] (a
    split without a valid key: lse -inf, partial 0), with each head's sink [H] (log2) as one more term of the
    denominator when given; 0 for a row without any key or sink."""
    lse = part_lse if sink_lse is None else torch.cat(
        [part_lse, sink_lse[None, :, None].expand(part_lse.shape[0], -1, 1)], dim=-1)
    weight = torch.exp2(lse - lse.amax(-1, keepdim=True).clamp(min=NO_SCORE.value))
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.einsum("ths,thsd->thd", weight[..., :part_lse.shape[-1]], part_o)
