"""deep_gemm's FP8 experts (kernels/moe/deep_gemm_experts.fused_experts_fp8): the layout, quantization and combine
on CPU with DeepGEMM's FP8 grouped GEMM replaced by a torch implementation of its contract (padding rows NaN-filled
first, so a layout that read them would fail), against the W8A8 reference; on a Hopper GPU with deep_gemm, the real
GEMM at DeepSeek-V3's expert sizes against the triton FP8 experts and the reference."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.moe import deep_gemm_experts, torch_ref
from test_fp8_moe import _fp8_case

HAS_DEEP_GEMM = deep_gemm_experts.import_deep_gemm() is not None and torch.cuda.is_available()


def _nan_padding_gemm(a, b, d, m_indices):
    d.fill_(float("nan"))
    deep_gemm_experts.grouped_fp8_gemm_reference(a, b, d, m_indices)


@pytest.mark.parametrize(("tokens", "alignment"), [(1, 8), (13, 4), (40, 16)])
def test_fp8_layout_with_deep_gemms_contract_matches_the_w8a8_reference(tokens, alignment):
    case = _fp8_case(tokens, 256, 128, 6, 2, (128, 128), torch.float32, seed=tokens, device=torch.device("cpu"))
    want = torch_ref.fused_experts_fp8_w8a8(*case, block_size=(128, 128))
    got = deep_gemm_experts.fused_experts_fp8(*case, block_size=(128, 128), gemm=_nan_padding_gemm,
                                              alignment=alignment)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_blocks_deep_gemm_cannot_take_are_refused():
    case = _fp8_case(2, 64, 32, 4, 2, (16, 16), torch.float32, seed=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="128x128 weight blocks"):
        deep_gemm_experts.fused_experts_fp8(*case, block_size=(16, 16), gemm=_nan_padding_gemm, alignment=4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_DEEP_GEMM, reason="needs deep_gemm and a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_gpu_deep_gemm_fp8_experts_match_the_triton_ones_at_deepseek_v3_sizes(tokens):
    """DeepGEMM's FP8 experts against triton's at DeepSeek-V3's expert sizes, both against the float32 W8A8 reference.

    Both round the intermediate activation to bf16 before quantizing it to e4m3, and a bf16 difference upstream moves
    an activation across an e4m3 rounding step now and then, so an elementwise tolerance fails on such outliers while
    both stay within a few percent (relative Frobenius norm) of the reference. The criterion is therefore in norms:
    close to triton's, and no further from the reference than triton is (a misplaced scale or row moves the norm by
    orders of magnitude more)."""
    from flotilla.kernels.moe import triton_experts

    case = _fp8_case(tokens, 7168, 2048, 16, 8, (128, 128), torch.bfloat16, seed=tokens, device=torch.device("cuda"))
    want = triton_experts.fused_experts_fp8(*case, block_size=(128, 128))
    got = deep_gemm_experts.fused_experts_fp8(*case, block_size=(128, 128))
    x, *weights = case
    ref = torch_ref.fused_experts_fp8_w8a8(x.float(), *weights, block_size=(128, 128))
    print(f"\n[tokens={tokens}] {_where_deep_gemm_differs(case, got, want, ref)}")  # (pytest -s shows it)
    assert _rel(got, want) < 0.02
    assert _rel(got, ref) < 1.1 * _rel(want, ref) + 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative Frobenius-norm error of a against b."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _where_deep_gemm_differs(case, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> str:
    """Relative errors that say which part of the DeepGEMM FP8 experts departs: the whole layer against triton's and
    the float32 W8A8 reference, then each grouped GEMM alone (DeepGEMM against its contract's torch version) on the
    layer's own layout and quantized operands."""
    import deep_gemm

    from flotilla.kernels.activation import silu_and_mul
    from flotilla.kernels.quant import quantize_activations

    x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids = case
    parts = [f"layer: deep_gemm/triton {_rel(got, want):.3g}, deep_gemm/ref {_rel(got, ref):.3g}, "
             f"triton/ref {_rel(want, ref):.3g}"]
    layout = deep_gemm_experts._Layout(x, topk_ids, w13.shape[0], deep_gemm_experts._alignment(deep_gemm))
    real = layout.m_indices >= 0
    parts.append(f"rows {layout.a.shape[0]} ({int(real.sum())} real), experts used {topk_ids.unique().numel()}")
    a = quantize_activations(layout.a, 128)
    for name, (w, s), n in (("gate_up", (w13, w13_scale.float()), w13.shape[1]),
                            ("down", (w2, w2_scale.float()), w2.shape[1])):  # fmt: skip
        dg = torch.zeros(layout.a.shape[0], n, dtype=torch.bfloat16, device=x.device)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (w, s), dg, layout.m_indices)
        tr = torch.zeros_like(dg)
        deep_gemm_experts.grouped_fp8_gemm_reference(a, (w, s), tr, layout.m_indices)
        parts.append(f"{name} GEMM alone {_rel(dg[real], tr[real]):.3g}")
        if name == "gate_up":
            a = quantize_activations(silu_and_mul(tr), 128)
    return "; ".join(parts)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_DEEP_GEMM, reason="needs deep_gemm and a CUDA device")
@pytest.mark.parametrize("padding", ["none", "minus_one", "expert_id"])
def test_gpu_deep_gemms_grouped_fp8_gemm_alone_keeps_its_contract(padding):
    """Which part of the FP8 experts' mismatch above is DeepGEMM's own GEMM: m_grouped_fp8_gemm_nt_contiguous alone
    against grouped_fp8_gemm_reference on the same quantized operands, 2 experts of 256 x 512 (block columns of
    weights apart in magnitude, so a misplaced scale shows), one group of `alignment` rows each. Every row real
    ("none"), or each group's last 28 rows padding, marked -1 as flotilla's layout marks them ("minus_one") or with
    the group's expert ("expert_id"); the real rows are compared."""
    import deep_gemm

    from flotilla.kernels.quant import block_quantize, quantize_activations

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    experts, n, k = 2, 256, 512
    align = deep_gemm_experts._alignment(deep_gemm)
    spread = torch.logspace(-1.5, 1.5, k, device=dev)[torch.randperm(k, generator=gen, device=dev)]
    w, s = zip(*(block_quantize(torch.randn(n, k, generator=gen, device=dev) * k**-0.5 * spread, (128, 128))
                 for _ in range(experts)))  # fmt: skip
    w, s = torch.stack(w), torch.stack(s).float()
    rows = experts * align
    x = torch.randn(rows, k, generator=gen, device=dev).bfloat16()
    m_indices = torch.arange(experts, device=dev, dtype=torch.int32).repeat_interleave(align)
    real = torch.ones(rows, dtype=torch.bool, device=dev)
    if padding != "none":
        real = torch.arange(rows, device=dev) % align < align - 28
        if padding == "minus_one":
            m_indices = torch.where(real, m_indices, -1)
    a = quantize_activations(x, 128)
    got = torch.zeros(rows, n, dtype=torch.bfloat16, device=dev)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (w, s), got, m_indices)
    want = torch.zeros_like(got)
    deep_gemm_experts.grouped_fp8_gemm_reference(a, (w, s), want, m_indices)
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=2e-2, rtol=2e-2)
