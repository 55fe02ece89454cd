"""The one-launch triton routing kernels (kernels/moe/triton_routing.py) against the torch routing
(kernels/moe/routing.py): softmax top-k (Qwen2/3-MoE, Mixtral, Qwen3-Next) and DeepSeek-V3's grouped noaux_tc.

Without CUDA the kernels run under triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton) at tiny batch sizes but real expert counts; the kernels use tl.max / tl.min / tl.sum,
which the interpreter runs as numpy, so the whole file takes a few seconds. Logits are drawn without ties
(distinct values representable in the logits' dtype): on ties torch.topk promises no order, the kernels take
the lowest id (checked on its own). The grouped reference returns ids in torch.topk(sorted=False) order, so
those are compared per row as sets. Mutated kernels (renormalization, softmax, bias, group rating, padding mask
or scaling dropped) fail the same checks. `gpu` tests run real batch sizes on CUDA, also inside a CUDA graph,
and a `slow` test compiles both kernels for sm_90 without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

if not HAS_TRITON or not (ON_CUDA or INTERPRET):
    pytest.skip("triton cannot run here (no CUDA device and TRITON_INTERPRET is not 1)", allow_module_level=True)

from helpers_triton import compile_for_sm90  # noqa: E402
from flotilla.kernels.moe import routing, triton_routing  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA and not INTERPRET else "cpu")
RTOL, ATOL = (1e-5, 1e-8) if DEVICE.type == "cuda" else (2e-6, 1e-9)  # CUDA: tl.exp is ex2.approx, torch's expf


def gpu_test(fn):
    """Marked `gpu` and skipped unless triton compiles for a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")(fn))


def _logits(tokens: int, experts: int, dtype: torch.dtype, seed: int, device: torch.device = DEVICE) -> torch.Tensor:
    """[tokens, experts] in dtype, each row `experts` distinct values of [-6, 6] (at least 2^-11 apart): no ties."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.linspace(-6, 6, 20001).to(dtype).unique()
    picks = torch.stack([torch.randperm(pool.numel(), generator=gen)[:experts] for _ in range(tokens)])
    return pool[picks.reshape(tokens, experts)].to(device)


def _check_softmax(fn, logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    weights, ids = fn(logits, top_k, renormalize)
    want_w, want_ids = routing.select_experts_torch(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, want_ids)  # same experts, same (descending) order
    torch.testing.assert_close(weights, want_w, rtol=RTOL, atol=ATOL)


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def _check_grouped(fn, logits: torch.Tensor, top_k: int, groups: int, topk_groups: int, bias: torch.Tensor | None,
                   renormalize: bool, scaling: float) -> None:  # fmt: skip
    weights, ids = fn(logits, top_k, groups, topk_groups, bias, renormalize, scaling)
    want_w, want_ids = routing.select_experts_grouped_torch(logits, top_k, groups, topk_groups, bias, renormalize,
                                                            scaling)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    weights, ids = _sorted_by_id(weights, ids)
    want_w, want_ids = _sorted_by_id(want_w, want_ids.to(torch.int32))
    assert torch.equal(ids, want_ids)  # the same set of experts per row
    torch.testing.assert_close(weights, want_w, rtol=RTOL, atol=ATOL)


# ---- softmax top-k ----

SOFTMAX_CASES = [  # (tokens, experts, top_k)
    (1, 128, 8),  # Qwen3-30B-A3B decode
    (6, 128, 8),
    (1, 60, 4),  # Qwen1.5-MoE: E not a power of two
    (5, 60, 4),
    (3, 256, 8),
    (2, 512, 10),  # Qwen3-Next
    (9, 8, 2),  # Mixtral
    (3, 8, 8),  # top_k == E
]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), SOFTMAX_CASES)
def test_fused_select_experts_matches_select_experts(tokens, experts, top_k, dtype, renormalize):
    logits = _logits(tokens, experts, dtype, seed=tokens * 1000 + experts)
    _check_softmax(triton_routing.fused_select_experts, logits, top_k, renormalize)


def test_fused_select_experts_fp16_and_a_strided_row_view():
    wide = _logits(7, 160, torch.float16, seed=3)
    logits = wide[:, 16:144]  # rows 160 apart: a view of a wider projection, not copied
    assert not logits.is_contiguous()
    _check_softmax(triton_routing.fused_select_experts, logits, 8, True)


def test_fused_select_experts_ties_go_to_the_lowest_id():
    logits = torch.zeros(3, 60, device=DEVICE)
    logits[1, [7, 40, 50]] = 1.0  # three equal winners, then 57 equal losers
    weights, ids = triton_routing.fused_select_experts(logits, 5, False)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [7, 40, 50, 0, 1], [0, 1, 2, 3, 4]]
    torch.testing.assert_close(weights[0], torch.full((5,), 1 / 60, device=DEVICE))
    weights, _ = triton_routing.fused_select_experts(logits, 5, True)
    torch.testing.assert_close(weights[0], torch.full((5,), 1 / 5, device=DEVICE))


def test_no_tokens_launch_nothing_and_bad_shapes_are_refused():
    empty = torch.empty(0, 128, dtype=torch.bfloat16, device=DEVICE)
    for weights, ids in (triton_routing.fused_select_experts(empty, 8, True),
                         triton_routing.fused_select_experts_grouped(empty, 8, 8, 4)):  # fmt: skip
        assert weights.shape == ids.shape == (0, 8)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    logits = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        triton_routing.fused_select_experts(logits, 65, True)
    with pytest.raises(ValueError, match="at most"):
        triton_routing.fused_select_experts(torch.zeros(1, 2048, device=DEVICE), 8, True)
    with pytest.raises(ValueError, match="groups"):
        triton_routing.fused_select_experts_grouped(logits, 4, 6, 2)
    with pytest.raises(ValueError, match="topk_groups"):
        triton_routing.fused_select_experts_grouped(logits, 4, 8, 9)
    with pytest.raises(ValueError, match="correction_bias"):
        triton_routing.fused_select_experts_grouped(logits, 4, 8, 2, torch.zeros(32, device=DEVICE))


# ---- DeepSeek-V3's grouped top-k ----

GROUPED_CASES = [  # (tokens, experts, groups, topk_groups, top_k)
    (1, 256, 8, 4, 8),  # DeepSeek-V3 decode
    (5, 256, 8, 4, 8),
    (3, 64, 4, 2, 6),
    (4, 60, 4, 2, 30),  # groups of 15 (padded to 16), top_k takes every expert of the two chosen groups
    (3, 160, 1, 1, 8),  # one group: plain sigmoid top-k with a bias
    (2, 16, 16, 4, 3),  # one expert per group: a group is rated by its only expert
]


@pytest.mark.parametrize(("renormalize", "scaling"), [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("tokens", "experts", "groups", "topk_groups", "top_k"), GROUPED_CASES)
def test_fused_select_experts_grouped_matches_select_experts_grouped(tokens, experts, groups, topk_groups, top_k,
                                                                     dtype, with_bias, renormalize, scaling):  # fmt: skip
    logits = _logits(tokens, experts, dtype, seed=tokens * 1000 + experts)
    gen = torch.Generator().manual_seed(experts)
    bias = (torch.randn(experts, generator=gen) * 0.3).to(DEVICE) if with_bias else None
    _check_grouped(triton_routing.fused_select_experts_grouped, logits, top_k, groups, topk_groups, bias,
                   renormalize, scaling)  # fmt: skip


# ---- the checks above catch a broken kernel ----

MUTATIONS = {  # name: (kernel source, mutated source)
    "renormalization dropped": ("top_w = top_w / tl.sum(top_w, 1)[:, None]", "top_w = top_w"),
    "softmax not normalized": ("probs = e / tl.sum(e, 1)[:, None]", "probs = e"),
    "softmax dropped": ("e = tl.exp(x - row_max[:, None])", "e = x"),
    "grouped renormalization dropped": ("top_w = top_w / (tl.sum(top_w, 1)[:, None] + 1e-20)", "top_w = top_w"),
    "correction bias ignored": ("choice = scores + bias[None, :, :]", "choice = scores"),
    "group rated by its best only": ("group_score = best1 + tl.max(rest, 2)", "group_score = best1"),
    "padding lanes summed into weights": (
        "sel = lane_ok3 & (expert3 == idx[:, None, None])",
        "sel = expert3 == idx[:, None, None]",
    ),
    "routed scaling dropped": ("top_w = top_w * scaling", "top_w = top_w"),
}


def _mutation_check(module) -> None:
    """A few cases of each kernel, renormalize on and off (a softmax left unnormalized hides behind it)."""
    for renormalize in (True, False):
        _check_softmax(module.fused_select_experts, _logits(4, 60, torch.float32, seed=1), 4, renormalize)
    gen = torch.Generator().manual_seed(0)
    bias = (torch.randn(60, generator=gen) * 0.5).to(DEVICE)
    for renormalize, scaling in ((True, 2.5), (False, 1.0)):
        _check_grouped(module.fused_select_experts_grouped, _logits(6, 60, torch.float32, seed=2), 30, 4, 2, bias,
                       renormalize, scaling)  # fmt: skip


@pytest.fixture(scope="module")
def real_kernels_pass() -> None:
    """The real kernels pass the mutation check (checked here, once for every mutation)."""
    _mutation_check(triton_routing)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the softmax dropped: -inf padding / -inf sum
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_mutated_kernel_fails_the_check(mutation: str, tmp_path: Path, real_kernels_pass: None) -> None:
    old, new = MUTATIONS[mutation]
    source = Path(triton_routing.__file__).read_text()
    assert source.count(old) == 1
    path = tmp_path / "mutated_triton_routing.py"  # triton.jit reads the kernel's source from its file
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("mutated_triton_routing", path)
    mutated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutated)
    with pytest.raises(AssertionError):  # (the real kernels pass: real_kernels_pass)
        _mutation_check(mutated)


# ---- compiled for Hopper (sm_90) without a GPU ----


@pytest.mark.slow
def test_routing_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter checks little of the language's typing: compile both kernels for Hopper (sm_90) at the
    shapes in use (Qwen3-30B-A3B's 128 experts top-8 in bf16, decode and prefill; Qwen3-Next's 512 top-10;
    60 top-4 in fp32; DeepSeek-V3's 256 experts in 8 groups, top-4 groups, top-8, with and without a bias),
    in a child without TRITON_INTERPRET."""
    out = {"weights_ptr": "*fp32", "ids_ptr": "*i32"}
    bf16, fp32 = {"logits_ptr": "*bf16", **out}, {"logits_ptr": "*fp32", **out}
    softmax = "_softmax_topk_kernel"
    specs = [
        (softmax, bf16, dict(E=128, TOP_K=8, RENORMALIZE=True, BLOCK_T=1, BLOCK_E=128, BLOCK_K=8), 1),
        (softmax, bf16, dict(E=128, TOP_K=8, RENORMALIZE=True, BLOCK_T=8, BLOCK_E=128, BLOCK_K=8), 4),
        (softmax, bf16, dict(E=512, TOP_K=10, RENORMALIZE=True, BLOCK_T=1, BLOCK_E=512, BLOCK_K=16), 2),
        (softmax, fp32, dict(E=60, TOP_K=4, RENORMALIZE=False, BLOCK_T=16, BLOCK_E=64, BLOCK_K=4), 4),
    ]
    grouped = "_grouped_topk_kernel"
    v3 = dict(G=8, PG=32, TOPK_GROUPS=4, TOP_K=8, RENORMALIZE=True, BLOCK_G=8, BLOCK_P=32, BLOCK_K=8)
    specs += [
        (grouped, {**bf16, "bias_ptr": "*fp32", "scaling": "fp32"}, dict(v3, HAS_BIAS=True, BLOCK_T=1), 1),
        (grouped, {**fp32, "bias_ptr": "*fp32", "scaling": "fp32"}, dict(v3, HAS_BIAS=False, BLOCK_T=4), 4),
    ]
    compile_for_sm90([("flotilla.kernels.moe.triton_routing", name, p, [], c, w) for name, p, c, w in specs], tmp_path)


# ---- real batch sizes on the GPU ----


@gpu_test
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (60, 4), (512, 10), (8, 2)])
@pytest.mark.parametrize("tokens", [1, 3, 64, 4096])
def test_gpu_fused_select_experts(tokens, experts, top_k, dtype, renormalize):
    logits = _logits(tokens, experts, dtype, seed=tokens + experts)
    _check_softmax(triton_routing.fused_select_experts, logits, top_k, renormalize)


@gpu_test
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 64, 4096])
def test_gpu_fused_select_experts_grouped_at_deepseek_v3_sizes(tokens, dtype, with_bias):
    logits = _logits(tokens, 256, dtype, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    bias = (torch.randn(256, generator=gen) * 0.3).to(DEVICE) if with_bias else None
    _check_grouped(triton_routing.fused_select_experts_grouped, logits, 8, 8, 4, bias, True, 2.5)


@gpu_test
def test_gpu_routing_replays_in_a_cuda_graph():
    """Static shapes, no host sync: captured once, replayed on new logits in place, both kernels match torch."""
    logits = _logits(8, 256, torch.bfloat16, seed=0)
    bias = torch.randn(256, device=DEVICE) * 0.3
    for _ in range(2):  # compile outside the capture
        triton_routing.fused_select_experts(logits, 8, True)
        triton_routing.fused_select_experts_grouped(logits, 8, 8, 4, bias, True, 2.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        softmax_out = triton_routing.fused_select_experts(logits, 8, True)
        grouped_out = triton_routing.fused_select_experts_grouped(logits, 8, 8, 4, bias, True, 2.5)
    for seed in (1, 2):
        logits.copy_(_logits(8, 256, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        _check_softmax(lambda *args: softmax_out, logits, 8, True)
        _check_grouped(lambda *args: grouped_out, logits, 8, 8, 4, bias, True, 2.5)
