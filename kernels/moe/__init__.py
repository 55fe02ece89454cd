"""MoE kernels: routing (kernels/moe/routing.py) and the experts' fused compute, with backends picked
by name or by capability.

Every backend computes the same thing with the same signature (torch_ref.fused_experts documents it):
hidden [T, H], stacked expert weights w13 [E, 2I, H] and w2 [E, H, I], the routing's topk_weights and
topk_ids [T, k] -> [T, H]. Weights stacked per expert are what expert parallelism slices: a rank keeps
rows [e0, e1) of both and receives only the tokens routed there.

- "torch": torch_ref, a loop over experts; the reference and the CPU path.
- "triton": triton_experts, sorted-token grouped GEMMs with SiLU-and-mul fused (CUDA, or the CPU
  interpreter under TRITON_INTERPRET=1); batches of a few tokens (decode at small batch) take
  triton_experts_small instead: token-major matrix-vector kernels with no sorting and the combine fused.
- "deep_gemm": deep_gemm_experts on DeepGEMM's contiguous grouped GEMM (CUDA with deep_gemm, bf16).

FP8 experts (DeepSeek-V3's e4m3 weights with float32 128x128 block scales, kept as the checkpoint stores
them) go through a backend's `fused_experts_fp8(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
block_size)` (torch_ref.fused_experts_fp8 documents it): "torch" dequantizes each expert with tokens on every
call (the CPU path, exactly the dequantized model), "triton" runs triton_experts' kernel in its FP8 (W8A8) mode
(activations quantized per token and 1 x block_k group), and "deep_gemm" deep_gemm_experts.fused_experts_fp8
(DeepGEMM's m_grouped_fp8_gemm_nt_contiguous over the same W8A8 scheme), which agree with triton's to within 1%
(relative norm) at DeepSeek-V3's sizes; "auto" does not pick them (the contiguous layout pads every expert to 128
rows, a prefill shape).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flotilla.kernels.moe import deep_gemm_experts, torch_ref
from flotilla.kernels.moe.routing import ExpertBlocks, select_experts, select_experts_grouped, sort_by_expert
from flotilla.kernels.triton_support import triton_usable

__all__ = [
    "ExpertBlocks",
    "MoEBackend",
    "available_moe_backends",
    "best_moe_backend",
    "get_moe_backend",
    "select_experts",
    "select_experts_grouped",
    "sort_by_expert",
]

logger = logging.getLogger(__name__)

FusedExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
FusedExpertsFp8 = Callable[..., torch.Tensor]
"""(hidden [T, H], w13 e4m3 [E, 2I, H], w13_scale, w2 e4m3 [E, H, I], w2_scale, topk_weights, topk_ids,
block_size) -> [T, H] in hidden's dtype (torch_ref.fused_experts_fp8)."""


@dataclass(frozen=True, slots=True)
class MoEBackend:
    """One implementation of the experts: fused_experts(hidden, w13, w2, topk_weights, topk_ids), and its
    fused_experts_fp8 for e4m3 block-scaled weights (None: this backend has no FP8 experts)."""

    name: str
    fused_experts: FusedExperts
    fused_experts_fp8: FusedExpertsFp8 | None = None


_BACKENDS: dict[str, MoEBackend] = {
    "torch": MoEBackend(name="torch", fused_experts=torch_ref.fused_experts, fused_experts_fp8=torch_ref.fused_experts_fp8)
}
_OPTIONAL = ("triton", "deep_gemm")
"""Backends built on first use, when their package and device are there."""
_FP8_BACKENDS = ("torch", "triton", "deep_gemm")
"""The backends with FP8 experts."""
_logged_auto_choice = False

DEEP_GEMM_IN_AUTO = False
"""Whether "auto" may pick deep_gemm (before triton) on CUDA. Off until its path has been run and
measured on the GPU machine; "deep_gemm" can always be forced."""


def available_moe_backends() -> list[str]:
    """Names accepted by get_moe_backend, "auto" included."""
    return ["auto", *_BACKENDS, *(n for n in _OPTIONAL if n not in _BACKENDS)]


def deep_gemm_usable() -> bool:
    """deep_gemm imports (with its bf16 grouped GEMM) and a Hopper-or-newer GPU is there."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return deep_gemm_experts.import_deep_gemm() is not None


def best_moe_backend(device: torch.device, dtype: torch.dtype | None = None, fp8_weights: bool = False) -> str:
    """The fastest backend for experts on `device`: deep_gemm (bf16 weights, once DEEP_GEMM_IN_AUTO), then
    triton on CUDA, else the torch reference. `fp8_weights`: the experts are e4m3 block-scaled."""
    if device.type != "cuda":
        return "torch"
    if DEEP_GEMM_IN_AUTO and dtype == torch.bfloat16 and not fp8_weights and deep_gemm_usable():
        return "deep_gemm"
    return "triton" if triton_usable() else "torch"


def get_moe_backend(name: str = "auto", device: torch.device | None = None,
                    dtype: torch.dtype | None = None, fp8_weights: bool = False) -> MoEBackend:
    """The backend called `name`; "auto" picks the best one for `device` (default: torch's current default
    device) and dtype (default: torch's default dtype), and logs the choice once. `fp8_weights`: the experts
    are e4m3 block-scaled, so the backend must have fused_experts_fp8 (ValueError when a forced one has not)."""
    global _logged_auto_choice
    if name == "auto":
        name = best_moe_backend(device or torch.get_default_device(), dtype or torch.get_default_dtype(), fp8_weights)
        if not _logged_auto_choice:
            logger.info("MoE backend: %s (auto%s)", name, ", FP8 experts" if fp8_weights else "")
            _logged_auto_choice = True
    backend = _backend(name)
    if fp8_weights and backend.fused_experts_fp8 is None:
        raise ValueError(f"MoE backend {name!r} has no FP8 experts (e4m3 block-scaled weights); choices for them: "
                         f"{', '.join(n for n in available_moe_backends() if n in ('auto', *_FP8_BACKENDS))}")
    return backend


def _backend(name: str) -> MoEBackend:
    """The backend called `name`, built on first use; ValueError naming what is missing."""
    if name == "triton" and name not in _BACKENDS:
        if not triton_usable():
            raise ValueError("MoE backend 'triton' needs the triton package and CUDA (or TRITON_INTERPRET=1)")
        # Optional dependency (CPU-only installs lack it), so imported only when this backend is chosen.
        from flotilla.kernels.moe import triton_experts

        _BACKENDS[name] = MoEBackend(name=name, fused_experts=triton_experts.fused_experts,
                                     fused_experts_fp8=triton_experts.fused_experts_fp8)
    if name == "deep_gemm" and name not in _BACKENDS:
        if not deep_gemm_usable():
            raise ValueError("MoE backend 'deep_gemm' needs the deep_gemm package and a CUDA GPU of compute "
                             "capability 9.0 or newer")
        _BACKENDS[name] = MoEBackend(name=name, fused_experts=deep_gemm_experts.fused_experts,
                                     fused_experts_fp8=deep_gemm_experts.fused_experts_fp8)
    if name not in _BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choices: {', '.join(available_moe_backends())}")
    return _BACKENDS[name]
