"""FP8 (e4m3) KV cache: which dtype a `kv_cache_dtype` option means, and the per-tensor quantization every
attention backend's store and read share.

A cache of dtype float8_e4m3fn holds x / scale, clamped to +-448 (e4m3fn's largest finite value) and rounded
to nearest even; reading multiplies by the scale again. There is one float scale per layer for K and one for V
(for MLA's latent cache one for the whole row). Like vLLM, a checkpoint without calibrated scales gets 1.0:
K and V of the usual models are far inside +-448, so the cost is e4m3's 3-bit mantissa (a relative error of at
most 2^-4 per element), and the cache holds twice the tokens of a 16-bit one. In a cache of any other dtype the
scales are ignored (stores cast, reads read), so the default path is unchanged bit for bit.

Backends fold the scales where they are cheapest: the torch references dequantize what they gather, the
triton kernels and flashinfer fold k_scale into the softmax scale and multiply the output by v_scale.
"""

from __future__ import annotations

import torch

from flotilla.kernels.quant.fp8_ref import FP8_DTYPE, FP8_MAX

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""Values of the kv_cache_dtype option (vLLM's names): auto = the model's dtype; fp8 and fp8_e4m3 = e4m3fn."""

FP8_KV_DTYPE = FP8_DTYPE
FP8_KV_MAX = FP8_MAX


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, backend: str | None = None,
                         device: torch.device | None = None) -> torch.dtype:
    """The torch dtype of the KV cache for the kv_cache_dtype option and the model's activation dtype; with the
    attention backend's name and the device, an FP8 cache that backend cannot read there is refused."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if backend is not None and device is not None:
        check_fp8_kv_support(backend, device)
    return FP8_KV_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype stores quantized values (scales apply)."""
    return dtype == FP8_KV_DTYPE


def check_fp8_kv_support(backend: str, device: torch.device) -> None:
    """Refuse, before anything is allocated, a backend that cannot read an FP8 KV cache on `device`: triton
    converts e4m3 in hardware only from compute capability 8.9 (Ada, Hopper) on."""
    old_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)
    if backend in ("triton", "flashinfer_triton") and old_gpu:  # (the latter decodes with triton)
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype fp8 with the triton attention backend needs compute capability 8.9 or "
                         f"newer, this GPU has {major}.{minor}: use kv_cache_dtype auto or another backend")


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype = FP8_KV_DTYPE) -> torch.Tensor:
    """x as a cache of `dtype` stores it: (x / scale) clamped to +-448 in e4m3fn for an FP8 cache (float32
    arithmetic, round to nearest even), else a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values back in `dtype`: x * scale for an FP8 cache, else a plain cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)
