"""MoE experts on DeepGEMM's grouped GEMM (`m_grouped_bf16_gemm_nt_contiguous`), when it is installed.

DeepGEMM multiplies an [M, K] activation whose rows are grouped by expert (each group padded to its
M alignment, padding rows marked -1 in `m_indices`) by stacked weights [E, N, K]. This module only lays
the tokens out that way (routing.sort_by_expert with DeepGEMM's alignment), runs the two GEMMs with
SiLU-and-mul between them, and combines like the other backends. It is the prefill-shaped path: the
contiguous layout pads every expert to the alignment (128 rows), so small decode batches belong to
the masked variant (m_grouped_*_masked), which is not built yet.

FP8 experts (DeepSeek-V3's e4m3 weights with 128x128 block scales) take `m_grouped_fp8_gemm_nt_contiguous` over
the same layout, each GEMM's input quantized per token and 128 columns first (fused_experts_fp8).

The FP8 path agrees with the triton FP8 experts to within 1% (relative norm) at DeepSeek-V3's sizes and is about
2% from the float32 W8A8 reference, as they are (both round the intermediate activation to bf16 before quantizing
it), so its GPU test compares norms, not elements. Both layouts and the combine are tested on CPU through
grouped_gemm_reference / grouped_fp8_gemm_reference, which implement DeepGEMM's documented contracts.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul
from flotilla.kernels.moe.routing import sort_by_expert
from flotilla.kernels.moe.torch_ref import check_fp8_expert_scales
from flotilla.kernels.quant import quantize_activations
from flotilla.kernels.quant.fp8_ref import block_dequantize, per_token_group_dequantize

FP8_GROUP = 128
"""DeepGEMM's FP8 block: 128x128 weight blocks, activations quantized per token and 128 columns."""

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
    masked: bool = False,
    *,
    swiglu_limit: float | None = None,
    gemm: GroupedGemm | None = None,
    alignment: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts (swiglu_limit included), without masked slots. gemm/alignment
    default to DeepGEMM's (tests pass the torch reference of the GEMM to check the layout on CPU)."""
    if masked:
        raise NotImplementedError("the deep_gemm experts take no masked routing (negative expert ids); use the "
                                  "triton or torch MoE backend")
    if gemm is None or alignment is None:
        deep_gemm = _require_deep_gemm()
        gemm = gemm or deep_gemm.m_grouped_bf16_gemm_nt_contiguous
        alignment = alignment or _alignment(deep_gemm)
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    layout = _Layout(hidden, topk_ids, w13.shape[0], alignment)
    gate_up = torch.empty(layout.a.shape[0], w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    gemm(layout.a, w13, gate_up, layout.m_indices)
    act = silu_and_mul(gate_up, swiglu_limit)
    down = torch.empty(layout.a.shape[0], hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    gemm(act.contiguous(), w2, down, layout.m_indices)
    return layout.combine(down, topk_weights)


Fp8GroupedGemm = Callable[[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor,
                           torch.Tensor], None]  # fmt: skip
"""((a e4m3 [M, K], a_scales float32 [M, K/128]), (b e4m3 [E, N, K], b_scales float32 [E, N/128, K/128]), d [M, N],
m_indices int32 [M]) -> None: DeepGEMM's m_grouped_fp8_gemm_nt_contiguous, d[r] = dequant(a[r]) @ dequant(b[e]).T
for rows r of expert e = m_indices[r] (not -1), accumulated in float32."""


def grouped_fp8_gemm_reference(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                               d: torch.Tensor, m_indices: torch.Tensor) -> None:  # fmt: skip
    """DeepGEMM's contiguous FP8 grouped GEMM contract in torch (padding rows are left as they were)."""
    (q, q_scale), (w, w_scale) = a, b
    x = per_token_group_dequantize(q, q_scale, FP8_GROUP)
    for expert in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = torch.where(m_indices == expert)[0]
        weight = block_dequantize(w[expert], w_scale[expert], (FP8_GROUP, FP8_GROUP))
        d[rows] = F.linear(x[rows], weight).to(d.dtype)


def fused_experts_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    masked: bool = False,
    *,
    gemm: Fp8GroupedGemm | None = None,
    alignment: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts_fp8, computed as torch_ref.fused_experts_fp8_w8a8 (each GEMM's input
    quantized per token and 128 columns, one launch, kernels/quant): DeepGEMM's m_grouped_fp8_gemm_nt_contiguous
    over the same layout as the bf16 path. Needs 128x128 weight blocks and an intermediate size that is a whole
    number of blocks (w13's scales then hold gate's block rows and up's as one [2I/128, H/128] grid)."""
    if masked:
        raise NotImplementedError("the deep_gemm experts take no masked routing (negative expert ids); use the "
                                  "triton or torch MoE backend")
    check_fp8_expert_scales(w13, w13_scale, w2, w2_scale, block_size)
    if tuple(block_size) != (FP8_GROUP, FP8_GROUP) or (w13.shape[1] // 2) % FP8_GROUP:
        raise ValueError(f"DeepGEMM's FP8 experts take 128x128 weight blocks and an intermediate size that is a "
                         f"multiple of 128, not blocks {tuple(block_size)} with {w13.shape[1] // 2}")  # fmt: skip
    if gemm is None or alignment is None:
        deep_gemm = _require_deep_gemm()
        gemm = gemm or deep_gemm.m_grouped_fp8_gemm_nt_contiguous
        alignment = alignment or _alignment(deep_gemm)
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    layout = _Layout(hidden, topk_ids, w13.shape[0], alignment)
    rows = layout.a.shape[0]
    gate_up = torch.empty(rows, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    gemm(quantize_activations(layout.a, FP8_GROUP), (w13, w13_scale.float()), gate_up, layout.m_indices)
    act = silu_and_mul(gate_up)
    down = torch.empty(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    gemm(quantize_activations(act, FP8_GROUP), (w2, w2_scale.float()), down, layout.m_indices)
    return layout.combine(down, topk_weights)


def _require_deep_gemm() -> ModuleType:
    deep_gemm = import_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError("the deep_gemm MoE backend needs the deep_gemm package")
    return deep_gemm


class _Layout:
    """The slots of a routing laid out as DeepGEMM's contiguous grouped GEMMs want them: rows grouped by expert,
    each group padded to `alignment` rows (m_indices -1 on padding), and the way back to the tokens."""

    def __init__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, alignment: int) -> None:
        self.num_tokens, self.hidden_size = hidden.shape
        self.top_k = topk_ids.shape[1]
        blocks = sort_by_expert(topk_ids, num_experts, alignment)
        self.num_slots = blocks.num_slots
        self.slots = blocks.sorted_slots.to(torch.int64)
        self.is_real = self.slots < blocks.num_slots
        rows = blocks.block_experts.repeat_interleave(alignment).to(torch.int32)
        self.m_indices = torch.where(self.is_real, rows, torch.full_like(rows, -1))
        # Padding rows gather token 0 (any row would do: DeepGEMM skips them) so no host sync is needed.
        self.a = hidden.index_select(0, torch.where(self.is_real, self.slots // self.top_k, 0))

    def combine(self, down: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Each row scaled by its routing weight and scattered to its slot (padding rows to one spare row past the
        end), then the top_k slots of every token summed in float32."""
        weights = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
        weighted = (down.float() * weights[self.slots, None]).to(down.dtype)
        per_slot = torch.zeros(self.num_slots + 1, self.hidden_size, dtype=down.dtype, device=down.device)
        per_slot.index_copy_(0, torch.where(self.is_real, self.slots, self.num_slots), weighted)
        combined = per_slot[: self.num_slots].view(self.num_tokens, self.top_k, self.hidden_size)
        return combined.sum(dim=1)  # float32 accumulation, one rounding (one launch, not a sum and a cast)
