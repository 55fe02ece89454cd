"""The float linear layers' product: F.linear (cuBLAS), or for a single row on CUDA the triton matrix-vector kernel
(kernels/triton/gemv.py) when FLOTILLA_GEMV=1.

Batch-1 decode makes every linear layer a matrix-vector product; cuBLAS reads the small ones (a MoE model's
attention projections and router) at under half the memory bandwidth (kernels/triton/gemv.py has the numbers).
The triton kernel is opt-in until the GPU has measured it against cuBLAS at those shapes (bench_kernels --only gemv)
and in an engine run. Only rows on CUDA in bf16 / fp16 with matching weights take it; everything else is F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

GEMV = os.environ.get("FLOTILLA_GEMV") == "1"
"""Whether one-row products run the triton kernel (FLOTILLA_GEMV=1 at import; benchmarks flip it in place)."""

_HALF = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias), as F.linear."""
    if GEMV and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in _HALF and weight.dtype == x.dtype:
        from flotilla.kernels.triton.gemv import gemv  # imports triton: CUDA only here

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
