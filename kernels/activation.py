"""Gated-MLP activations (torch implementation = the reference for later fused GPU kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2*I] laid out as gate || up (the fused gate_up_proj output) -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
