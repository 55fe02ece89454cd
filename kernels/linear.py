"""The float linear layers' product: F.linear (cuBLAS), or for a single row on CUDA the triton matrix-vector kernel
(kernels/triton/gemv.py); FLOTILLA_GEMV=0 keeps cuBLAS everywhere.

Batch-1 decode makes every linear layer a matrix-vector product; cuBLAS picks GEMM tiles for them and reads the
small ones (a MoE model's attention projections and router) at under half the memory bandwidth, which the kernel
reaches. Only rows on CUDA in bf16 / fp16 with matching weights take it; everything else (batches, float32, strided
rows or weights, the LM head, which calls F.linear itself) is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla import envs

GEMV = envs.FLOTILLA_GEMV
"""Whether one-row products run the triton kernel. Read once at import, since every linear layer asks; benchmarks and
tests flip this constant in place."""


_HALF = (torch.bfloat16, torch.float16)


def _one_row_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gemv kernel may take x @ weight.T: switched on, one contiguous row on CUDA, weight rows dense."""
    return (GEMV and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
            and weight.stride(1) == 1)  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias), as F.linear."""
    if _one_row_on_cuda(x, weight) and x.dtype in _HALF and weight.dtype == x.dtype:
        from flotilla.kernels.triton.gemv import gemv  # imports triton: CUDA only here

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] (any float dtype) @ weight [N, K].T in float32, as F.linear(x.float(), weight.float()): a MoE router's
    logits (DeepSeek-V3 keeps its router weight in float32). One row on CUDA takes the gemv kernel, which widens x as
    it reads it (no cast launch) and reads the weight at a higher bandwidth than cuBLAS's float32 gemv."""
    if _one_row_on_cuda(x, weight):
        from flotilla.kernels.triton.gemv import gemv  # imports triton: CUDA only here

        return gemv(x, weight, out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())
