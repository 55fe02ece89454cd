"""Triton fused elementwise kernels of a decoder layer: RMSNorm (with the residual add fused in),
SiLU-and-mul, and neox RoPE fused with writing K/V into the paged cache.

Each is memory-bound, so fusing is what makes it fast: the residual add + norm reads the activations
once instead of three times, and RoPE + store_kv writes the rotated K straight into its cache slot
instead of materializing it and reading it back. The torch references (kernels/norm.py,
kernels/activation.py, kernels/rope.py, kernels/attention/torch_ref.store_kv) define the semantics,
including where they round: every intermediate that the reference materializes in the activation
dtype is rounded to that dtype here too, so bf16 results agree to the last bit in almost all elements.
Into an FP8 (e4m3) cache the store quantizes like the reference (kernels/attention/fp8_kv.py): the rotated
key, rounded to the activation dtype, divided by k_scale in float32 and clamped to +-448 (v likewise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX, is_fp8
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior


def _warps(block: int) -> int:
    """Enough warps that each thread holds ~8-16 elements of a row (bounded to 1..16)."""
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """One program per row: (x + residual ->) float32 statistics -> normalize -> round -> * weight."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)  # the reference rounds before the weight product
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with a contiguous last dim (a view when possible)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x [+ residual]), x + residual or None), in the dtypes torch's promotion gives the reference."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = _rows(x)
    norm_in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, norm_in_dtype), device=x.device)
    out2 = out.view(-1, hidden)
    res_out = None
    if residual is None:
        r2 = res_out2 = x2  # placeholders: HAS_RESIDUAL=False never touches them
    else:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=norm_in_dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out2, res_out2,
            x2.stride(0), r2.stride(0), out2.stride(0), res_out2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block), **pdl_options(x.device),
        )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.rms_norm in one pass: x [..., H] -> [..., H]."""
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.norm.fused_add_rms_norm in one pass: (rms_norm(x + residual), x + residual), new tensors
    (the inputs are not modified, as in the reference)."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    out, new_residual = _norm(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """Program (row, column tile): silu(gate) rounded to the activation dtype (as F.silu returns it),
    times up, rounded again."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul: x [..., 2*I] laid out gate || up -> [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not gate || up (odd)")
    inter = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, num_warps=_warps(block)
        )
    return out


@triton.jit
def _quantize(x, scale, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """x in float32 as a cache stores it before the cast: x / scale clamped to +-FP8_MAX for an FP8 cache
    (QUANT), else x itself (exact: the values are already in x's dtype, so casting on changes nothing)."""
    y = x.to(tl.float32)
    if QUANT:
        y = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
    return y


@triton.jit
def _rotate_heads(x_ptr, dst_ptr, token, stride_xt, stride_xh, stride_dh, num_heads, half, cos, sin, dst_scale,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr = False,
                  FP8_MAX: tl.constexpr = 448.0):  # fmt: skip
    """Neox-rotate all heads of one token (x1*cos - x2*sin || x2*cos + x1*sin, in float32, rounded to
    x's dtype as the reference does) and store at dst_ptr + head * stride_dh (+ half for the 2nd half);
    QUANT: quantized for an FP8 destination with dst_scale."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out1 = _quantize((x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), dst_scale, QUANT, FP8_MAX)
    out2 = _quantize((x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), dst_scale, QUANT, FP8_MAX)
    out1 = out1.to(dst_ptr.dtype.element_ty)
    out2 = out2.to(dst_ptr.dtype.element_ty)
    dst = dst_ptr + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, out1, mask=mask)
    tl.store(dst + half, out2, mask=mask)


@triton.jit
def _cos_sin(cos_sin_ptr, pos_ptr, token, stride_cos, half, BLOCK_HALF: tl.constexpr):
    """The token's rotary cos and sin halves ([1, BLOCK_HALF] float32 each) from the table row of its position."""
    offs_d = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + tl.load(pos_ptr + token) * stride_cos
    cos = tl.load(row + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_heads, num_kv_heads, half, block_size, k_scale, v_scale,
    STORE_KV: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate q into q_out; rotate k into its cache slot and copy v there
    (STORE_KV, slot -1 skipped; QUANT: quantized with k_scale / v_scale for an FP8 cache), or rotate k into
    k_out."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, pos_ptr, token, stride_cos, half, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr + token * stride_qot, token, stride_qt, stride_qh, stride_qoh,
                  num_heads, half, cos, sin, 1.0, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    if STORE_KV:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
            _rotate_heads(k_ptr, dst, token, stride_kt, stride_kh, stride_ch,
                          num_kv_heads, half, cos, sin, k_scale, BLOCK_HKV, BLOCK_HALF, QUANT, FP8_MAX)  # fmt: skip
            offs_h = tl.arange(0, BLOCK_HKV)
            offs_full = tl.arange(0, 2 * BLOCK_HALF)
            mask = (offs_h[:, None] < num_kv_heads) & (offs_full[None, :] < 2 * half)
            v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_full[None, :], mask=mask)
            vdst = dst + stride_ckv + offs_h[:, None] * stride_ch + offs_full[None, :]
            tl.store(vdst, _quantize(v, v_scale, QUANT, FP8_MAX).to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr, k_out_ptr + token * stride_kot, token, stride_kt, stride_kh, stride_koh,
                      num_kv_heads, half, cos, sin, 1.0, BLOCK_HKV, BLOCK_HALF)  # fmt: skip


def _check_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rope needs one even head_dim for q {tuple(q.shape)}, k {tuple(k.shape)} and the cos/sin table "
            f"{tuple(cos_sin_cache.shape)}"
        )
    if q.shape[0] != positions.shape[0] or k.shape[0] != positions.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {q.shape[0]} q and {k.shape[0]} k tokens")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim")


def _launch_rope(positions, q, k, v, cos_sin_cache, q_out, k_out, kv_cache, slot_mapping, store_kv: bool,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    cache_strides = kv_cache.stride()[:4] if store_kv else (0, 0, 0, 0)
    block_hq = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, q_out, k_out, kv_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        *cache_strides,
        num_heads, num_kv_heads, half, kv_cache.shape[2] if store_kv else 1, float(k_scale), float(v_scale),
        STORE_KV=store_kv, BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, QUANT=store_kv and is_fp8(kv_cache.dtype), FP8_MAX=FP8_KV_MAX,
        num_warps=_warps(block_hq * block_half * 2),
    )  # fmt: skip


def apply_rope(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rope.apply_rope in one launch: rotated copies of query [T, Hq, D] and key [T, Hkv, D]."""
    _check_rope(positions, query, key, cos_sin_cache)
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    _launch_rope(positions, query, key, key, cos_sin_cache, q_out, k_out, key, positions, store_kv=False)
    return q_out, k_out


def rope_and_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """apply_rope then store_kv in one launch: returns the rotated query [T, Hq, D]; the rotated key and
    the value go straight into kv_cache at slot_mapping (-1 = padding, not stored), as
    kernels.attention.torch_ref.store_kv(rotated key, value, ..., k_scale, v_scale) would write them."""
    _check_rope(positions, query, key, cos_sin_cache)
    num_kv_heads, head_dim = key.shape[1:]
    if value.shape != key.shape or value.stride(-1) != 1:
        raise ValueError(f"value {tuple(value.shape)} must match key {tuple(key.shape)} with a contiguous last dim")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not hold {num_kv_heads} heads of {head_dim}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache needs a contiguous head_dim")
    q_out = torch.empty_like(query)
    _launch_rope(positions, query, key, value, cos_sin_cache, q_out, q_out, kv_cache, slot_mapping, store_kv=True,
                 k_scale=k_scale, v_scale=v_scale)
    return q_out
