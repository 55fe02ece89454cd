"""Fused MoE experts in triton: two grouped GEMMs over tokens sorted by expert.

In the spirit of vLLM's / SGLang's fused_moe: the slots (token, k-th choice) are grouped by expert and
padded so that every block of BLOCK_M rows belongs to one expert (routing.sort_by_expert); each program
multiplies one such block by one BLOCK_N slice of that expert's weights, so a grouped GEMM over all
experts is a single launch whose grid does not depend on the routing (CUDA-graph friendly).

- pass 1 (gate_up): rows gathered from hidden (token = slot // top_k), the gate and up columns of the
  same tile accumulated side by side, SiLU-and-mul applied in the epilogue; the [rows, I] result is
  written in sorted order, so pass 2 reads it contiguously.
- pass 2 (down): rows read in sorted order, the result scaled by the slot's routing weight in the
  epilogue and scattered to the slot's row of a [T * top_k, H] buffer.
- combine: the k rows of each token summed in float32 (a plain reduction, deterministic, no atomics).

Rounding follows kernels/moe/torch_ref.py: every value that the reference holds in the activation dtype
is rounded here too. Importing this module imports triton; the dispatch imports it only when chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.moe.routing import ExpertBlocks, sort_by_expert


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr, weights_ptr,
    num_slots, stride_am, stride_we, stride_wn, stride_om,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: rows [pid_m * BLOCK_M, +BLOCK_M) of the sorted slots (one expert) times columns
    [pid_n * BLOCK_N, +BLOCK_N) of that expert's weight [N(, +N for up), K] transposed."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst case; blocks past the real padded length do nothing
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows).to(tl.int64)
    valid = slots < num_slots
    if GATE_UP:
        a_rows = slots // TOP_K  # hidden row of the slot's token
    else:
        a_rows = rows.to(tl.int64)  # pass 1 wrote its output in sorted order
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    # tl.full, not tl.zeros: triton.language's @jit helpers (zeros, cdiv, sigmoid) break the CPU
    # interpreter when triton was imported before TRITON_INTERPRET=1; builtins do not.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATE_UP:  # the up rows sit N rows below the gate rows of the same expert
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, (act * up).to(dtype), mask=n_mask[None, :])
    else:
        weight = tl.load(weights_ptr + slots, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        out_ptrs = out_ptr + slots[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, y.to(dtype), mask=valid[:, None] & n_mask[None, :])


def pick_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: small when experts get few tokens each (decode), where padding would dominate."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks,
                 topk_weights: torch.Tensor, top_k: int, gate_up: bool, block_n: int, block_k: int) -> None:  # fmt: skip
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    k = w.shape[2]
    if a.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("fused_experts needs a contiguous last dimension in activations and weights")
    grid = (blocks.block_experts.numel(), triton.cdiv(n, block_n))
    _expert_gemm_kernel[grid](
        a, w, out, blocks.sorted_slots, blocks.block_experts, blocks.num_padded, topk_weights,
        blocks.num_slots, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        N=n, K=k, TOP_K=top_k, GATE_UP=gate_up, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights float32 / topk_ids int [T, k] -> [T, H] in hidden's dtype. Block sizes of at least 16
    (tl.dot's minimum on NVIDIA GPUs)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    block_m = block_m or pick_block_m(num_tokens * top_k, num_experts)
    blocks = sort_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(blocks.sorted_slots.numel(), two_i // 2, dtype=hidden.dtype, device=hidden.device)
    _expert_gemm(hidden, w13, act, blocks, weights, top_k, True, block_n, block_k)
    per_slot = torch.empty(blocks.num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _expert_gemm(act, w2, per_slot, blocks, weights, top_k, False, block_n, block_k)
    return per_slot.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
