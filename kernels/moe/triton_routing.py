"""MoE routing in one triton launch: the same contracts as routing.select_experts and
routing.select_experts_grouped, fused like vLLM's / SGLang's topk_softmax and grouped_topk kernels.

The torch routing is ~6 small kernels per MoE layer (softmax, topk, sum, div, cast; the grouped one more);
at batch-1 decode inside a CUDA graph those launches, not the math, are the cost. Here each program owns
BLOCK_T router rows, keeps a whole row (E padded to a power of two) in registers, and:

- fused_select_experts: float32 softmax, then top_k rounds of (row max, lowest column holding it, mask it
  out): the k choices come out in descending weight (torch.topk's sorted order), ties to the lowest expert
  id; optional renormalization to sum 1; one store of weights float32 [T, k] and ids int32 [T, k].
- fused_select_experts_grouped: DeepSeek-V3's noaux_tc. The row is held as [groups, experts per group]
  (each padded to a power of two, so E need not be one), sigmoid scores, biased choice scores, each group
  rated by the sum of its two best choice scores, topk_groups rounds pick the groups, top_k rounds pick the
  experts of those groups by choice score; weights are the raw sigmoid scores, optionally renormalized
  (+1e-20, as the reference), times routed_scaling_factor. The ids come in descending choice score; the
  reference (torch.topk(sorted=False)) promises no order, so only the sets per row are the contract.

Static shapes, no host sync (CUDA-graph safe); T == 0 launches nothing. The reductions are tl.max / tl.min /
tl.sum (the CPU interpreter runs those as numpy; a tl.reduce with a custom combine function runs element by
element in python, far too slow for the tests); like triton_mla.py they need TRITON_INTERPRET=1 set before
triton is first imported (tests/conftest.py does). tl.full stands in for tl.zeros and the sigmoid is spelt
out, as in triton_experts.py.

Ties: exactly equal scores go to the lowest expert (or group) id; torch.topk promises nothing for ties, so
ids may differ from the torch reference only where scores tie exactly (e.g. softmax probabilities that
underflow to 0 when top_k reaches them, or bf16 logits, which repeat often among 128+ experts). NaN logits
give clamped, in-range ids (garbage in, no fault). Precision: on CUDA tl.exp is ex2.approx-based where torch
uses expf, so weights agree to ~1e-6 relative (tests: 2e-6 under the interpreter, 1e-5 on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior

MAX_EXPERTS = 1024
"""Largest E these kernels accept (a row lives in registers; 512 is the largest in use today)."""


@triton.jit
def softmax_topk(x, cols, col_ok, E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows of float32 logits x [R, BLOCK_E] (columns past E masked by col_ok) -> (weights float32, ids int32)
    [R, BLOCK_K]: the float32 softmax's top TOP_K in descending weight, ties to the lowest id, lanes past TOP_K 0."""
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite: no NaN, never stored
    row_max = tl.max(x, 1)
    e = tl.exp(x - row_max[:, None])  # padded columns: exp(-inf) = 0
    probs = e / tl.sum(e, 1)[:, None]
    probs = tl.where(col_ok[None, :], probs, -1.0)  # below every probability: never chosen, as taken ones

    ks = tl.arange(0, BLOCK_K)
    top_w = tl.full((x.shape[0], BLOCK_K), 0.0, tl.float32)
    top_id = tl.full((x.shape[0], BLOCK_K), 0, tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 1)
        hit = tl.where(probs == best[:, None], cols[None, :], x.shape[1])
        idx = tl.minimum(tl.min(hit, 1), E - 1)  # the clamp only matters for NaN rows
        top_w = tl.where(ks[None, :] == j, best[:, None], top_w)
        top_id = tl.where(ks[None, :] == j, idx[:, None], top_id)
        probs = tl.where(cols[None, :] == idx[:, None], -1.0, probs)
    if RENORMALIZE:  # lanes past TOP_K hold 0
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    return top_w, top_id


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, stride_t,
    E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """Rows [pid * BLOCK_T, +BLOCK_T): softmax over E columns, top TOP_K, stored [T, TOP_K]."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    top_w, top_id = softmax_topk(x, cols, col_ok, E, TOP_K, RENORMALIZE, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    out = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=out_mask)
    tl.store(ids_ptr + out, top_id, mask=out_mask)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_t, scaling,
    G: tl.constexpr, PG: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows [pid * BLOCK_T, +BLOCK_T) as [BLOCK_T, G groups, PG experts each] (padded to BLOCK_G x BLOCK_P):
    noaux_tc grouped top-k, stored [T, TOP_K]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    grp = tl.arange(0, BLOCK_G)
    pos = tl.arange(0, BLOCK_P)
    expert = grp[:, None] * PG + pos[None, :]  # [BLOCK_G, BLOCK_P]: the expert id of each lane
    lane_ok = (grp[:, None] < G) & (pos[None, :] < PG)
    expert3 = expert[None, :, :]
    lane_ok3 = lane_ok[None, :, :]
    ptrs = logits_ptr + rows[:, None, None].to(tl.int64) * stride_t + expert3
    x = tl.load(ptrs, mask=row_ok[:, None, None] & lane_ok3, other=0.0).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-x))  # sigmoid (tl.sigmoid is a @jit helper); padding lanes hold 0.5
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert, mask=lane_ok, other=0.0).to(tl.float32)
        choice = scores + bias[None, :, :]
    else:
        choice = scores
    choice = tl.where(lane_ok3, choice, float("-inf"))

    # each group's rating: its best choice score plus its second best (the best's lane masked out once,
    # so a tied pair counts twice, as topk(2) does); a group of one expert is rated by that expert alone
    best1 = tl.max(choice, 2)  # [BLOCK_T, BLOCK_G]
    if PG >= 2:
        first = tl.min(tl.where(choice == best1[:, :, None], pos[None, None, :], BLOCK_P), 2)
        rest = tl.where(pos[None, None, :] == first[:, :, None], float("-inf"), choice)
        group_score = best1 + tl.max(rest, 2)
    else:
        group_score = best1

    # topk_groups rounds over the groups: `open_g` lanes are real groups not yet taken
    open_g = (grp[None, :] < G) & (rows[:, None] >= 0)  # [BLOCK_T, BLOCK_G]
    chosen = tl.full((BLOCK_T, BLOCK_G), 0, tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        v = tl.where(open_g, group_score, float("-inf"))
        best = tl.max(v, 1)
        g_idx = tl.min(tl.where(open_g & (v == best[:, None]), grp[None, :], BLOCK_G), 1)
        taken = grp[None, :] == g_idx[:, None]
        chosen = tl.where(taken, 1, chosen)
        open_g = open_g & (grp[None, :] != g_idx[:, None])
    choice = tl.where(chosen[:, :, None] != 0, choice, float("-inf"))

    # top_k rounds over the experts of the chosen groups: `open_e` lanes are real experts not yet taken
    # (an expert outside the chosen groups is -inf: taken only if top_k exceeds what those groups hold)
    open_e = lane_ok3 & (rows[:, None, None] >= 0)  # [BLOCK_T, BLOCK_G, BLOCK_P]
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.full((BLOCK_T, BLOCK_K), 0.0, tl.float32)
    top_id = tl.full((BLOCK_T, BLOCK_K), 0, tl.int32)
    for j in tl.static_range(TOP_K):
        v = tl.where(open_e, choice, float("-inf"))
        best = tl.max(tl.max(v, 2), 1)
        hit = tl.where(open_e & (v == best[:, None, None]), expert3, G * PG)
        idx = tl.minimum(tl.min(tl.min(hit, 2), 1), G * PG - 1)
        sel = lane_ok3 & (expert3 == idx[:, None, None])  # a padding lane's id may repeat the next group's
        w = tl.sum(tl.sum(tl.where(sel, scores, 0.0), 2), 1)
        open_e = open_e & (expert3 != idx[:, None, None])  # padding lanes were never open
        top_w = tl.where(ks[None, :] == j, w[:, None], top_w)
        top_id = tl.where(ks[None, :] == j, idx[:, None], top_id)
    if RENORMALIZE:  # lanes past TOP_K hold 0
        top_w = top_w / (tl.sum(top_w, 1)[:, None] + 1e-20)
    top_w = top_w * scaling

    out = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=out_mask)
    tl.store(ids_ptr + out, top_id, mask=out_mask)


def _launch_shape(num_tokens: int, row_lanes: int, block_t: int | None, num_warps: int | None) -> tuple[int, int]:
    """(rows per program, warps): up to ~1024 lanes per program, never more rows than the batch has (decode
    is one row, one warp for E <= 256: its reductions stay warp shuffles); overridable for tuning."""
    if block_t is None:
        block_t = min(triton.next_power_of_2(num_tokens), max(1, 1024 // row_lanes))
    if num_warps is None:
        num_warps = max(1, min(8, block_t * row_lanes // 256))
    return block_t, num_warps


def _check_logits(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"the fused routing kernels hold at most {MAX_EXPERTS} experts per row, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    return router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()


def _empty_outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, device = router_logits.shape[0], router_logits.device
    return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))  # fmt: skip


def fused_select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.select_experts in one launch: router_logits [T, E] (bf16 / fp16 / fp32, E <= 1024) -> (weights
    float32 [T, top_k], expert ids int32 [T, top_k]), float32 softmax, the k choices in descending weight
    (ties to the lowest id), renormalized to sum 1 if `renormalize`. block_t / num_warps: tuning overrides."""
    router_logits = _check_logits(router_logits, top_k)
    weights, ids = _empty_outputs(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t, num_warps = _launch_shape(num_tokens, block_e, block_t, num_warps)
    _softmax_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, router_logits.stride(0),
        E=num_experts, TOP_K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps,
        **pdl_options(router_logits.device),
    )  # fmt: skip
    return weights, ids


def fused_select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.select_experts_grouped (DeepSeek-V3's noaux_tc) in one launch, same arguments and outputs:
    router_logits [T, E] (E <= 1024, divisible by num_groups), correction_bias [E] or None -> (weights float32
    [T, top_k], expert ids int32 [T, top_k]). Ids come in descending biased score (ties to the lowest id);
    the reference's order is unspecified, so compare per row as sets. block_t / num_warps: tuning overrides."""
    router_logits = _check_logits(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, {num_groups}], got {topk_groups}")
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise ValueError(f"correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
        correction_bias = correction_bias.contiguous()
    weights, ids = _empty_outputs(router_logits, top_k)
    if num_tokens == 0:
        return weights, ids
    per_group = num_experts // num_groups
    block_g, block_p = triton.next_power_of_2(num_groups), triton.next_power_of_2(per_group)
    block_t, num_warps = _launch_shape(num_tokens, block_g * block_p, block_t, num_warps)
    _grouped_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, router_logits if correction_bias is None else correction_bias, weights, ids, num_tokens,
        router_logits.stride(0), float(routed_scaling_factor),
        G=num_groups, PG=per_group, TOPK_GROUPS=topk_groups, TOP_K=top_k, RENORMALIZE=bool(renormalize),
        HAS_BIAS=correction_bias is not None, BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_P=block_p,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps,
    )  # fmt: skip
    return weights, ids
