"""MoE experts on DeepGEMM's grouped GEMM (`m_grouped_bf16_gemm_nt_contiguous`), when it is installed.

DeepGEMM multiplies an [M, K] activation whose rows are grouped by expert (each group padded to its
M alignment, padding rows marked -1 in `m_indices`) by stacked weights [E, N, K]. This module only lays
the tokens out that way (routing.sort_by_expert with DeepGEMM's alignment), runs the two GEMMs with
SiLU-and-mul between them, and combines like the other backends. It is the prefill-shaped path: the
contiguous layout pads every expert to the alignment (128 rows), so small decode batches belong to
the masked variant (m_grouped_*_masked), which is not built yet; neither is the FP8 variant.

Not validated on a GPU yet (no machine with deep_gemm was at hand): the layout and combine are tested
on CPU through grouped_gemm_reference, which implements DeepGEMM's documented contract.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul
from flotilla.kernels.moe.routing import sort_by_expert

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(a [M, K], b [E, N, K], d [M, N], m_indices int32 [M]) -> None: d[r] = a[r] @ b[m_indices[r]].T for
rows whose m_indices is not -1 (others are left undefined)."""


def import_deep_gemm() -> ModuleType | None:
    """The deep_gemm module when it imports and has the bf16 grouped GEMM, else None."""
    try:
        import deep_gemm  # optional dependency: only imported when this backend is asked about
    except ImportError:
        return None
    return deep_gemm if hasattr(deep_gemm, "m_grouped_bf16_gemm_nt_contiguous") else None


def _alignment(deep_gemm: ModuleType) -> int:
    """DeepGEMM's row alignment per expert group (renamed between releases)."""
    for name in ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"):
        if hasattr(deep_gemm, name):
            return int(getattr(deep_gemm, name)())
    return 128


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    """DeepGEMM's contiguous grouped GEMM contract in torch (padding rows are left as they were)."""
    for expert in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = torch.where(m_indices == expert)[0]
        d[rows] = F.linear(a[rows], b[expert])


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gemm: GroupedGemm | None = None,
    alignment: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts. gemm/alignment default to DeepGEMM's (tests pass the
    torch reference of the GEMM to check the layout on CPU)."""
    if gemm is None or alignment is None:
        deep_gemm = import_deep_gemm()
        if deep_gemm is None:
            raise RuntimeError("the deep_gemm MoE backend needs the deep_gemm package")
        gemm = gemm or deep_gemm.m_grouped_bf16_gemm_nt_contiguous
        alignment = alignment or _alignment(deep_gemm)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    blocks = sort_by_expert(topk_ids, num_experts, alignment)
    slots = blocks.sorted_slots.to(torch.int64)
    is_real = slots < blocks.num_slots
    rows = blocks.block_experts.repeat_interleave(alignment).to(torch.int32)
    m_indices = torch.where(is_real, rows, torch.full_like(rows, -1))
    # Padding rows gather token 0 (any row would do: DeepGEMM skips them) so no host sync is needed.
    a = hidden.index_select(0, torch.where(is_real, slots // top_k, 0))
    gate_up = torch.empty(a.shape[0], two_i, dtype=hidden.dtype, device=hidden.device)
    gemm(a, w13, gate_up, m_indices)
    act = silu_and_mul(gate_up)
    down = torch.empty(a.shape[0], hidden_size, dtype=hidden.dtype, device=hidden.device)
    gemm(act.contiguous(), w2, down, m_indices)
    # Scatter each row to its slot, padding rows to one spare row past the end, then combine.
    weights = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
    weighted = (down.float() * weights[slots, None]).to(hidden.dtype)
    per_slot = torch.zeros(blocks.num_slots + 1, hidden_size, dtype=hidden.dtype, device=hidden.device)
    per_slot.index_copy_(0, torch.where(is_real, slots, blocks.num_slots), weighted)
    combined = per_slot[: blocks.num_slots].view(num_tokens, top_k, hidden_size)
    return combined.sum(dim=1, dtype=torch.float32).to(hidden.dtype)
