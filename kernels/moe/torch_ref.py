"""The MoE experts in plain torch: the reference every fused backend is tested against, and the CPU path.

Semantics every backend shares (so they can be compared to the last bit in float32 and to rounding in
half precision): each expert computes down(silu(gate(x)) * up(x)) in the activation dtype, rounding
where this code rounds; the expert's output is scaled by the routing weight in float32 and rounded to
the activation dtype; a token's k scaled outputs are summed in float32 and rounded once. A negative expert id
marks a slot to skip (it adds nothing): expert parallelism's masked routing, where a rank computes only its own
experts' slots of tokens it shares with other ranks; the fused backends take it with `masked=True`.

FP8 experts (DeepSeek-V3's checkpoints: e4m3 weights with float32 block scales, kernels/quant/fp8_ref.py):
fused_experts_fp8 dequantizes each expert that got tokens into the activation dtype on every call (the
weights stay e4m3 in memory; slow, but exactly the model whose experts were dequantized at load), and
fused_experts_fp8_w8a8 also quantizes the activations per token and group of block_k columns, which is
what the FP8 kernels (triton_experts.fused_experts_fp8) compute. w13's scales hold gate's block rows, then up's: the
checkpoint stores gate and up as two tensors, each with its own blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul
from flotilla.kernels.quant.fp8_ref import (
    FP8_DTYPE,
    block_dequantize,
    block_quantize,
    fp8_block_linear_w8a8,
    num_blocks,
)

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]
"""(expert, its tokens' hidden rows [n, H]) -> the expert's output [n, H] in the rows' dtype."""


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    masked: bool = False,
    *,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights float32 and
    topk_ids int [T, k] -> [T, H] in hidden's dtype. One loop over the experts that got tokens. Negative ids are
    skipped whether or not `masked` says they may be there. swiglu_limit: gate clamped to at most it and up to within
    +-it before silu(gate) * up (DeepSeek-V4's experts)."""
    return _combine(hidden, topk_weights, topk_ids,
                    lambda e, x: F.linear(silu_and_mul(F.linear(x, w13[e]), swiglu_limit), w2[e]))  # fmt: skip


def _combine(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, mlp: ExpertMLP) -> torch.Tensor:
    """Each expert that got tokens run on them, its outputs weighted and summed per token as the module says."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:  # a masked slot: another rank's expert
            continue
        token_idx, choice = torch.where(topk_ids == expert)
        y = mlp(expert, hidden[token_idx])
        weighted = (y.float() * topk_weights[token_idx, choice, None]).to(hidden.dtype)
        out.index_add_(0, token_idx, weighted.float())
    return out.to(hidden.dtype)


def fp8_expert_scale_shapes(num_experts: int, hidden_size: int, intermediate_size: int,
                            block_size: tuple[int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:  # fmt: skip
    """(w13_scale, w2_scale) shapes of FP8 experts: [E, 2 ceil(I/bn), ceil(H/bk)] (gate's block rows, then
    up's) and [E, ceil(H/bn), ceil(I/bk)]."""
    bn, bk = block_size
    return ((num_experts, 2 * num_blocks(intermediate_size, bn), num_blocks(hidden_size, bk)),
            (num_experts, num_blocks(hidden_size, bn), num_blocks(intermediate_size, bk)))  # fmt: skip


def check_fp8_expert_scales(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                            block_size: tuple[int, int]) -> None:  # fmt: skip
    """ValueError unless w13 [E, 2I, H] / w2 [E, H, I] are e4m3 and their scales have the shapes above."""
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts take e4m3 weights, got {w13.dtype} and {w2.dtype}")
    num_experts, two_i, hidden_size = w13.shape
    want = fp8_expert_scale_shapes(num_experts, hidden_size, two_i // 2, block_size)
    if tuple(w13_scale.shape) != want[0] or tuple(w2_scale.shape) != want[1]:
        raise ValueError(f"FP8 expert scales {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)} do not fit w13 "
                         f"{tuple(w13.shape)} and w2 {tuple(w2.shape)} in {block_size[0]}x{block_size[1]} blocks: "
                         f"expected {want[0]} and {want[1]}")  # fmt: skip


def w13_block_dequantize(w13: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """One expert's e4m3 gate_up [2I, H] and its scales [2 ceil(I/bn), ceil(H/bk)] -> [2I, H] in `dtype`."""
    inter, rows = w13.shape[0] // 2, scale.shape[0] // 2
    return torch.cat([block_dequantize(w13[:inter], scale[:rows], block_size, dtype),
                      block_dequantize(w13[inter:], scale[rows:], block_size, dtype)])  # fmt: skip


def w13_block_quantize(w13: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's gate_up [2I, H] -> (e4m3 [2I, H], scales [2 ceil(I/bn), ceil(H/bk)]): gate and up quantized
    apart, as the checkpoint's two tensors are."""
    inter = w13.shape[0] // 2
    (gate, gate_scale), (up, up_scale) = block_quantize(w13[:inter], block_size), block_quantize(w13[inter:], block_size)
    return torch.cat([gate, up]), torch.cat([gate_scale, up_scale])


def fused_experts_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    masked: bool = False,
) -> torch.Tensor:
    """fused_experts on e4m3 experts (w13 [E, 2I, H], w2 [E, H, I]) with float32 block scales (shapes:
    fp8_expert_scale_shapes): each expert with tokens dequantized into hidden's dtype, then computed as
    fused_experts does (the activations are not quantized)."""
    check_fp8_expert_scales(w13, w13_scale, w2, w2_scale, block_size)

    def mlp(e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, w13_block_dequantize(w13[e], w13_scale[e], block_size, x.dtype))
        return F.linear(silu_and_mul(gate_up), block_dequantize(w2[e], w2_scale[e], block_size, x.dtype))

    return _combine(hidden, topk_weights, topk_ids, mlp)


def fused_experts_fp8_w8a8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    masked: bool = False,
) -> torch.Tensor:
    """What the FP8 kernels compute (the reference they are tested against): fused_experts_fp8 with each GEMM's
    input quantized per token and group of block_k columns, the products taken in float32 and rounded to
    hidden's dtype (fp8_ref.fp8_block_linear_w8a8)."""
    check_fp8_expert_scales(w13, w13_scale, w2, w2_scale, block_size)

    def mlp(e: int, x: torch.Tensor) -> torch.Tensor:
        inter, rows = w13.shape[1] // 2, w13_scale.shape[1] // 2
        gate = fp8_block_linear_w8a8(x, w13[e, :inter], w13_scale[e, :rows], None, block_size)
        up = fp8_block_linear_w8a8(x, w13[e, inter:], w13_scale[e, rows:], None, block_size)
        act = silu_and_mul(torch.cat([gate, up], dim=-1))
        return fp8_block_linear_w8a8(act, w2[e], w2_scale[e], None, block_size)

    return _combine(hidden, topk_weights, topk_ids, mlp)
