"""The float linear layers' product: F.linear (cuBLAS), or for a single row on CUDA the triton matrix-vector kernel
(kernels/triton/gemv.py); FLOTILLA_GEMV=0 keeps cuBLAS everywhere.

Batch-1 decode makes every linear layer a matrix-vector product; cuBLAS reads the small ones (a MoE model's
attention projections and router) at under half the memory bandwidth (kernels/triton/gemv.py has the numbers). On an
H200, Qwen3-30B-A3B's batch-1 decode step in CUDA graphs took 3.05 ms of device time with the kernel against 3.30 with
cuBLAS, 290 against 260 tok/s (profile_step, docs/performance.md, 2026-12-01); at Qwen3-8B's shapes the kernel
matched or beat cuBLAS in bench_kernels. Only rows on CUDA in bf16 / fp16 with matching weights take it; everything
else (batches, float32, strided rows or weights, the LM head, which calls F.linear itself) is F.linear.

`norm_linear` and `norm_route` fold a pre-norm block's RMSNorm into that one-row kernel (and a MoE router's softmax
top-k after it: kernels/triton/norm_gemv.py), where the norm runs triton's kernels, with FLOTILLA_NORM_GEMV=1 (off
by default: slower so far, see NORM_GEMV).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

GEMV = os.environ.get("FLOTILLA_GEMV", "1") != "0"
"""Whether one-row products run the triton kernel (FLOTILLA_GEMV=0 at import: never; benchmarks flip it in place)."""

NORM_GEMV = os.environ.get("FLOTILLA_NORM_GEMV", "0") == "1"
"""Whether one-row products fold the RMSNorm before them into their launch (FLOTILLA_NORM_GEMV=1 at import). Off by
default: on an H200 the first form was slower (Qwen3-30B-A3B at batch 1: q/k/v with its norm 12.8 us against 5.8 +
1.9 apart, the MoE block's norm + router + routing 7.3 us against 6.0, 281.3 against 293.5 tok/s; docs/performance.md,
seventeenth session); the weight tile is now loaded before the statistics, not yet measured."""

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
    it reads it (no cast launch) and reads the weight at a higher bandwidth than cuBLAS's float32 gemv: on an H200
    DeepSeek-V3-4L's three routers took 20.1 us of a batch-1 step through cuBLAS, 14.6 here (docs/performance.md)."""
    if _one_row_on_cuda(x, weight):
        from flotilla.kernels.triton.gemv import gemv  # imports triton: CUDA only here

        return gemv(x, weight, out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def _folds_norm(x: torch.Tensor, residual: torch.Tensor | None, norm, weight: torch.Tensor) -> bool:
    """Whether norm (a models.llama.RMSNorm) may run inside the one-row product of its output x with weight."""
    return (NORM_GEMV and _one_row_on_cuda(x, weight) and x.dtype in _HALF and weight.dtype == x.dtype
            and norm.weight.dtype == x.dtype and norm.fp8_group == 0 and norm.ops.name == "triton"
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous())))  # fmt: skip


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """(linear(norm(x, residual)), the new residual) in one launch for a row _folds_norm allows, else None."""
    if not _folds_norm(x, residual, norm, weight):
        return None
    from flotilla.kernels.triton.norm_gemv import norm_gemv  # imports triton: CUDA only here

    return norm_gemv(x, residual, norm.weight, norm.eps, weight, bias)


def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm, router_weight: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """(norm(x, residual), the new residual, routing weights, expert ids) as the norm, a MoE router's linear layer
    and routing.select_experts give them, in one launch for a row _folds_norm allows, else None."""
    if not _folds_norm(x, residual, norm, router_weight):
        return None
    from flotilla.kernels.triton.norm_gemv import norm_router_topk  # imports triton: CUDA only here

    return norm_router_topk(x, residual, norm.weight, norm.eps, router_weight, top_k, renormalize)
