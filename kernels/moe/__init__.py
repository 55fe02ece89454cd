"""MoE kernels: routing (kernels/moe/routing.py) and the experts' fused compute, with backends picked
by name or by capability.

Every backend computes the same thing with the same signature (torch_ref.fused_experts documents it):
hidden [T, H], stacked expert weights w13 [E, 2I, H] and w2 [E, H, I], the routing's topk_weights and
topk_ids [T, k] -> [T, H]. Weights stacked per expert are what expert parallelism slices: a rank keeps
rows [e0, e1) of both and receives only the tokens routed there.

- "torch": torch_ref, a loop over experts; the reference and the CPU path.
- "triton": triton_experts, sorted-token grouped GEMMs with SiLU-and-mul fused (CUDA, or the CPU
  interpreter under TRITON_INTERPRET=1).
- "deep_gemm": deep_gemm_experts on DeepGEMM's contiguous grouped GEMM (CUDA with deep_gemm, bf16).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flotilla.kernels.moe import deep_gemm_experts, torch_ref
from flotilla.kernels.moe.routing import ExpertBlocks, select_experts, select_experts_grouped, sort_by_expert

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


@dataclass(frozen=True, slots=True)
class MoEBackend:
    """One implementation of the experts: fused_experts(hidden, w13, w2, topk_weights, topk_ids)."""

    name: str
    fused_experts: FusedExperts


_BACKENDS: dict[str, MoEBackend] = {"torch": MoEBackend(name="torch", fused_experts=torch_ref.fused_experts)}
_OPTIONAL = ("triton", "deep_gemm")
"""Backends built on first use, when their package and device are there."""
_logged_auto_choice = False

DEEP_GEMM_IN_AUTO = False
"""Whether "auto" may pick deep_gemm (before triton) on CUDA. Off until its path has been run and
measured on the GPU machine; "deep_gemm" can always be forced."""


def available_moe_backends() -> list[str]:
    """Names accepted by get_moe_backend, "auto" included."""
    return ["auto", *_BACKENDS, *(n for n in _OPTIONAL if n not in _BACKENDS)]


def triton_usable() -> bool:
    """Triton is installed and can run here: CUDA, or the CPU interpreter (TRITON_INTERPRET=1, set before
    kernels/moe/triton_experts.py is first imported). Does not import triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def deep_gemm_usable() -> bool:
    """deep_gemm imports (with its bf16 grouped GEMM) and a Hopper-or-newer GPU is there."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return deep_gemm_experts.import_deep_gemm() is not None


def best_moe_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The fastest backend for experts on `device`: deep_gemm (bf16, once DEEP_GEMM_IN_AUTO), then triton
    on CUDA, else the torch reference."""
    if device.type != "cuda":
        return "torch"
    if DEEP_GEMM_IN_AUTO and dtype == torch.bfloat16 and deep_gemm_usable():
        return "deep_gemm"
    return "triton" if triton_usable() else "torch"


def get_moe_backend(name: str = "auto", device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> MoEBackend:
    """The backend called `name`; "auto" picks the best one for `device` (default: torch's current default
    device) and dtype (default: torch's default dtype), and logs the choice once."""
    global _logged_auto_choice
    if name == "auto":
        name = best_moe_backend(device or torch.get_default_device(), dtype or torch.get_default_dtype())
        if not _logged_auto_choice:
            logger.info("MoE backend: %s (auto)", name)
            _logged_auto_choice = True
    if name == "triton" and name not in _BACKENDS:
        if not triton_usable():
            raise ValueError("MoE backend 'triton' needs the triton package and CUDA (or TRITON_INTERPRET=1)")
        # Optional dependency (CPU-only installs lack it), so imported only when this backend is chosen.
        from flotilla.kernels.moe import triton_experts

        _BACKENDS[name] = MoEBackend(name=name, fused_experts=triton_experts.fused_experts)
    if name == "deep_gemm" and name not in _BACKENDS:
        if not deep_gemm_usable():
            raise ValueError("MoE backend 'deep_gemm' needs the deep_gemm package and a CUDA GPU of compute "
                             "capability 9.0 or newer")
        _BACKENDS[name] = MoEBackend(name=name, fused_experts=deep_gemm_experts.fused_experts)
    if name not in _BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choices: {', '.join(available_moe_backends())}")
    return _BACKENDS[name]
