"""The RMSNorm folded into the one-row linear layer after it (kernels/triton/norm_gemv.py): against the norm and gemv
kernels it replaces, the router's softmax top-k after it, and the decoder layers that call it at batch 1.

Without CUDA the kernels run under triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
EPS = 1e-6


def _case(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x, res = (torch.randn(1, k, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=DEVICE)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype)
    return x, res, norm_w, w, b


def _unfused(x, res, norm_w, w, b, block_k):
    """The launches norm_gemv replaces: triton's norm kernel (kernels/triton/fused.py), then gemv."""
    from flotilla.kernels.triton.fused import fused_add_rms_norm, rms_norm
    from flotilla.kernels.triton.gemv import gemv

    normed, new_res = fused_add_rms_norm(x, res, norm_w, EPS) if res is not None else (rms_norm(x, norm_w, EPS), x)
    return gemv(normed, w, b, block_k=block_k), normed, new_res


@pytest.mark.parametrize(("n", "k", "block_k", "residual", "bias"), [
    (24, 64, None, True, False),  # one K step: the norm kernel's and gemv's very operations
    (13, 64, None, False, True),  # no residual (the first layer), a bias, rows not a multiple of the program's
    (64, 48, None, True, False),  # a program per row, more programs than columns (slices of 16, most empty)
    (20, 80, 32, True, True),  # K in three steps, the last partial: the statistics summed step by step
])  # fmt: skip
def test_norm_gemv_gives_the_norm_and_gemv_kernels_numbers(n, k, block_k, residual, bias):
    from flotilla.kernels.triton.norm_gemv import norm_gemv

    x, res, norm_w, w, b = _case(n, k, torch.bfloat16, seed=n + k)
    res = res if residual else None
    b = b if bias else None
    want, _, want_res = _unfused(x, res, norm_w, w, b, block_k)
    got, got_res = norm_gemv(x, res, norm_w, EPS, w, b, block_k=block_k)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16 and got_res.shape == (1, k)
    assert torch.equal(got_res, want_res)  # the sum, rounded as the norm kernel rounds it
    if block_k is None:  # the same operations on the same values
        assert torch.equal(got, want)
    else:  # the row's sum of squares taken in another order
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("experts", "top_k", "renormalize", "residual", "block_k"), [
    (8, 2, True, True, None),
    (20, 3, False, False, None),  # E not a power of two; raw softmax weights; no residual
    (16, 4, True, True, 16),  # K in steps
])  # fmt: skip
def test_norm_router_topk_gives_the_norm_router_and_routing_kernels_numbers(experts, top_k, renormalize, residual,
                                                                           block_k):  # fmt: skip
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe.triton_routing import fused_select_experts
    from flotilla.kernels.triton.norm_gemv import norm_router_topk

    x, res, norm_w, w, _ = _case(experts, 64, torch.bfloat16, seed=experts)
    res = res if residual else None
    logits, want_normed, want_res = _unfused(x, res, norm_w, w, None, block_k)
    want_w, want_ids = fused_select_experts(logits, top_k, renormalize)
    got = norm_router_topk(x, res, norm_w, EPS, w, top_k, renormalize, block_k=block_k)
    assert got is not None
    normed, new_res, weights, ids = got
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    assert weights.shape == ids.shape == (1, top_k) and weights.dtype == torch.float32 and ids.dtype == torch.int32
    if block_k is None:
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    else:  # the logits may differ in their last bit: the same choice, close weights
        assert set(ids.tolist()[0]) == set(want_ids.tolist()[0])
        torch.testing.assert_close(weights.sort().values, want_w.sort().values, atol=2e-2, rtol=2e-2)
    assert not arrival_counters(DEVICE).any()  # the last program set its counter back


def test_norm_gemv_refuses_rows_it_cannot_take():
    from flotilla.kernels.triton.norm_gemv import norm_gemv, norm_router_topk

    x, res, norm_w, w, _ = _case(8, 16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="one row of 16"):
        norm_gemv(torch.cat([x, x]), None, norm_w, EPS, w)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(x, res.float(), norm_w, EPS, w)
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        norm_router_topk(x, res, norm_w, EPS, w, 9, True)


def _one_token_logits(model, tokens):
    from helpers_tiny_models import PagedRunner

    runner = PagedRunner(model)
    runner.step([(0, tokens[:-1])])
    return runner.step([(0, tokens[-1:])])[0]  # a decode step: one row through every layer


def test_decoder_layers_fold_their_norms_at_one_token(tmp_path, monkeypatch):
    """With the folding allowed for any one row (kernels/linear.py's _folds_norm, which asks for CUDA), a one-token
    step runs the attention's and the MLP's forward_after_norm (the MoE block's: norm, router and routing in one
    launch; the dense layer's gate_up) and gives the unfolded step's logits; a prefill of several tokens never folds."""
    from helpers_tiny_models import load_flotilla_model, write_tiny_moe_model

    from flotilla.kernels import linear as linear_module
    from flotilla.kernels.triton import gemv as gemv_module
    from flotilla.kernels.triton import norm_gemv as norm_gemv_module
    from flotilla.models import qwen3_moe

    model = load_flotilla_model(write_tiny_moe_model(tmp_path / "qwen3_moe"))
    tokens = [5, 9, 17, 3, 11]
    want = _one_token_logits(model, tokens)
    calls = []
    for fn in ("norm_gemv", "norm_router_topk"):
        real = getattr(norm_gemv_module, fn)
        monkeypatch.setattr(norm_gemv_module, fn, lambda *a, _real=real, _fn=fn, **kw: calls.append(
            (_fn, a[0].shape[0])) or _real(*a, **kw))  # fmt: skip
    monkeypatch.setattr(linear_module, "_folds_norm", lambda x, residual, norm, weight: x.shape[0] == 1)
    monkeypatch.setattr(qwen3_moe, "_fused_routing", lambda hidden: True)
    monkeypatch.setattr(gemv_module, "MIN_PROGRAMS", 1)  # 4 rows a program: a quarter of the interpreter's work
    got = _one_token_logits(model, tokens)
    layers = len(model.model.layers)
    sparse = sum(isinstance(layer.mlp, qwen3_moe.Qwen3MoeSparseBlock) for layer in model.model.layers)
    assert calls.count(("norm_gemv", 1)) == 2 * layers - sparse  # q/k/v everywhere, gate_up in the dense MLPs
    assert calls.count(("norm_router_topk", 1)) == sparse and len(calls) == 2 * layers  # never at the prefill
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_norm_gemv_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    from helpers_triton import compile_for_sm90

    rows = {a: "*bf16" for a in ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "normed_ptr", "res_out_ptr")}
    compile_for_sm90([
        ("flotilla.kernels.triton.norm_gemv", "_norm_gemv_kernel", {**rows, "b_ptr": "*bf16", "out_ptr": "*bf16"},
         ["eps"], dict(HAS_RES=True, HAS_BIAS=False, WRITE_NORMED=False, BLOCK_N=4, BLOCK_K=2048, SLICE=16), 8),
        ("flotilla.kernels.triton.norm_gemv", "_norm_router_topk_kernel",
         {**rows, "logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "count_ptr": "*i32"}, ["eps"],
         dict(HAS_RES=True, TOP_K=8, RENORMALIZE=True, BLOCK_N=1, BLOCK_K=2048, SLICE=16, BLOCK_E=128,
              BLOCK_TOPK=8), 8),
    ], tmp_path)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_norm_gemv_and_router_at_qwen3_30b_a3b_sizes():
    """q/k/v (5,120 x 2,048) and the router (128 experts, top 8) of Qwen3-30B-A3B: the residual's bits, the outputs
    within bf16's rounding of the unfused kernels' (the row's statistics may be summed in another order), the same
    experts chosen."""
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe.triton_routing import fused_select_experts
    from flotilla.kernels.triton.norm_gemv import norm_gemv, norm_router_topk

    x, res, norm_w, w, _ = _case(5120, 2048, torch.bfloat16, seed=1)
    want, _, want_res = _unfused(x, res, norm_w, w, None, None)
    got, got_res = norm_gemv(x, res, norm_w, EPS, w)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    x, res, norm_w, w, _ = _case(128, 2048, torch.bfloat16, seed=2)
    logits, want_normed, want_res = _unfused(x, res, norm_w, w, None, None)
    want_w, want_ids = fused_select_experts(logits, 8, True)
    for _ in range(3):  # the counter back at 0 after each launch
        normed, new_res, weights, ids = norm_router_topk(x, res, norm_w, EPS, w, 8, True)
        assert torch.equal(new_res, want_res)
        torch.testing.assert_close(normed.float(), want_normed.float(), atol=2e-2, rtol=2e-2)
        assert set(ids.tolist()[0]) == set(want_ids.tolist()[0])
        torch.testing.assert_close(weights.sort().values, want_w.sort().values, atol=1e-2, rtol=1e-2)
    torch.cuda.synchronize()
    assert not arrival_counters(DEVICE).any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_engine_with_the_norms_folded_gives_the_unfolded_greedy_tokens(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE engine (worker processes, CUDA graphs) with FLOTILLA_NORM_GEMV=1 gives the greedy tokens of
    the norms as launches of their own: its batches shrink to one sequence, whose decode graphs capture the folded
    norms (q/k/v, the MoE block's router and routing, the dense layer's gate_up; the CPU test above checks that a
    one-row step takes them). (The first form of this test, an inline engine without max_num_seqs, did not finish
    in 130 s on the seventeenth session's H200: unexplained.)"""
    from helpers_engine import greedy_on_cuda_switched
    from helpers_tiny_models import write_tiny_moe_model

    model = str(write_tiny_moe_model(tmp_path / "moe", "qwen3_moe_hd64"))
    outs = greedy_on_cuda_switched(model, "FLOTILLA_NORM_GEMV", monkeypatch)
    assert outs["1"] == outs["0"]
