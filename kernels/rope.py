"""Rotary position embedding, neox style (rotate halves), as HF Llama/Qwen3/Mistral apply it.

The cos/sin table is precomputed once in float32 up to max_position and indexed by each token's
absolute position, so a step with mixed prefill chunks and decodes needs no per-sequence logic.
Torch implementation = the reference later fused GPU kernels are compared to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling kind of an HF rope_scaling / rope_parameters dict ("default" when absent)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies, with HF's "linear", "llama3" or "yarn" scaling applied."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    # Same expression as HF's default rope init so the tables agree bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)  # type: ignore[arg-type]
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, the band between blended."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(scaling: Mapping[str, Any]) -> float:
    if scaling.get("factor") is None:
        raise ValueError("yarn rope scaling needs 'factor'")
    return float(scaling["factor"])


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction 0.1 * mscale * ln(scale) + 1 (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor HF multiplies cos and sin by (YaRN's "attention_factor", else 1): explicit, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek), else mscale(factor)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN (HF's _compute_yarn_parameters): interpolated frequencies below the beta_slow rotation count,
    extrapolated (unchanged) above beta_fast, a linear ramp between; same expressions, same float32 bits."""
    factor = _yarn_factor(scaling)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """float32 [max_position, head_dim]: row p = cos(p * inv_freq) || sin(p * inv_freq), both times
    rope_attention_factor (YaRN's; 1 otherwise)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    factor = rope_attention_factor(scaling)
    return table if factor == 1.0 else table * factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [T, H, D] by cos/sin [T, 1, D/2], in float32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] by the angles of positions [T] (int64); returns new
    tensors. cos_sin_cache is rope_cos_sin_cache's table (on the same device)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).float().chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
