"""Triton GPU kernels (the "triton" attention backend and fused decoder-layer ops).

Importing this package imports triton, so only code that chose a triton backend imports it (the
attention dispatch does so lazily). Every kernel here has a torch reference it is tested against in
tests/test_kernels_triton.py; on a machine without a GPU they run under TRITON_INTERPRET=1, which must
be set before this package is first imported (triton.jit reads it when the kernels are defined).
"""

from flotilla.kernels.triton.attention import forward, paged_decode_attention, paged_prefill_attention, store_kv
from flotilla.kernels.triton.fused import apply_rope, fused_add_rms_norm, rms_norm, rope_and_store_kv, silu_and_mul

__all__ = [
    "apply_rope",
    "forward",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rope_and_store_kv",
    "silu_and_mul",
    "store_kv",
]
