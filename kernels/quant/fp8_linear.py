"""Fp8BlockLinear: a linear layer whose weight is e4m3 with block scales (`weight` + `weight_scale_inv`,
DeepSeek's checkpoint names), run by a kernels/quant backend."""

from __future__ import annotations

import torch
from torch import nn

from flotilla.kernels.quant import Fp8LinearBackend, get_fp8_backend
from flotilla.kernels.quant.fp8_ref import FP8_DTYPE, block_quantize, num_blocks


class Fp8BlockLinear(nn.Module):
    """y = x W^T (+ b), W [out, in] stored as e4m3 with one float32 scale per block_size block. Parameters
    are uninitialized (they come from a checkpoint, or dummy_init_); the output has x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: tuple[int, int] = (128, 128), backend: Fp8LinearBackend | None = None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.backend = backend or get_fp8_backend("auto")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scales = (num_blocks(out_features, self.block_size[0]), num_blocks(in_features, self.block_size[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.weight_scale_inv, self.bias, self.block_size)

    @torch.no_grad()
    def dummy_init_(self, generator: torch.Generator, bound: float = 1e-3) -> None:
        """Random weights for load_format=dummy: uniform(-bound, bound) quantized into weight and scales."""
        w = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        w.uniform_(-bound, bound, generator=generator)
        q, s = block_quantize(w, self.block_size)
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(s)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound, generator=generator)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, backend={self.backend.name}")  # fmt: skip
