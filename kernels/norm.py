"""RMSNorm kernels (torch implementation = the reference later GPU kernels are compared to).

Statistics are taken in float32 whatever the activation dtype, as HF Llama/Qwen3 do, so bf16 models
match the checkpoints' training numerics.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight, computed in float32 and returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual add fused with its norm
    so a GPU kernel reads the activations once; the sum is the next block's residual."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
