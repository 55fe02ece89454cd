"""Routing inside the small experts' gate_up pass (triton_experts_small.fused_routed_experts_small and its dispatch,
triton_experts.fused_routed_experts) against routing first with the routing kernel (triton_routing) and then the
same experts: the same ids, weights and output bits, with one launch fewer. On CPU under triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); the `gpu` test at Qwen3-30B-A3B's sizes on CUDA."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def _case(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEVICE) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=DEVICE) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE).to(dtype)
    return x, logits, w13, w2


def _routed_first(x, logits, w13, w2, top_k, renormalize, down=None):
    from flotilla.kernels.moe import triton_experts_small as small
    from flotilla.kernels.moe.triton_routing import fused_select_experts

    weights, ids = fused_select_experts(logits, top_k, renormalize)
    return small.fused_experts_small(x, w13, w2, weights, ids, down=down), weights, ids


@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize", "dtype", "down"), [
    (1, 128, 8, True, torch.bfloat16, {"per_slot": 1, "block_n": 32}),  # Qwen3-30B-A3B's batch 1 (ONE_TOKEN_DOWN)
    (1, 128, 8, False, torch.float32, None),
    (3, 60, 4, True, torch.bfloat16, None),  # experts not a power of two, three tokens, token-major down pass
    (4, 16, 2, False, torch.float16, {"per_slot": 1}),
])  # fmt: skip
def test_routing_in_the_gate_up_pass_gives_the_routing_kernels_ids_weights_and_output_bits(
        tokens, experts, top_k, renormalize, dtype, down) -> None:  # fmt: skip
    from flotilla.kernels.moe import triton_experts_small as small

    x, logits, w13, w2 = _case(tokens, 64, 32, experts, dtype, seed=tokens + experts)
    want, want_w, want_ids = _routed_first(x, logits, w13, w2, top_k, renormalize, down)
    got, got_w, got_ids = small.fused_routed_experts_small(x, logits, w13, w2, top_k, renormalize, down=down)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
    assert torch.equal(got, want)


def test_fused_routed_experts_routes_in_the_gate_up_pass_up_to_the_small_path_and_apart_beyond(monkeypatch) -> None:
    """Up to SMALL_BATCH_MAX_TOKENS tokens no routing kernel is launched and the output is routing-first's; beyond
    it (and with FLOTILLA_MOE_FUSED_ROUTE off) select_experts runs first and then fused_experts."""
    from flotilla.kernels.moe import triton_experts, triton_routing
    from flotilla.kernels.moe import triton_experts_small as small

    launches = []
    real = triton_routing._softmax_topk_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_routing, "_softmax_topk_kernel", Counted())
    monkeypatch.setattr(triton_experts, "select_experts", triton_routing.fused_select_experts)  # CUDA's routing
    for tokens, fused in ((1, True), (small.SMALL_BATCH_MAX_TOKENS, True), (small.SMALL_BATCH_MAX_TOKENS + 3, False)):
        x, logits, w13, w2 = _case(tokens, 64, 32, 16, torch.bfloat16, seed=tokens)
        launches.clear()
        got = triton_experts.fused_routed_experts(x, logits, w13, w2, 4, True)
        assert len(launches) == (0 if fused else 1), tokens
        weights, ids = triton_routing.fused_select_experts(logits, 4, True)
        assert torch.equal(got, triton_experts.fused_experts(x, w13, w2, weights, ids)), tokens
    monkeypatch.setattr(triton_experts, "FUSED_ROUTE", False)
    launches.clear()
    triton_experts.fused_routed_experts(*_case(1, 64, 32, 16, torch.bfloat16, seed=1), 4, True)
    assert len(launches) == 1


def test_bad_router_logits_are_refused() -> None:
    from flotilla.kernels.moe import triton_experts_small as small

    x, logits, w13, w2 = _case(2, 64, 32, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="router_logits"):
        small.fused_routed_experts_small(x, logits[:1], w13, w2, 4, True)
    with pytest.raises(ValueError, match="top_k"):
        small.fused_routed_experts_small(x, logits, w13, w2, 17, True)


@pytest.mark.slow
def test_the_routing_gate_up_pass_compiles_for_sm90_without_a_gpu(tmp_path) -> None:
    from helpers_triton import compile_for_sm90

    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32", "out_ptr": "*bf16", "logits_ptr": "*bf16",
            "weights_ptr": "*fp32"}
    compile_for_sm90([("flotilla.kernels.moe.triton_experts_small", "_small_gate_up_kernel", ptrs, [],
                       dict(N=768, K=2048, TOP_K=8, BLOCK_N=16, BLOCK_K=128, ROUTE=True, E=128, BLOCK_E=128,
                            BLOCK_TK=8, RENORMALIZE=True, USE_GDC=True), 8)], tmp_path)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_routing_in_the_gate_up_pass_at_qwen3_30b_a3b_sizes(tokens) -> None:
    from flotilla.kernels.moe import triton_experts
    from flotilla.kernels.moe import triton_experts_small as small

    x, logits, w13, w2 = _case(tokens, 2048, 768, 128, torch.bfloat16, seed=tokens)
    down = triton_experts._small_down(triton_experts.env_tiles(), tokens)
    want, want_w, want_ids = _routed_first(x, logits, w13, w2, 8, True, down)
    got, got_w, got_ids = small.fused_routed_experts_small(x, logits, w13, w2, 8, True, down=down)
    torch.cuda.synchronize()
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_engine_routing_in_the_gate_up_pass_gives_the_same_greedy_tokens(tmp_path, monkeypatch) -> None:
    """A tiny Qwen3-MoE in worker processes (decode CUDA graphs, PDL) with FLOTILLA_MOE_FUSED_ROUTE on and off: the
    same greedy tokens."""
    from helpers_engine import greedy_on_cuda_switched
    from helpers_tiny_models import write_tiny_moe_model

    model = str(write_tiny_moe_model(tmp_path / "qwen3_moe_hd64", "qwen3_moe_hd64"))
    outs = greedy_on_cuda_switched(model, "FLOTILLA_MOE_FUSED_ROUTE", monkeypatch)
    assert outs["1"] == outs["0"]
