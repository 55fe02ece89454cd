"""FP8 block-scaled linear layers for a few rows (decode at small batch) as a triton matrix-vector kernel, W8A16.

At batch-1 decode a DeepSeek-V3 linear layer is a matrix-vector product bound by reading its e4m3 weight once. The
block-scaled GEMM of fp8_triton.py runs it as tl.dot tiles of 16 rows (15 of them padding), splits K to find enough
programs, and needs two more launches: the activation's quantization before and the split-K sum after. On an H200,
DeepSeek-V3-4L's batch-1 step spent 391 us in 24 such GEMMs, 42 us in 30 quantizations and 31 us in 19 split-K
sums to read 1.2 GB of FP8 weights (3.1 TB/s; profile_step, docs/performance.md, tenth session).

Here each program owns BLOCK_N output rows (inside one weight block row, so one scale per K block) and reads them
whole, BLOCK_K columns a step, into a float32 accumulator summed once at the end, as kernels/triton/gemv.py does for
bf16: one launch per linear. The activations are not quantized (W8A16): each is multiplied by its weight block's
scale in float32 and the e4m3 weights are widened to float32, so the result is the dequantized layer's
(fp8_ref.fp8_block_linear, the torch backend's) up to float32 summation order, closer to it than the W8A8 GEMM, whose
activation rounding to e4m3 costs about 2% (relative norm) at DeepSeek-V3's sizes.

A few rows (BLOCK_M, up to MAX_ROWS) share each weight load: the accumulator is [BLOCK_M, BLOCK_N, BLOCK_K / BLOCK_M].
fp8_triton.fp8_block_linear sends rows on CUDA here while there are at most MAX_ROWS of them (FLOTILLA_FP8_GEMV=0: never).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
"""Up to this many rows fp8_triton.fp8_block_linear takes this kernel on CUDA (unless FLOTILLA_FP8_GEMV=0)."""

GEMV = os.environ.get("FLOTILLA_FP8_GEMV", "1") != "0"
"""Whether small-row FP8 products run this kernel (read at import; benchmarks flip it in place)."""

BLOCK_N = 4
BLOCK_K = 4096
NUM_WARPS = 8
"""Tiles for one row: 4 x 4,096 e4m3 values (16 KB) a step, the bytes in flight of gemv.py's 4 x 2,048 bf16 tiling,
which was the fastest of five for bf16 on an H200. With BLOCK_M rows, BLOCK_K / BLOCK_M columns a step keep the
accumulator at 64 registers a thread. Not yet measured on the GPU (bench_kernels --only fp8_gemm sweeps it)."""


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                     BLOCK_SCALE_N: tl.constexpr, BLOCK_SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Program pid: out[:M, rows] = x[:M] @ (W[rows] * scales).T (+ b[rows]), rows = [pid * BLOCK_N, +BLOCK_N),
    all in one block row of the weight (BLOCK_N divides BLOCK_SCALE_N)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    scale_row = (pid * BLOCK_N) // BLOCK_SCALE_N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k = k_tile * BLOCK_K + offs_k
        k_ok = k < K
        # the weight block scale of each column (BLOCK_K / BLOCK_SCALE_K distinct values, from L1)
        s = tl.load(s_ptr + scale_row * stride_sn + k // BLOCK_SCALE_K, mask=k_ok, other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * s[None, :]
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
             block_size: tuple[int, int] = (128, 128), *, block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., K] (at most MAX_ROWS rows in all; a contiguous last dimension) @ dequant(weight e4m3 [N, K],
    scale_inv float32 [ceil(N / bn), ceil(K / bk)]).T (+ bias [N]) -> [..., N] in x's dtype, accumulated in float32.
    block_n (a power of two dividing the weight's block rows) and block_k (the single-row step) override the tiles."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, not {m}")
    if x2.stride(-1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8_gemv needs a contiguous last dimension in x and the weight")
    bn = block_n or BLOCK_N
    if bn & (bn - 1) or block_size[0] % bn:
        raise ValueError(f"fp8_gemv's block_n {bn} must be a power of two dividing the weight's block rows "
                         f"({block_size[0]})")  # fmt: skip
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    block_m = triton.next_power_of_2(m)
    bk = min(max((block_k or BLOCK_K) // block_m, 16), triton.next_power_of_2(k))
    scale_inv = scale_inv if scale_inv.dtype == torch.float32 and scale_inv.stride(1) == 1 else scale_inv.float().contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x2, weight, scale_inv, bias if bias is not None else out, out, m, n, k,
        x2.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_SCALE_N=block_size[0], BLOCK_SCALE_K=block_size[1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    return out.view(*lead, n)
