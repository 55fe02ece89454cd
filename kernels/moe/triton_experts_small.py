"""Fused MoE experts for decode-sized batches: token-major, no sorting, the combine inside the down pass.

At batch 1 the sorted grouped GEMMs of kernels/moe/triton_experts.py spend much of a MoE layer on things other
than reading the experts: the grouping of the slots, a combine launch, and GEMM tiles of 16 rows for one token.
Here the same computation is two launches that need no grouping:

- gate_up: one program per (slot, BLOCK_N columns of the intermediate size); it reads its token's row and the
  expert's gate and up rows of those columns, and writes silu(gate) * up for the slot. Slots with a negative
  expert id (expert parallelism's masked routing) write nothing.
- down: one program per (token, BLOCK_N columns of the hidden size); it steps along K through all of the token's
  top-k slots at once, rounds and weights each slot's product as the reference does, and sums them in float32 in
  registers, so the token's output is written once, already combined. Or (the default at one token,
  ONE_TOKEN_DOWN; FLOTILLA_MOE_TILES "ds=1" at any size): one program per (slot, BLOCK_N columns), top-k times the
  programs, each writing its slot's weighted row; the last of a token's programs of those columns to finish
  (kernels/arrivals.py) sums the rows in slot order. At one token the token-major down pass is only hidden /
  BLOCK_N programs (128 at Qwen3-30B-A3B's 2,048), too few to read the weights at full bandwidth.

Both are matrix-vector products: the weights are multiplied elementwise and summed along K in float32 (a
[BLOCK_N, BLOCK_K] accumulator reduced once at the end), with no tl.dot, whose 16-row minimum would waste 15/16
of every tile at one token. Each slot reads its expert's weights itself: two tokens routed to the same expert read
it twice (from L2 when close together), which is why this path is for a few tokens only (SMALL_BATCH_MAX_TOKENS;
beyond it the sorted GEMMs read each expert once). The grid depends on the number of tokens alone, so CUDA graphs
capture it.

Rounding follows kernels/moe/torch_ref.py, as the sorted kernels do: gate, up and the activation rounded to the
activation dtype, each slot's down product rounded, weighted in float32 and rounded, the k outputs summed in float32
and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.arrivals import MAX_ARRIVAL_COUNTERS, arrival_counters
from flotilla.kernels.triton.gemv import row_products
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior

SMALL_BATCH_MAX_TOKENS = 4
"""Batches of at most this many tokens take this path in triton_experts.fused_experts (bf16/fp16/fp32 weights);
the `small_tokens` tile (FLOTILLA_MOE_TILES "t=N", 0 to turn it off) overrides it for tuning sweeps."""

ONE_TOKEN_DOWN = {"per_slot": 1, "block_n": 32}
"""The down pass of a one-token batch (triton_experts.fused_experts' default there): a program per (slot, 32 columns),
512 programs at Qwen3-30B-A3B's 2,048 columns and top-8, where the token-major pass has 128, so the weights are read
at a higher bandwidth. Two to four tokens keep the token-major pass (no faster per slot there)."""

DEFAULT_BLOCK_N = 16
DEFAULT_BLOCK_K = 128
NUM_WARPS = 8
"""Warps per program of both passes unless the launch options say otherwise. The down pass holds a [top_k, BLOCK_N,
BLOCK_K] float32 accumulator, which 8 warps keep at 64 registers a thread at the default tiles and top-8; the
gate_up pass is faster with 8 warps than with triton's default 4 too."""


@triton.jit
def _small_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr, stride_xm, stride_we, stride_wn, stride_om,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False, SWIGLU_LIMIT: tl.constexpr = 0.0,
):  # fmt: skip
    """Program (slot, pid_n): out[slot, cols] = silu(x[token] @ gate[cols].T) * (x[token] @ up[cols].T) for the
    slot's expert, cols = [pid_n * BLOCK_N, +BLOCK_N) of the intermediate size N; up's rows sit N below gate's.
    SWIGLU_LIMIT > 0: gate clamped to at most it and up to within +-it first."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    if expert < 0:
        return  # a masked slot: the down pass skips it
    token = slot // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + offs_k
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # tl.full, not tl.zeros: see triton_experts.py (the CPU interpreter and triton.language's @jit helpers)
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k_tile * BLOCK_K
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        w_up = tl.load(w_ptrs + N * stride_wn, mask=mask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
        acc_up += w_up * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    if SWIGLU_LIMIT > 0:
        gate = tl.minimum(gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + slot * stride_om + offs_n, (act * up).to(dtype), mask=n_mask)


@triton.jit
def _small_down_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, stride_am, stride_we, stride_wn, stride_om,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """Program (token, pid_n): out[token, cols] = sum over the token's slots of weight * (act[slot] @ w2[cols].T),
    cols = [pid_n * BLOCK_N, +BLOCK_N) of the hidden size N, K the intermediate size; masked slots add nothing.
    All TOP_K slots advance together along K (a [TOP_K, BLOCK_N, BLOCK_K] step): at one token the grid is only
    N / BLOCK_N programs, and one slot at a time would leave too few loads in flight to read at full bandwidth."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_j = tl.arange(0, TOP_K_P2)
    slots = token * TOP_K + offs_j
    experts = tl.load(ids_ptr + slots, mask=offs_j < TOP_K, other=-1).to(tl.int64)
    valid = experts >= 0  # a masked slot (or a padding one past TOP_K) loads nothing and adds 0 * 0
    weights = tl.load(weights_ptr + slots, mask=valid, other=0.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slots[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = (w_ptr + tl.maximum(experts, 0)[:, None, None] * stride_we
              + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :])  # fmt: skip
    acc = tl.full((TOP_K_P2, BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w_mask = valid[:, None, None] & n_mask[None, :, None] & k_mask[None, None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)  # each slot's product, rounded
    y = (y * weights[:, None]).to(dtype).to(tl.float32)  # weighted in float32, rounded
    tl.store(out_ptr + token * stride_om + offs_n, tl.sum(y, axis=0).to(dtype), mask=n_mask)


@triton.jit
def _small_down_slot_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, rows_ptr, out_ptr, count_ptr, stride_am, stride_we, stride_wn, stride_rm,
    stride_om, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """Program (slot, pid_n): the slot's weighted product rows[slot, cols] = round(weight * round(act[slot] @
    w2[cols].T)) (0 for a masked slot), cols = [pid_n * BLOCK_N, +BLOCK_N) of the hidden size N; the last of a
    token's TOP_K programs of those columns to finish (kernels/arrivals.py: count_ptr[token, pid_n]) sums the token's
    rows in slot order, in float32, into out[token] and sets the count back to 0. The same numbers as
    _small_down_kernel with TOP_K times the programs: at one token that kernel's grid is N / BLOCK_N programs."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = slot // TOP_K
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    k_end = tl.where(expert >= 0, K, 0)  # a masked slot loads nothing, writes zeros and is counted like the others
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_ptr = act_ptr + slot.to(tl.int64) * stride_am
    w_rows = w_ptr + tl.maximum(expert, 0) * stride_we
    products = row_products(a_ptr, w_rows, offs_n, n_mask, K, k_end, stride_wn, BLOCK_N, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slot, mask=k_end > 0, other=0.0)
    y = products.to(dtype).to(tl.float32)  # the slot's product, rounded
    tl.store(rows_ptr + slot * stride_rm + offs_n, (y * weight).to(dtype), mask=n_mask)  # weighted, rounded
    count = count_ptr + token * tl.num_programs(1) + pid_n
    tl.debug_barrier()  # every thread's part of the row stored before the count publishes it
    last = tl.atomic_add(count, 1, sem="acq_rel") == TOP_K - 1
    total = tl.full((BLOCK_N,), 0.0, tl.float32)
    mask = offs_n < tl.where(last, N, 0)
    for j in range(TOP_K):  # ".cg": from L2, where the other programs' rows are
        row = rows_ptr + (token * TOP_K + j) * stride_rm + offs_n
        total += tl.load(row, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(dtype), mask=mask)
    tl.atomic_xchg(count, 0, mask=last)


def fused_experts_small(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                        launch: dict | None = None, down: dict | None = None,
                        swiglu_limit: float | None = None) -> torch.Tensor:  # fmt: skip
    """torch_ref.fused_experts's contract (negative ids always allowed) in two launches: hidden [T, H], w13
    [E, 2I, H], w2 [E, H, I], topk_weights float32 / topk_ids int [T, k] -> [T, H] in hidden's dtype. Meant for
    T <= SMALL_BATCH_MAX_TOKENS; any T works. block_n / block_k (powers of two) tile both passes unless `down`
    ({"block_n", "block_k", "warps"}, any subset) tiles the down pass otherwise (tuning sweeps); down["per_slot"]
    runs the down pass with a program per slot (_small_down_slot_kernel: the same numbers) where the device's
    arrival counters allow."""
    num_tokens, hidden_size = hidden.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    if hidden.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts needs a contiguous last dimension in activations and weights")
    bn, bk = block_n or DEFAULT_BLOCK_N, block_k or DEFAULT_BLOCK_K
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(ids.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    _small_gate_up_kernel[(ids.numel(), triton.cdiv(inter, bn))](
        hidden, w13, ids, act, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        N=inter, K=hidden_size, TOP_K=top_k, BLOCK_N=bn, BLOCK_K=min(bk, triton.next_power_of_2(hidden_size)),
        **{"num_warps": NUM_WARPS, **(launch or {})}, **pdl_options(hidden.device),
        **({"SWIGLU_LIMIT": float(swiglu_limit)} if swiglu_limit else {}),
    )  # fmt: skip
    down = down or {}
    dn, dk = down.get("block_n", bn), down.get("block_k", bk)
    down_launch = {"num_warps": NUM_WARPS, **(launch or {})}
    if "warps" in down:
        down_launch["num_warps"] = down["warps"]
    grid_n = triton.cdiv(hidden_size, dn)
    counters = arrival_counters(hidden.device) \
        if down.get("per_slot") and num_tokens * grid_n <= MAX_ARRIVAL_COUNTERS else None  # fmt: skip
    if counters is None and down.get("per_slot"):  # no counters (a first capture): token-major, its own tiles
        dn = bn
        grid_n = triton.cdiv(hidden_size, dn)
    if counters is not None:  # a program per slot, the last of a token's adding its rows (the arrival counters)
        rows = torch.empty(ids.numel(), hidden_size, dtype=hidden.dtype, device=hidden.device)
        _small_down_slot_kernel[(ids.numel(), grid_n)](
            act, w2, ids, weights, rows, out, counters, act.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
            out.stride(0), N=hidden_size, K=inter, TOP_K=top_k, BLOCK_N=dn,
            BLOCK_K=min(dk, triton.next_power_of_2(inter)), **down_launch, **pdl_options(hidden.device),
        )  # fmt: skip
        return out
    _small_down_kernel[(num_tokens, grid_n)](
        act, w2, ids, weights, out, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        N=hidden_size, K=inter, TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), BLOCK_N=dn,
        BLOCK_K=min(dk, triton.next_power_of_2(inter)), **down_launch, **pdl_options(hidden.device),
    )  # fmt: skip
    return out
