"""The MoE experts in plain torch: the reference every fused backend is tested against, and the CPU path.

Semantics every backend shares (so they can be compared to the last bit in float32 and to rounding in
half precision): each expert computes down(silu(gate(x)) * up(x)) in the activation dtype, rounding
where this code rounds; the expert's output is scaled by the routing weight in float32 and rounded to
the activation dtype; a token's k scaled outputs are summed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights float32 and
    topk_ids int [T, k] -> [T, H] in hidden's dtype. One loop over the experts that got tokens."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, choice = torch.where(topk_ids == expert)
        y = F.linear(silu_and_mul(F.linear(hidden[token_idx], w13[expert])), w2[expert])
        weighted = (y.float() * topk_weights[token_idx, choice, None]).to(hidden.dtype)
        out.index_add_(0, token_idx, weighted.float())
    return out.to(hidden.dtype)
