"""MoE routing: which experts each token goes to (top-k over the router's softmax), and the token
order the grouped GEMMs want (each expert's tokens contiguous, padded to the GEMM's row tile).

Routing is kept apart from expert compute on purpose: an expert-parallel layer routes here, sends
each token to the ranks owning its experts, and runs the same expert kernels on what it receives.
Everything here has static shapes (no host sync, no data-dependent sizes), so it runs inside CUDA graphs. On
CUDA routing and grouping are one triton launch each (kernels/moe/triton_routing.py, triton_align.py) instead of
~25 small torch kernels; the *_torch functions are the references they are tested against, and what runs elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FUSED_ALIGN_MAX_SLOTS = 16384
"""On CUDA, sort_by_expert runs kernels/moe/triton_align.py's single launch up to this many slots (tokens x top_k:
2,048 tokens at top-8), and its torch version beyond: the sizes at which the kernel has been checked on a GPU (far
beyond them the torch version is the faster one inside a CUDA graph)."""


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Qwen2/3-MoE, Mixtral): router_logits [T, E] -> (weights float32 [T, top_k],
    expert ids int32 [T, top_k]). The softmax runs in float32; with `renormalize` (HF's norm_topk_prob)
    the k weights are rescaled to sum to 1. On CUDA one triton launch, whose ids may differ from torch.topk's only
    on exact ties; elsewhere select_experts_torch."""
    if router_logits.is_cuda:
        from flotilla.kernels.moe.triton_routing import fused_select_experts  # imports triton: CUDA only

        return fused_select_experts(router_logits, top_k, renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """select_experts in torch (the reference)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """The (token, k) slots of a routing grouped by expert, each expert's run padded to `block_m` rows.

    A slot is token * top_k + j: the j-th expert choice of a token (its row in topk_ids.flatten()).
    Sizes are the worst case for the batch (padded_rows: num_slots + min(E, num_slots) * (block_m - 1), rounded up
    to block_m), so they depend only on the batch shape; `num_padded` says how many rows are really in use.
    """

    sorted_slots: torch.Tensor
    """int32 [max_rows]: slot ids grouped by expert (ascending expert; slots ascending within one from the
    torch version, in any order from the triton one); padding rows hold num_slots."""
    block_experts: torch.Tensor
    """int32 [max_rows // block_m]: the expert of each block of block_m rows (meaningful for blocks
    below num_padded; later ones repeat the last expert and must be skipped)."""
    num_padded: torch.Tensor
    """int32 [1]: rows in use (a multiple of block_m), on the device so no one waits for it."""
    num_slots: int
    """Number of real slots (tokens * top_k); the padding sentinel."""
    block_m: int
    """Rows per block: every block holds one expert's slots only."""


def padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows of the worst case, rounded up to block_m: each expert that gets a slot pads its run by up to
    block_m - 1 rows, and at most min(num_experts, num_slots) experts get one. (A batch-1 decode step of 128
    experts at top-8 thus needs 8 blocks of 16 rows, not 120: the expert GEMMs launch a program per block.)"""
    busy = min(num_experts, num_slots)
    return -(-(num_slots + busy * (block_m - 1)) // block_m) * block_m


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, masked: bool = False) -> ExpertBlocks:
    """Group the slots of topk_ids [T, top_k] by expert and pad each expert's run to block_m rows. On CUDA (up
    to FUSED_ALIGN_MAX_SLOTS slots) one triton launch does it, with slots in any order within an expert's run.
    `masked`: ids may be negative (masked: another rank's expert), slots left out of every run; the torch version
    then takes a few more launches, which plain routing does not pay."""
    if topk_ids.is_cuda and topk_ids.numel() <= FUSED_ALIGN_MAX_SLOTS:
        from flotilla.kernels.moe.triton_align import align_by_expert  # imports triton: CUDA only

        return align_by_expert(topk_ids, num_experts, block_m)
    return sort_by_expert_torch(topk_ids, num_experts, block_m, masked)


def sort_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, masked: bool = False) -> ExpertBlocks:
    """sort_by_expert in torch (the reference; slots ascending within an expert's run)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    device = flat.device
    spare = int(masked)
    if masked:  # masked slots count as one more expert, E, whose run is not stored: its rows land on a spare row
        flat = torch.where(flat < 0, num_experts, flat)
    # scatter_add, not bincount: bincount reads the maximum back to the host.
    counts = torch.zeros(num_experts + spare, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    if masked:
        padded[num_experts] = 0
    ends = padded.cumsum(0)
    starts = ends - padded
    first_slot_rank = counts.cumsum(0) - counts  # rank of each expert's first slot in sorted order
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(num_slots, device=device)
    max_rows = padded_rows(num_slots, num_experts, block_m)
    dest = starts[experts_sorted] + rank - first_slot_rank[experts_sorted]
    if masked:
        dest = torch.where(experts_sorted == num_experts, max_rows, dest)

    sorted_slots = torch.full((max_rows + spare,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[dest] = order.to(torch.int32)
    sorted_slots = sorted_slots[:max_rows]
    ends = ends[:num_experts]
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(
        sorted_slots=sorted_slots,
        block_experts=block_experts.to(torch.int32),
        num_padded=ends[-1:].to(torch.int32),
        num_slots=num_slots,
        block_m=block_m,
    )


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped top-k ("noaux_tc"): router_logits [T, E] -> (weights float32 [T, top_k], expert
    ids int32 [T, top_k]). Scores are float32 sigmoids; the experts are split into num_groups groups, each
    group rated by the sum of its two best biased scores (score + correction_bias), and only the topk_groups
    best groups compete for the top_k. The bias only chooses: the weights are the raw scores of the chosen
    experts, renormalized to sum to 1 if `renormalize` (HF's norm_topk_prob), times routed_scaling_factor.
    Static shapes, no host sync (CUDA-graph safe). On CUDA one triton launch; elsewhere
    select_experts_grouped_torch."""
    if router_logits.is_cuda:
        from flotilla.kernels.moe.triton_routing import fused_select_experts_grouped  # imports triton: CUDA only

        return fused_select_experts_grouped(router_logits, top_k, num_groups, topk_groups, correction_bias,
                                            renormalize, routed_scaling_factor)  # fmt: skip
    return select_experts_grouped_torch(router_logits, top_k, num_groups, topk_groups, correction_bias, renormalize,
                                        routed_scaling_factor)  # fmt: skip


def select_experts_grouped_torch(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts_grouped in torch (the reference)."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    per_group = num_experts // num_groups
    group_scores = choice.view(num_tokens, num_groups, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, num_experts)
    ids = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)
