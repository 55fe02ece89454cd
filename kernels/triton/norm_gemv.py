"""A pre-norm block's RMSNorm folded into the one-row linear layer that reads it (batch-1 decode).

At batch 1 an RMSNorm of one row is a launch of a single program that reads 4-8 KB: on an H200 inside a CUDA graph
Qwen3-30B-A3B's 97 norms per step took 185 us of device time and the gaps before the next launch 43 us more, of a
3.4 ms step (profile_step, docs/performance.md, seventeenth session). Here every program of the matrix-vector kernel
(kernels/triton/gemv.py) first takes the row's statistics itself (the row is 2-8 KB, read from L2 by each program),
normalizes the columns it multiplies as it reads them, and writes its share of the sum x + residual (the next
block's residual) and, where another kernel also reads it, of the normalized row. The numbers are the unfused
kernels' (kernels/triton/fused.py's norm, then gemv): the sum is rounded to the activations' dtype, the statistics
taken in float32, the normalized row rounded before and after the weight product, as the reference does.

`norm_router_topk` also ends a MoE block's router there: the last of the router's programs to finish (arrival
counters, kernels/arrivals.py) reads every expert's logit and runs the softmax top-k (kernels/moe/triton_routing.py
softmax_topk), so the norm, the router and the routing are one launch instead of three.

kernels/linear.py decides when these run: only with FLOTILLA_NORM_GEMV=1, since the first form measured slower than
the separate launches on an H200 (kernels/linear.py NORM_GEMV has the numbers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.arrivals import arrival_counters
from flotilla.kernels.moe.triton_routing import MAX_EXPERTS, softmax_topk
from flotilla.kernels.triton.gemv import BLOCK_K, NUM_WARPS, _rows_per_program


@triton.jit
def _summed(x_ptr, res_ptr, offs, mask, HAS_RES: tl.constexpr):
    """x[offs] (+ residual[offs], rounded to x's dtype as the norm kernel's sum is) in float32, 0 where masked."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h.to(tl.float32)


@triton.jit
def _normed(h, rstd, nw_ptr, offs, mask, dtype: tl.constexpr):
    """The norm's output at offs in float32: (h * rstd) rounded, times the weight, rounded (as kernels/norm.py)."""
    w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return ((h * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _norm_gemv(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, normed_ptr, res_out_ptr, N, K, eps, stride_wn,
               HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_NORMED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SLICE: tl.constexpr):  # fmt: skip
    """Program pid's share: out[rows] = norm(x + residual) @ W[rows].T (+ b), rows = [pid * BLOCK_N, +BLOCK_N), and
    columns [pid * SLICE, +SLICE) of x + residual (HAS_RES) and of the normalized row (WRITE_NORMED)."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if BLOCK_K >= K:
        # the row in one K step: the weight tile is loaded first, so that its read from memory overlaps the row's
        # statistics (with the statistics first, every program waited for them before reading its weights: 12.8 us
        # for Qwen3-30B-A3B's q/k/v on an H200 against 5.8 for gemv alone); the same values as the loops below
        k_mask = offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        h = _summed(x_ptr, res_ptr, offs_k, k_mask, HAS_RES)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / K + eps)
        xn = _normed(h, rstd, nw_ptr, offs_k, k_mask, dtype)
        y = tl.sum(w.to(tl.float32) * xn[None, :], axis=1)
    else:
        sq = tl.full((BLOCK_K,), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _summed(x_ptr, res_ptr, k0 + offs_k, k0 + offs_k < K, HAS_RES)
            sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
        acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + offs_k < K
            h = _summed(x_ptr, res_ptr, k0 + offs_k, k_mask, HAS_RES)
            xn = _normed(h, rstd, nw_ptr, k0 + offs_k, k_mask, dtype)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += w * xn[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)

    if HAS_RES or WRITE_NORMED:
        offs_s = pid * SLICE + tl.arange(0, SLICE)
        s_mask = offs_s < K
        h = _summed(x_ptr, res_ptr, offs_s, s_mask, HAS_RES)
        if HAS_RES:
            tl.store(res_out_ptr + offs_s, h.to(dtype), mask=s_mask)
        if WRITE_NORMED:
            tl.store(normed_ptr + offs_s, _normed(h, rstd, nw_ptr, offs_s, s_mask, dtype).to(dtype), mask=s_mask)


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, normed_ptr, res_out_ptr, N, K, eps, stride_wn,
                      HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_NORMED: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr):  # fmt: skip
    """norm_gemv: _norm_gemv's share of each program."""
    _norm_gemv(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, normed_ptr, res_out_ptr, N, K, eps, stride_wn,
               HAS_RES, HAS_BIAS, WRITE_NORMED, BLOCK_N, BLOCK_K, SLICE)


@triton.jit
def _norm_router_topk_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, logits_ptr, normed_ptr, res_out_ptr, weights_ptr,
                             ids_ptr, count_ptr, E, K, eps, stride_wn, HAS_RES: tl.constexpr, TOP_K: tl.constexpr,
                             RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SLICE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):  # fmt: skip
    """norm_router_topk: _norm_gemv's share (the router's logits, in x's dtype as the linear layer gives them), then
    the last program to finish reads all E logits and stores the softmax top-k; count_ptr[0] back at 0."""
    _norm_gemv(x_ptr, res_ptr, nw_ptr, w_ptr, w_ptr, logits_ptr, normed_ptr, res_out_ptr, E, K, eps, stride_wn,
               HAS_RES, False, True, BLOCK_N, BLOCK_K, SLICE)
    tl.debug_barrier()  # every thread's logits stored before the count publishes them
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < tl.where(last, E, 0)
    # ".cg": from L2, where the other programs' logits are
    logits = tl.load(logits_ptr + cols, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    top_w, top_id = softmax_topk(logits[None, :], cols, cols < E, E, TOP_K, RENORMALIZE, BLOCK_TOPK)
    ks = tl.arange(0, BLOCK_TOPK)
    out_mask = ks < tl.where(last, TOP_K, 0)
    tl.store(weights_ptr + ks, tl.reshape(top_w, (BLOCK_TOPK,)), mask=out_mask)
    tl.store(ids_ptr + ks, tl.reshape(top_id, (BLOCK_TOPK,)), mask=out_mask)
    tl.atomic_xchg(count_ptr, 0, mask=last)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
            block_k: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:  # fmt: skip
    """Checks, and (x's row, residual's row or x's, the new residual, rows per program, BLOCK_K, SLICE: at least 16
    columns, so that no program has a slice narrower than a vector load)."""
    n, k = weight.shape
    row = x.reshape(-1)
    if row.numel() != k or norm_weight.numel() != k:
        raise ValueError(f"norm_gemv takes one row of {k} values and a norm of as many, not x {tuple(x.shape)}")
    if residual is not None and (residual.numel() != k or residual.dtype != x.dtype):
        raise ValueError("the residual must be one row of x's size and dtype")
    if not row.is_contiguous() or weight.stride(1) != 1 or (residual is not None and not residual.is_contiguous()):
        raise ValueError("norm_gemv needs contiguous rows")
    bn = _rows_per_program(n)
    programs = triton.cdiv(n, bn)
    res_row = residual.reshape(-1) if residual is not None else row
    new_res = torch.empty_like(row) if residual is not None else row
    slice_ = max(16, triton.next_power_of_2(triton.cdiv(k, programs)))
    return row, res_row, new_res, bn, min(block_k or BLOCK_K, triton.next_power_of_2(k)), slice_


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(x + residual) @ weight.T (+ bias), x + residual) for one row x [1, K] (residual None: the norm of x,
    and x itself is the residual returned), the norm kernels' numbers and then gemv's, in one launch (block_k: a
    narrower K step, for tests)."""
    row, res_row, new_res, bn, bk, sl = _launch(x, residual, norm_weight, weight, block_k)
    n, k = weight.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _norm_gemv_kernel[(triton.cdiv(n, bn),)](
        row, res_row, norm_weight, weight, bias if bias is not None else weight, out, out, new_res, n, k, eps,
        weight.stride(0), HAS_RES=residual is not None, HAS_BIAS=bias is not None, WRITE_NORMED=False,
        BLOCK_N=bn, BLOCK_K=bk, SLICE=sl, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n), new_res.view(x.shape)


def norm_router_topk(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     router_weight: torch.Tensor, top_k: int, renormalize: bool, *, block_k: int | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """For one row x [1, K]: (the normalized row [1, K], x + residual [1, K], routing weights float32 [1, top_k],
    expert ids int32 [1, top_k]) as rms_norm, then the router's linear layer, then routing.select_experts would give
    them, in one launch; None when the device's arrival counters are not made yet (during a first CUDA graph
    capture: the caller runs the unfused kernels)."""
    num_experts = router_weight.shape[0]
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: needs 1 <= top_k <= E <= {MAX_EXPERTS}")
    counters = arrival_counters(x.device)
    if counters is None:
        return None
    row, res_row, new_res, bn, bk, sl = _launch(x, residual, norm_weight, router_weight, block_k)
    k = row.numel()
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(row)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    _norm_router_topk_kernel[(triton.cdiv(num_experts, bn),)](
        row, res_row, norm_weight, router_weight, logits, normed, new_res, weights, ids, counters, num_experts, k,
        eps, router_weight.stride(0), HAS_RES=residual is not None, TOP_K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_N=bn, BLOCK_K=bk, SLICE=sl, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_TOPK=triton.next_power_of_2(top_k), num_warps=NUM_WARPS,
    )  # fmt: skip
    return normed.view(x.shape), new_res.view(x.shape), weights, ids
