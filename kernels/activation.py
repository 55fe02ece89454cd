"""Gated-MLP activations (torch implementation = the reference for later fused GPU kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2*I] laid out as gate || up (the fused gate_up_proj output) -> [..., I];
    `limit`: gate clamped to at most it and up to within +-it first (the clamped SwiGLU of DeepSeek-V4)."""
    gate, up = x.chunk(2, dim=-1)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
