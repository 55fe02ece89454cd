"""The decoder layer's elementwise ops, chosen once per model: torch references or fused triton kernels.

RMSNorm (with its residual add), SiLU-and-mul and RoPE (with the K/V store into the paged cache) are
memory-bound and tiny at decode batch sizes, so in eager torch each costs several kernel launches
(float32 casts, pow, mean, rsqrt, ...): on a 36-layer model that is hundreds of launches per step, and
even inside a CUDA graph every launch costs the device a few microseconds. The triton kernels
(kernels/triton/fused.py) do each op in one launch. Which set runs is decided like the attention
backend: "auto" = triton on CUDA when triton is installed, the torch references elsewhere; the choice
is logged once per process.

Model code asks `current_ops()` while it is being built (LlamaForCausalLM sets it with `use_ops`), so
the choice reaches every layer without threading an argument through each constructor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flotilla.kernels import activation, norm, rope
from flotilla.kernels.attention import triton_usable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FusedOps:
    """One implementation of the layer's elementwise ops (the signatures of the torch references)."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_and_store_kv: Callable[..., torch.Tensor] | None = None
    """RoPE and the K/V store in one launch (valid for flotilla's KV layout, which every attention backend
    shares); None: apply_rope, then the attention backend's store_kv."""
    qk_norm_rope_and_store_kv: Callable[..., torch.Tensor] | None = None
    """Qwen3's per-head q/k RMSNorm, RoPE and the K/V store in one launch from the fused qkv output
    (kernels/triton/qk_norm_rope.py); None: the norms, then the RoPE path above."""


TORCH_OPS = FusedOps(name="torch", rms_norm=norm.rms_norm, fused_add_rms_norm=norm.fused_add_rms_norm,
                     silu_and_mul=activation.silu_and_mul, apply_rope=rope.apply_rope)

OPS_CHOICES = ("auto", "torch", "triton")


def _triton_ops() -> FusedOps:
    # optional dependency (CPU-only installs may lack it): imported only when chosen
    from flotilla.kernels.triton import fused, qk_norm_rope

    return FusedOps(name="triton", rms_norm=fused.rms_norm, fused_add_rms_norm=fused.fused_add_rms_norm,
                    silu_and_mul=fused.silu_and_mul, apply_rope=fused.apply_rope,
                    rope_and_store_kv=fused.rope_and_store_kv,
                    qk_norm_rope_and_store_kv=qk_norm_rope.qk_norm_rope_and_store_kv)


_logged: set[str] = set()


def get_ops(name: str = "auto", device: torch.device | None = None) -> FusedOps:
    """The ops called `name`; "auto" picks triton on CUDA (when installed), else torch."""
    device = device or torch.get_default_device()
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_usable() else "torch"
    if name == "torch":
        ops = TORCH_OPS
    elif name == "triton":
        if not triton_usable():
            raise ValueError("fused ops 'triton' need the triton package and CUDA (or TRITON_INTERPRET=1)")
        ops = _triton_ops()
    else:
        raise ValueError(f"unknown fused ops {name!r}; choices: {', '.join(OPS_CHOICES)}")
    if ops.name not in _logged:
        log.info("elementwise ops (norm, SiLU-and-mul, RoPE + KV store): %s", ops.name)
        _logged.add(ops.name)
    return ops


_current: FusedOps = TORCH_OPS


def current_ops() -> FusedOps:
    """The ops of the model being built (torch outside `use_ops`)."""
    return _current


@contextmanager
def use_ops(ops: FusedOps) -> Iterator[FusedOps]:
    """Build model modules with `ops`."""
    global _current
    previous, _current = _current, ops
    try:
        yield ops
    finally:
        _current = previous
