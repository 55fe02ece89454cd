"""A block-scaled FP8 GEMM in triton: y = dequant(x_fp8, x_scales) @ dequant(w_fp8, w_scale_inv)^T.

The activation is quantized per token and group of block_k columns, in one launch of its own
(kernels/quant/fp8_quant_triton.py, exactly kernels/quant/fp8_ref.py's values; not fused into the GEMM yet). The kernel tiles the output in BLOCK_M x BLOCK_N, walks
K one weight block (BLOCK_K = block_k) at a time, multiplies the e4m3 tiles on the tensor cores with a
float32 accumulator and scales each partial product by its tokens' group scales times the weight
block's scale before adding it (BLOCK_N divides block_n, so a tile meets one weight block per K step).
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (set before this module is imported) at tiny sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize
from flotilla.kernels.quant.fp8_ref import num_blocks


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K: tl.constexpr,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    BLOCK_SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    scale_row = (pid_n * BLOCK_N) // BLOCK_SCALE_N  # the weight block row this tile lies in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // BLOCK_K
        k = k0 + rk
        k_ok = k < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + rm * stride_asm + kb, mask=m_ok, other=0.0)
        b_scale = tl.load(b_scale_ptr + scale_row * stride_bsn + kb)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def tile_sizes(m: int, block_size: tuple[int, int]) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for m tokens: BLOCK_K is the weight's block_k, BLOCK_N divides block_n."""
    bn, bk = block_size
    if bk < 16 or bk & (bk - 1) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"the triton FP8 GEMM needs power-of-two blocks of at least 16, got {bn}x{bk}")
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, min(bn, 128), bk


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                     block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:  # fmt: skip
    """y = x W^T (+ b) with x quantized per token group and W's e4m3 blocks, accumulated in float32;
    x [..., K] -> [..., N] in x's dtype."""
    n, k = weight.shape
    if scale_inv.shape != (num_blocks(n, block_size[0]), num_blocks(k, block_size[1])):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit a [{n}, {k}] weight in "
                         f"{block_size[0]}x{block_size[1]} blocks")  # fmt: skip
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    a, a_scale = per_token_group_quantize(x2, block_size[1])
    weight, scale_inv = weight.contiguous(), scale_inv.float().contiguous()
    block_m, block_n, block_k = tile_sizes(m, block_size)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        a, a_scale, weight, scale_inv, bias if bias is not None else out, out,
        m, n, k,
        a.stride(0), a_scale.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_SCALE_N=block_size[0], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out.view(*lead, n)
