"""One-row linear layers (y = x W^T for a single token) as a triton matrix-vector kernel.

At batch-1 decode every linear layer is a matrix-vector product, bound by reading W once. cuBLAS picks GEMM tiles
for these, and for a MoE model's attention projections and router reaches under half the memory bandwidth (o_proj
split over K with a second launch for its reduction). Here each program owns BLOCK_N output rows and reads them
whole, in BLOCK_K-wide steps, into a [BLOCK_N, BLOCK_K] float32 accumulator that is summed once at the end: wide
steps keep many loads in flight per program, and the grid (N / BLOCK_N programs) needs no split of K and so no second
launch.

kernels/linear.py decides when this runs (one row on CUDA in bf16 / fp16, unless FLOTILLA_GEMV=0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla import envs
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior

BLOCK_N = 4
BLOCK_K = envs.FLOTILLA_GEMV_BLOCK_K  # (the kernel's compile-time tile: read once at import; a sweep sets the variable)
NUM_WARPS = 8
"""BLOCK_N x BLOCK_K x NUM_WARPS is the fastest tiling bench_kernels' gemv bench found at Qwen3-30B-A3B's and
Qwen3-8B's shapes, in CUDA graphs and inside the engine's batch-1 step."""


MIN_PROGRAMS = 256
"""Fewer rows per program than BLOCK_N when N / BLOCK_N programs would be fewer than this (about two per SM of a
Hopper GPU): a short weight such as DeepSeek-V3's float32 router (256 rows of 7,168) as 64 programs of 4 rows
leaves most SMs idle and reads no faster than cuBLAS; as 256 programs of 1 row, it reads at the kernel's usual
bandwidth."""


def _rows_per_program(n: int) -> int:
    bn = BLOCK_N
    while bn > 1 and triton.cdiv(n, bn) < MIN_PROGRAMS:
        bn //= 2
    return bn


@triton.jit
def row_products(x_ptr, w_ptr, offs_n, n_mask, K, k_end, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N]: x[:k_end] . W[offs_n, :k_end] for the rows of offs_n where n_mask holds (k_end <= K, the
    steps' bound; k_end 0: zeros, nothing read), in BLOCK_K-wide steps into a [BLOCK_N, BLOCK_K] float32 accumulator
    summed once at the end (no tl.dot, whose 16-row minimum would waste 15/16 of a tile on one row). Also the
    small-batch MoE experts' down pass per slot (kernels/moe/triton_experts_small.py)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < k_end - k_tile * BLOCK_K
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_GDC: tl.constexpr = False, ONE_STEP: tl.constexpr = False):  # fmt: skip
    """Program pid: out[rows] = x @ W[rows].T (+ b[rows]), rows = [pid * BLOCK_N, +BLOCK_N); x is one row of K.
    USE_GDC (kernels/triton/pdl.py): launched with PDL, the weight tile (K in ONE_STEP) is read before the wait for
    the kernel that wrote x, so that its read from memory overlaps that kernel's end (the same values)."""
    pid = tl.program_id(0)
    launch_next(USE_GDC)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if USE_GDC and ONE_STEP:
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        wait_prior(USE_GDC)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    else:
        wait_prior(USE_GDC)
        y = row_products(x_ptr, w_ptr, offs_n, n_mask, K, K, stride_wn, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """x [1, K] (or [K]) @ weight [N, K].T (+ bias [N]) -> [1, N] (or [N]) in out_dtype (default x's), accumulated in
    float32; x and the weight may differ in dtype (each is widened to float32 as it is read)."""
    n, k = weight.shape
    row = x.reshape(-1)
    if row.numel() != k:
        raise ValueError(f"gemv takes one row of {k} values, not x of shape {tuple(x.shape)}")
    if not row.is_contiguous() or weight.stride(1) != 1:
        raise ValueError("gemv needs a contiguous x and weight rows")
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    bn = block_n or _rows_per_program(n)
    bk = min(block_k or BLOCK_K, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, bn),)](
        row, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or NUM_WARPS, ONE_STEP=bk >= k,
        **pdl_options(x.device),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
