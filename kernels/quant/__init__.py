"""Quantized linear layers. FP8 block-scaled weights as in DeepSeek's checkpoints (fp8_ref.py documents
the format): quantization and dequantization, and `fp8_block_linear(x, weight, scale_inv, bias)` with
backends picked by capability or forced by name:

- "torch": fp8_ref, the weight dequantized into the activation dtype, then one matmul (the reference; CPU).
- "triton": fp8_triton, a block-scaled FP8 GEMM on dynamically quantized activations (CUDA, or the CPU
  interpreter under TRITON_INTERPRET=1).
- "deep_gemm": DeepGEMM's fp8_gemm_nt on Hopper or newer, when `import deep_gemm` works.

"auto" picks triton on CUDA (deep_gemm first once DEEP_GEMM_IN_AUTO is on), else torch (also under the
interpreter), logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from flotilla.kernels.quant import fp8_ref
from flotilla.kernels.quant.fp8_ref import (
    FP8_DTYPE,
    FP8_MAX,
    block_dequantize,
    block_quantize,
    per_token_group_dequantize,
    per_token_group_quantize,
)
from flotilla.kernels.triton_support import triton_usable

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8LinearBackend",
    "available_fp8_backends",
    "best_fp8_backend",
    "block_dequantize",
    "block_quantize",
    "fp8_block_linear",
    "get_fp8_backend",
    "per_token_group_dequantize",
    "per_token_group_quantize",
    "quantize_activations",
]

logger = logging.getLogger(__name__)

Fp8Linear = Callable[..., torch.Tensor]
"""(x [..., K], weight e4m3 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)], bias [N] | None,
block_size) -> [..., N] in x's dtype."""


@dataclass(frozen=True, slots=True)
class Fp8LinearBackend:
    """One implementation of fp8_block_linear."""

    name: str
    linear: Fp8Linear


_BACKENDS: dict[str, Fp8LinearBackend] = {"torch": Fp8LinearBackend("torch", fp8_ref.fp8_block_linear)}
_OPTIONAL = ("triton", "deep_gemm")
_logged_auto_choice = False

DEEP_GEMM_IN_AUTO = False
"""Whether "auto" may pick deep_gemm (before triton) on CUDA. Off until its path has been run and measured
on the GPU machine; "deep_gemm" can always be forced."""


def import_deep_gemm() -> ModuleType | None:
    """The deep_gemm module when it imports and has fp8_gemm_nt, else None."""
    try:
        import deep_gemm  # optional dependency: only imported when this backend is asked about
    except ImportError:
        return None
    return deep_gemm if hasattr(deep_gemm, "fp8_gemm_nt") else None


def deep_gemm_usable() -> bool:
    """deep_gemm imports with fp8_gemm_nt and a Hopper-or-newer GPU is there."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return import_deep_gemm() is not None


def quantize_activations(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_ref.per_token_group_quantize's result: one triton launch on CUDA (fp8_quant_triton), torch elsewhere."""
    if x.is_cuda:
        from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize as quantize  # imports triton

        return quantize(x, group_size)
    return per_token_group_quantize(x, group_size)


def _deep_gemm_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      bias: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:  # fmt: skip
    """DeepGEMM's fp8_gemm_nt((x_fp8, x_scales [M, K/128]), (w_fp8, w_scale_inv), out bf16): its contract
    is 128x128 weight blocks and 1x128 activation groups, bf16 output. Not yet run on a GPU."""
    deep_gemm = import_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError("deep_gemm is not importable")
    if tuple(block_size) != (128, 128):
        raise ValueError(f"deep_gemm's FP8 GEMM takes 128x128 weight blocks, not {block_size[0]}x{block_size[1]}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    a, a_scale = quantize_activations(x2, 128)
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_gemm_nt((a, a_scale), (weight, scale_inv.float()), out)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.to(x.dtype).view(*x.shape[:-1], n)


def available_fp8_backends() -> list[str]:
    """Names accepted by get_fp8_backend, "auto" included."""
    return ["auto", *_BACKENDS, *(n for n in _OPTIONAL if n not in _BACKENDS)]


def best_fp8_backend(device: torch.device) -> str:
    """deep_gemm on a Hopper GPU with it installed (when DEEP_GEMM_IN_AUTO), then triton on CUDA, else torch."""
    if device.type == "cuda":
        if DEEP_GEMM_IN_AUTO and deep_gemm_usable():
            return "deep_gemm"
        if triton_usable():
            return "triton"
    return "torch"


def get_fp8_backend(name: str = "auto", device: torch.device | None = None) -> Fp8LinearBackend:
    """The backend `name` (or the best for `device` when "auto"); ValueError naming what is missing."""
    global _logged_auto_choice
    if name == "auto":
        name = best_fp8_backend(device or torch.get_default_device())
        if not _logged_auto_choice:
            logger.info("FP8 linear backend: %s (auto)", name)
            _logged_auto_choice = True
    if name in _BACKENDS:
        return _BACKENDS[name]
    if name == "triton":
        if not triton_usable():
            raise ValueError("FP8 linear backend 'triton' needs triton and a CUDA device "
                             "(or TRITON_INTERPRET=1 on CPU)")  # fmt: skip
        from flotilla.kernels.quant import fp8_triton  # imported late: triton.jit reads TRITON_INTERPRET

        _BACKENDS[name] = Fp8LinearBackend(name, fp8_triton.fp8_block_linear)
        return _BACKENDS[name]
    if name == "deep_gemm":
        if not deep_gemm_usable():
            raise ValueError("FP8 linear backend 'deep_gemm' needs the deep_gemm package (with fp8_gemm_nt) "
                             "and a Hopper-or-newer GPU")  # fmt: skip
        _BACKENDS[name] = Fp8LinearBackend(name, _deep_gemm_linear)
        return _BACKENDS[name]
    raise ValueError(f"unknown FP8 linear backend {name!r}; choices: {', '.join(available_fp8_backends())}")


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                     block_size: tuple[int, int] = (128, 128), backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """y = x W^T (+ b) for an e4m3 weight with block scales, on `backend` (a name or "auto")."""
    return get_fp8_backend(backend, x.device).linear(x, weight, scale_inv, bias, block_size)
