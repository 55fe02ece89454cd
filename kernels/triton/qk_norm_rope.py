"""Qwen3's per-head q/k RMSNorm, neox RoPE and the K/V store into the paged cache, in one triton launch.

Qwen3 normalises every query and key head (over head_dim) before rotating it. Done op by op that is five
passes over q and k per layer: a copy (q and k are strided views of the fused qkv output), two norms, then
RoPE + store; at decode each is a separate tiny launch, at prefill each a full trip through HBM. Here one
program per token reads q, k and v straight from the qkv output, normalises and rotates each head in
registers, writes the query once (contiguous, for attention) and the key and value into their cache slot.

Numerics follow the references op for op (kernels.norm.rms_norm, kernels.rope.apply_rope, the cache store,
kernels/attention/fp8_kv.py for an FP8 cache): statistics in float32, the normalised head rounded to the
activation dtype, times the weight and rounded again, rotated in float32 and rounded; so bf16 results agree
with the op-by-op path to the last bit in almost every element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior
from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX
from flotilla.kernels.triton.fused import _cos_sin

FP8_MAX = tl.constexpr(FP8_KV_MAX)
"""Largest finite float8_e4m3fn value (the store clamps to it, as the reference does)."""


@triton.jit
def _norm_rotate(src, w_ptr, cos, sin, num_heads, half, head_dim, eps,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Heads at src + h*head_dim (+ half) of one token -> (first, second) rotated halves, in the source dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)
    ptr = src + offs_h[:, None] * head_dim + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + half, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / head_dim + eps)
    w1 = tl.load(w_ptr + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    n1 = (w1 * (a * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (b * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (n1 * cos - n2 * sin).to(dtype), (n2 * cos + n1 * sin).to(dtype), mask


@triton.jit
def _to_cache(x, scale, QUANT: tl.constexpr):
    y = x.to(tl.float32)
    if QUANT:
        y = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    return y


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_sin_ptr, q_out_ptr, cache_ptr, slot_ptr,
    stride_t, stride_cos, stride_qo, stride_cb, stride_ckv, stride_cs, stride_ch,
    num_heads, num_kv_heads, half, head_dim, block_size, eps, k_scale, v_scale,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """One program per token of qkv [T, (Hq + 2 Hkv) * D]: q -> q_out [T, Hq, D]; k, v -> the cache slot."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    token = tl.program_id(0).to(tl.int64)
    # the step's positions and slots (written before its first kernel) and the rotary table: read before the wait
    cos, sin = _cos_sin(cos_sin_ptr, pos_ptr, token, stride_cos, half, BLOCK_HALF)
    slot = tl.load(slot_ptr + token)
    wait_prior(USE_GDC)
    offs_d = tl.arange(0, BLOCK_HALF)
    base = qkv_ptr + token * stride_t
    q1, q2, qmask = _norm_rotate(base, qw_ptr, cos, sin, num_heads, half, head_dim, eps, BLOCK_HQ, BLOCK_HALF)
    offs_hq = tl.arange(0, BLOCK_HQ)
    qdst = q_out_ptr + token * stride_qo + offs_hq[:, None] * head_dim + offs_d[None, :]
    tl.store(qdst, q1, mask=qmask)
    tl.store(qdst + half, q2, mask=qmask)
    if slot >= 0:
        kbase = base + num_heads * head_dim
        k1, k2, kmask = _norm_rotate(kbase, kw_ptr, cos, sin, num_kv_heads, half, head_dim, eps,
                                     BLOCK_HKV, BLOCK_HALF)  # fmt: skip
        dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        offs_h = tl.arange(0, BLOCK_HKV)
        kdst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(kdst, _to_cache(k1, k_scale, QUANT).to(cache_ptr.dtype.element_ty), mask=kmask)
        tl.store(kdst + half, _to_cache(k2, k_scale, QUANT).to(cache_ptr.dtype.element_ty), mask=kmask)
        offs_full = tl.arange(0, 2 * BLOCK_HALF)
        vmask = (offs_h[:, None] < num_kv_heads) & (offs_full[None, :] < head_dim)
        v = tl.load(kbase + num_kv_heads * head_dim + offs_h[:, None] * head_dim + offs_full[None, :], mask=vmask)
        vdst = dst + stride_ckv + offs_h[:, None] * stride_ch + offs_full[None, :]
        tl.store(vdst, _to_cache(v, v_scale, QUANT).to(cache_ptr.dtype.element_ty), mask=vmask)


def qk_norm_rope_and_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (rows q || k || v, a contiguous last dim) -> the normed, rotated query
    [T, Hq, D]; the normed, rotated key and the value go to kv_cache [blocks, 2, block_size, Hkv, D] at
    slot_mapping (-1: padding, not stored), quantized with k_scale / v_scale into an FP8 cache."""
    num_tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, ({num_heads} + 2 x {num_kv_heads}) x {head_dim}] "
                         "with a contiguous last dim")
    if head_dim % 2 or k_weight.shape != (head_dim,) or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"q/k norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} and the cos/sin "
                         f"table {tuple(cos_sin_cache.shape)} need one even head_dim")
    if tuple(kv_cache.shape[1:]) != (2, kv_cache.shape[2], num_kv_heads, head_dim):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [blocks, 2, block_size, {num_kv_heads}, {head_dim}]")
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(half)
    quant = kv_cache.dtype == torch.float8_e4m3fn
    _qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, q_weight, k_weight, cos_sin_cache, q_out, kv_cache, slot_mapping,
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), *kv_cache.stride()[:4],
        num_heads, num_kv_heads, half, head_dim, kv_cache.shape[2], eps, float(k_scale), float(v_scale),
        BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half, QUANT=quant,
        num_warps=max(1, min(8, block_hq * block_half * 2 // 256)), **pdl_options(qkv.device),
    )  # fmt: skip
    return q_out
