"""MoE kernels: routing and token sorting, the torch reference against transformers' Qwen3-MoE block,
and the fused backends (triton, the deep_gemm layout) against the reference on fresh random inputs.

Without CUDA the triton kernel runs under triton's CPU interpreter at tiny sizes (TRITON_INTERPRET=1 is
set below, before kernels/moe/triton_experts.py is imported: triton.jit reads it when a kernel is
defined). The kernel uses only triton.language builtins, so it needs none of the interpreter repairs
that tests/test_kernels_triton.py makes. `gpu`-marked tests add realistic sizes on a CUDA device.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import transformers

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

from helpers_triton import compile_for_sm90  # noqa: E402
from flotilla.kernels.moe import (  # noqa: E402
    available_moe_backends,
    best_moe_backend,
    deep_gemm_experts,
    get_moe_backend,
    select_experts,
    sort_by_expert,
    torch_ref,
)
from flotilla.models.hf_config import MoEConfig  # noqa: E402
from flotilla.models.qwen3_moe import Qwen3MoeSparseBlock  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA and not INTERPRET else "cpu")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -e '.[dev]')")


def gpu_test(fn):
    """Marked `gpu` and skipped unless triton compiles for a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")(fn))


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int,
          renormalize: bool = True, device: torch.device = DEVICE):  # fmt: skip
    """(hidden, w13, w2, topk_weights, topk_ids) with weights scaled so activations stay O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = select_experts(logits, top_k, renormalize)
    return x, w13, w2, weights, ids


# ---- routing and sorting ----


def test_select_experts_is_softmax_top_k_renormalized_or_not():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    renormed, same_ids = select_experts(logits.to(torch.bfloat16), 2, renormalize=True)
    assert torch.equal(same_ids, ids) and renormed.dtype == torch.float32
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True), atol=1e-2, rtol=0)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(1, 8, 2, 16), (13, 6, 3, 4), (40, 4, 1, 16),
                                                                     (7, 32, 4, 2), (64, 3, 2, 1)])  # fmt: skip
def test_sort_by_expert_groups_every_slot_once_in_single_expert_blocks(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    blocks = sort_by_expert(ids, experts, block_m)
    num_slots = tokens * top_k
    slots = blocks.sorted_slots.tolist()
    num_padded = int(blocks.num_padded)
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert len(slots) % block_m == 0 and len(slots) >= num_padded
    assert sorted(s for s in slots if s < num_slots) == list(range(num_slots))  # each slot exactly once
    assert all(s == num_slots for s in slots[num_padded:])  # nothing real past the padded length
    flat = ids.flatten().tolist()
    previous = -1
    for b in range(num_padded // block_m):
        expert = int(blocks.block_experts[b])
        run = slots[b * block_m : (b + 1) * block_m]
        assert all(flat[s] == expert for s in run if s < num_slots)
        assert any(s < num_slots for s in run)  # no block is only padding
        real = [s for s in run if s < num_slots]
        assert real == sorted(real) and expert >= previous  # ascending experts, slots in order within one
        previous = expert


# ---- the reference against transformers ----


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_block_matches_transformers_qwen3_moe_block(norm_topk_prob):
    config = transformers.Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)  # fmt: skip
    hf_block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(int(norm_topk_prob))
    with torch.no_grad():
        for param in hf_block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    moe = MoEConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=norm_topk_prob,
                    decoder_sparse_step=1, mlp_only_layers=())  # fmt: skip
    block = Qwen3MoeSparseBlock(48, moe, get_moe_backend("torch"))
    block.load_state_dict(hf_block.state_dict())  # same names: gate.weight, experts.{gate_up,down}_proj
    x = torch.randn(2, 9, 48, generator=gen)
    with torch.inference_mode():
        want = hf_block(x)
        got = block(x.view(-1, 48)).view(2, 9, 48)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # bf16: both round per expert; ours sums the k outputs in float32
        want16 = hf_block.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
        got16 = block.to(torch.bfloat16)(x.view(-1, 48).to(torch.bfloat16)).view(2, 9, 48).float()
    torch.testing.assert_close(got16, want16, atol=3e-2, rtol=3e-2)


# ---- fused backends against the reference ----

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _check_fused(run, tokens, hidden, inter, experts, top_k, dtype, seed, device=DEVICE):
    x, w13, w2, weights, ids = _case(tokens, hidden, inter, experts, top_k, dtype, seed, device=device)
    want = torch_ref.fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    got = run(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if dtype != torch.float32:  # and rounded where the reference rounds: equal to its own-dtype run
        same_dtype = torch_ref.fused_experts(x, w13, w2, weights, ids)
        assert (got == same_dtype).float().mean().item() >= 0.9


@needs_triton
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "block_m", "block_n", "block_k", "dtype"),
    [
        (1, 32, 16, 4, 2, 16, 16, 16, torch.float32),  # one decode token: two blocks, one row each
        (5, 48, 24, 8, 2, 16, 16, 16, torch.float32),  # K and N not multiples of the tiles; idle experts
        (20, 32, 32, 4, 3, 16, 32, 16, torch.float32),  # experts with more than one block of rows
        (9, 40, 16, 6, 1, 32, 16, 32, torch.float16),  # top-1, a row tile larger than any expert's run
        (0, 32, 16, 4, 2, 16, 16, 16, torch.float32),  # an empty batch
    ],
)
def test_triton_fused_experts_match_reference(tokens, hidden, inter, experts, top_k, block_m, block_n, block_k,
                                              dtype):  # fmt: skip
    from flotilla.kernels.moe import triton_experts

    def run(x, w13, w2, weights, ids):  # small_tokens=0: the sorted GEMMs even for the one decode token
        return triton_experts.fused_experts(x, w13, w2, weights, ids, block_m=block_m, block_n=block_n,
                                            block_k=block_k, small_tokens=0)  # fmt: skip

    _check_fused(run, tokens, hidden, inter, experts, top_k, dtype, seed=tokens + hidden)


@needs_triton
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "block_n", "block_k", "dtype"),
    [
        (1, 32, 16, 4, 2, 16, 16, torch.float32),  # one decode token
        (3, 48, 24, 8, 3, 16, 32, torch.float32),  # K and N not multiples of the tiles; two tokens on one expert
        (4, 40, 16, 6, 1, 8, 64, torch.float16),  # top-1, a K tile wider than K
        (2, 32, 48, 4, 4, 32, 16, torch.float16),  # every expert, several K steps in the down pass
    ],
)
def test_small_batch_experts_match_reference(tokens, hidden, inter, experts, top_k, block_n, block_k, dtype):
    """The token-major path for decode-sized batches (kernels/moe/triton_experts_small.py): no sorting, the combine
    in the down pass; the same numbers as the reference, rounded where it rounds."""
    from flotilla.kernels.moe import triton_experts_small

    def run(x, w13, w2, weights, ids):
        return triton_experts_small.fused_experts_small(x, w13, w2, weights, ids, block_n, block_k)

    _check_fused(run, tokens, hidden, inter, experts, top_k, dtype, seed=tokens + inter)


@needs_triton
@pytest.mark.parametrize(("tokens", "top_k", "block_n", "dtype"), [(1, 4, 16, torch.float32), (3, 3, 8, torch.float16)])
def test_the_per_slot_down_pass_gives_the_token_major_bits_masked_slots_included(tokens, top_k, block_n, dtype,
                                                                                 monkeypatch):  # fmt: skip
    """FLOTILLA_MOE_TILES "ds=1": the small path's down pass with a program per slot, the last of a token's programs
    adding its rows (kernels/arrivals.py), gives the token-major pass's numbers bit for bit, with masked (negative)
    slots adding nothing, and leaves every arrival counter at 0."""
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe import triton_experts, triton_experts_small

    launched = []

    class Spy:  # the per-slot kernel's grids, as launched
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(triton_experts_small, "_small_down_slot_kernel",
                        Spy(triton_experts_small._small_down_slot_kernel))  # fmt: skip
    x, w13, w2, weights, ids = _case(tokens, 48, 40, 6, top_k, dtype, seed=tokens)
    ids[0, 1] = -1  # masked routing (expert parallelism): a slot no rank computes
    per_slot = triton_experts.parse_tiles("ds=1")
    got = triton_experts.fused_experts(x, w13, w2, weights, ids, small_block_n=block_n, small_block_k=16,
                                       masked=True, **per_slot)  # fmt: skip
    assert launched == [(tokens * top_k, -(-48 // block_n))]
    want = triton_experts_small.fused_experts_small(x, w13, w2, weights, ids, block_n, 16)
    assert len(launched) == 1  # (the token-major pass without ds)
    assert torch.equal(got, want)
    counters = arrival_counters(x.device)
    assert counters is not None and not counters.any()
    kept = ids[0] >= 0  # and the masked slot is no slot: the reference without it
    ref = torch_ref.fused_experts(x[:1].float(), w13.float(), w2.float(), weights[:1, kept], ids[:1, kept])
    torch.testing.assert_close(got[:1].float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_triton
def test_one_token_takes_the_per_slot_down_pass_by_default_with_the_same_bits(monkeypatch):
    """At one token fused_experts' down pass is a program per (slot, 32 columns) unless a down tile is given ("ds=0":
    the token-major pass); two tokens keep the token-major pass. Same bits either way."""
    from flotilla.kernels.moe import triton_experts, triton_experts_small

    launched = []
    kernel = triton_experts_small._small_down_slot_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_experts_small, "_small_down_slot_kernel", Spy())
    monkeypatch.delenv("FLOTILLA_MOE_TILES", raising=False)
    x, w13, w2, weights, ids = _case(2, 80, 40, 6, 4, torch.float32, seed=7)
    got = triton_experts.fused_experts(x[:1], w13, w2, weights[:1], ids[:1], small_block_k=16)
    assert launched == [(4, -(-80 // triton_experts_small.ONE_TOKEN_DOWN["block_n"]))]
    token_major = triton_experts.fused_experts(x[:1], w13, w2, weights[:1], ids[:1], small_block_k=16,
                                               small_down_per_slot=0)  # fmt: skip
    both = triton_experts.fused_experts(x, w13, w2, weights, ids, small_block_k=16)
    assert len(launched) == 1
    assert torch.equal(got, token_major) and torch.equal(got, both[:1])


@needs_triton
def test_small_batches_take_the_token_major_path_and_larger_ones_the_sorted_gemms(monkeypatch):
    """fused_experts sends batches of up to SMALL_BATCH_MAX_TOKENS tokens (or the caller's / FLOTILLA_MOE_TILES'
    small_tokens, t=N) to the small-batch kernels, the rest to the sorted GEMMs; both give the reference's numbers."""
    from flotilla.kernels.moe import triton_experts, triton_experts_small

    calls = []
    for name, module in (("small", triton_experts_small), ("sorted", triton_experts)):
        real = getattr(module, "fused_experts_small" if name == "small" else "_two_passes")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, args[0].shape[0]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, real.__name__, spy)
    limit = triton_experts_small.SMALL_BATCH_MAX_TOKENS
    for tokens in (1, limit, limit + 1):
        _check_fused(triton_experts.fused_experts, tokens, 32, 16, 4, 2, torch.float32, seed=tokens)
    assert calls == [("small", 1), ("small", limit), ("sorted", limit + 1)]
    calls.clear()
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "t=0")
    _check_fused(triton_experts.fused_experts, 1, 32, 16, 4, 2, torch.float32, seed=1)
    _check_fused(lambda *a: triton_experts.fused_experts(*a, small_tokens=8), 6, 32, 16, 4, 2, torch.float32, seed=6)
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "t=2,sn=8,sk=16")
    _check_fused(triton_experts.fused_experts, 2, 32, 16, 4, 2, torch.float32, seed=2)
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "sn=16,sk=16,dn=8,dk=32,dw=2")  # the down pass tiled on its own
    _check_fused(triton_experts.fused_experts, 3, 32, 16, 4, 2, torch.float32, seed=3)
    monkeypatch.delenv("FLOTILLA_MOE_TILES")  # and as keyword arguments (bench_kernels' sweeps pass them so)
    down = triton_experts.parse_tiles("dn=8,dk=32,dw=2")
    _check_fused(lambda *a: triton_experts.fused_experts(*a, **down), 3, 32, 16, 4, 2, torch.float32, seed=4)
    assert calls == [("sorted", 1), ("small", 6), ("small", 2), ("small", 3), ("small", 3)]


@needs_triton
def test_moe_tiles_from_the_environment_reach_the_kernel_and_bad_ones_are_refused(monkeypatch):
    """FLOTILLA_MOE_TILES (tuning sweeps) sets tiles and launch options the caller leaves open; explicit ones win."""
    from flotilla.kernels.moe import triton_experts

    seen = []
    real = triton_experts._expert_gemm

    def spy(*args, **kwargs):
        seen.append((args[3].block_m, args[7], args[8], args[11] if len(args) > 11 else kwargs.get("launch")))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_experts, "_expert_gemm", spy)
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "m=32,n=16,k=32,w=2,s=2")
    _check_fused(triton_experts.fused_experts, 5, 48, 24, 8, 2, torch.float32, seed=3)
    assert seen[-1] == (32, 16, 32, {"num_warps": 2, "num_stages": 2})
    _check_fused(lambda *a: triton_experts.fused_experts(*a, block_n=32), 5, 48, 24, 8, 2, torch.float32, seed=3)
    assert seen[-1][2] == 32  # the caller's block_n over the environment's
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "m=32,n=16,k=32,w=2,s=2,pn=32,pk=16,pw=4")  # the down pass on its own
    seen.clear()
    _check_fused(triton_experts.fused_experts, 5, 48, 24, 8, 2, torch.float32, seed=5)
    assert seen == [(32, 16, 32, {"num_warps": 2, "num_stages": 2}), (32, 32, 16, {"num_warps": 4, "num_stages": 2})]
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "m=32,q=1")
    with pytest.raises(ValueError, match="FLOTILLA_MOE_TILES: 'q=1'"):
        _check_fused(triton_experts.fused_experts, 5, 48, 24, 8, 2, torch.float32, seed=3)


@needs_triton
def test_default_tiles_follow_the_slots_per_expert_and_match_the_reference(monkeypatch):
    """The bf16 sorted GEMMs take sorted_tiles' row blocks (16, 32, 64, 128 rows as experts get more slots each) with
    their launch options; every tier gives the reference's numbers."""
    from flotilla.kernels.moe import triton_experts

    seen = []
    real = triton_experts._two_passes
    monkeypatch.setattr(triton_experts, "_two_passes",
                        lambda *a, **kw: seen.append((a[5], kw["launch"], kw["down"])) or real(*a, **kw))  # fmt: skip
    for tokens in (12, 30, 60, 100):  # 4 experts, top-2: 6, 15, 30 and 50 slots per expert
        _check_fused(triton_experts.fused_experts, tokens, 32, 16, 4, 2, torch.float32, seed=tokens)
    assert [m for m, _, _ in seen] == [16, 32, 64, 128]
    assert seen[-1][1] == {"num_warps": 8, "num_stages": 4}
    assert [d for _, _, d in seen] == [{}, {}, {}, {"block_n": 256, "block_k": 32}]  # the top tier's own down tiles
    # (float32 here: K tiles half the bf16 ones, the same bytes per pipeline stage, within an H100's shared memory)
    top = triton_experts.sorted_tiles(50 * 4, 4)
    assert (top["block_k"], top["down_block_k"]) == (64, 64)
    for slots in (6, 15, 30, 50):
        bf16, fp32 = triton_experts.sorted_tiles(slots * 4, 4), triton_experts.sorted_tiles(slots * 4, 4, 4)
        for tiles in (bf16, fp32):  # gate_up stages: a [M, K] block of rows and gate's and up's [K, N] blocks
            elements = tiles["block_m"] * tiles["block_k"] + 2 * tiles["block_k"] * tiles["block_n"]
            assert (tiles["num_stages"] - 1) * elements * (4 if tiles is fp32 else 2) <= 227 * 1024


@pytest.mark.parametrize(("tokens", "alignment", "dtype"), [(1, 8, torch.float32), (11, 4, torch.float32),
                                                            (30, 16, torch.bfloat16)])  # fmt: skip
def test_deep_gemm_layout_with_its_gemm_contract_matches_reference(tokens, alignment, dtype):
    """The deep_gemm backend's gather / grouped GEMMs / scatter / combine, with DeepGEMM's GEMM replaced by
    a torch implementation of its contract (padding rows marked -1 are filled with NaN first: a layout
    that read them would poison the result)."""

    def nan_padding_gemm(a, b, d, m_indices):
        d.fill_(float("nan"))
        deep_gemm_experts.grouped_gemm_reference(a, b, d, m_indices)

    def run(x, w13, w2, weights, ids):
        return deep_gemm_experts.fused_experts(x, w13, w2, weights, ids, gemm=nan_padding_gemm, alignment=alignment)

    _check_fused(run, tokens, 32, 16, 6, 2, dtype, seed=tokens, device=torch.device("cpu"))


def test_backend_dispatch_by_name_and_capability():
    assert set(available_moe_backends()) == {"auto", "torch", "triton", "deep_gemm"}
    assert get_moe_backend("torch").fused_experts is torch_ref.fused_experts
    assert best_moe_backend(torch.device("cpu")) == "torch"  # even with the triton interpreter on
    with pytest.raises(ValueError, match="unknown MoE backend 'cutlass'; choices: auto, torch"):
        get_moe_backend("cutlass")
    if deep_gemm_experts.import_deep_gemm() is None:
        with pytest.raises(ValueError, match="'deep_gemm' needs the deep_gemm package"):
            get_moe_backend("deep_gemm")
    if HAS_TRITON and (ON_CUDA or INTERPRET):
        from flotilla.kernels.moe import triton_experts

        assert get_moe_backend("triton").fused_experts is triton_experts.fused_experts
        if ON_CUDA:
            assert best_moe_backend(torch.device("cuda"), torch.bfloat16) in ("triton", "deep_gemm")


@needs_triton
def test_tiny_qwen3_moe_with_triton_experts_matches_torch_experts(tmp_path):
    from helpers_tiny_models import PagedRunner, write_tiny_moe_model
    from safetensors.torch import load_file

    from flotilla.models.hf_config import load_hf_config
    from flotilla.models.qwen3_moe import Qwen3MoeForCausalLM

    model_dir = write_tiny_moe_model(tmp_path / "moe", "qwen3_moe")
    weights = load_file(str(model_dir / "model.safetensors"))
    runners = []
    for backend in ("torch", "triton"):
        model = Qwen3MoeForCausalLM(load_hf_config(model_dir), attention_backend="torch", moe_backend=backend)
        model.load_weights(weights.items())
        assert model.moe_backend_name == backend
        runners.append(PagedRunner(model.eval(), block_size=4))
    for batch in ([(0, list(range(10, 19))), (1, [5, 6, 7])], [(0, [40]), (1, [41])]):
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.slow
def test_expert_gemm_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter checks little of the language's typing: compile both passes for Hopper (sm_90) at
    Qwen3-30B-A3B's shapes (bf16, H 2048, I 768, top-8), and in the FP8 mode at DeepSeek-V3's (e4m3 with 128x128
    block scales, bf16 activations, H 7168, I 2048, top-8), in a child without TRITON_INTERPRET."""
    pointers = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_slots_ptr": "*i32",
                "block_experts_ptr": "*i32", "num_padded_ptr": "*i32", "weights_ptr": "*fp32",
                "a_scale_ptr": "*bf16", "w_scale_ptr": "*bf16"}  # fmt: skip
    bf16 = dict(FP8=False, UP_SCALE_ROW=0, BLOCK_SCALE_N=1, BLOCK_SCALE_K=1)  # the FP8 mode is tests/test_fp8_moe.py's
    specs = [
        (pointers, dict(N=768, K=2048, TOP_K=8, GATE_UP=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                        DOT_PRECISION="tf32", **bf16)),
        (pointers, dict(N=2048, K=768, TOP_K=8, GATE_UP=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
                        DOT_PRECISION="tf32", **bf16)),
    ]  # fmt: skip
    fp8_pointers = {**pointers, "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32",
                    "w_scale_ptr": "*fp32"}  # fmt: skip
    fp8 = dict(TOP_K=8, FP8=True, BLOCK_SCALE_N=128, BLOCK_SCALE_K=128, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32")
    specs += [(fp8_pointers, dict(fp8, N=2048, K=7168, GATE_UP=True, UP_SCALE_ROW=16, BLOCK_M=64)),
              (fp8_pointers, dict(fp8, N=7168, K=2048, GATE_UP=False, UP_SCALE_ROW=0, BLOCK_M=16)),
              ({**fp8_pointers, "combined_ptr": "*bf16", "count_ptr": "*i32"},  # the down pass's own combine
               dict(fp8, N=7168, K=2048, GATE_UP=False, UP_SCALE_ROW=0, BLOCK_M=16, COMBINE=True))]  # fmt: skip
    kernels = [("flotilla.kernels.moe.triton_experts", "_expert_gemm_kernel", p, [], {"COMBINE": False, **c}, 4)
               for p, c in specs]  # fmt: skip
    small = "flotilla.kernels.moe.triton_experts_small"
    tiles = dict(TOP_K=8, BLOCK_N=16, BLOCK_K=128)
    kernels += [(small, "_small_gate_up_kernel", {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32",
                                                  "out_ptr": "*bf16"}, [], dict(tiles, N=768, K=2048), 4),
                (small, "_small_down_kernel", {"act_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32",
                                               "weights_ptr": "*fp32", "out_ptr": "*bf16"}, [],
                 dict(tiles, N=2048, K=768, TOP_K_P2=8), 8),
                (small, "_small_down_slot_kernel", {"act_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32",
                                                    "weights_ptr": "*fp32", "rows_ptr": "*bf16", "out_ptr": "*bf16",
                                                    "count_ptr": "*i32"}, [], dict(tiles, N=2048, K=768), 8)]
    # fmt: skip
    compile_for_sm90(kernels, tmp_path)


@needs_triton
@pytest.mark.parametrize("path", ["sorted", "small", "deep_gemm_layout"])
def test_every_backend_clamps_the_swiglu_as_deepseek_v4_does(path):
    """swiglu_limit (DeepSeek-V4's experts): gate clamped to at most the limit, up to within +-it, before
    silu(gate) * up; at a limit that binds, each backend gives the reference's clamped result, not the plain one."""
    from flotilla.kernels.moe import triton_experts, triton_experts_small

    limit = 0.3
    x, w13, w2, weights, ids = _case(6, 32, 16, 4, 2, torch.float32, seed=3, device=torch.device("cpu"))
    x, w13 = 3 * x, 2 * w13  # activations of a few units: the limit binds on most of them
    want = torch_ref.fused_experts(x, w13, w2, weights, ids, swiglu_limit=limit)
    plain = torch_ref.fused_experts(x, w13, w2, weights, ids)
    assert not torch.allclose(want, plain, atol=1e-3)

    def manual(e, rows):  # the clamp written out, for the reference itself
        gate, up = torch.nn.functional.linear(rows, w13[e]).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        return torch.nn.functional.linear(act, w2[e])

    torch.testing.assert_close(want, torch_ref._combine(x, weights, ids, manual), atol=1e-6, rtol=0)
    move = (lambda t: t.to(DEVICE)) if path != "deep_gemm_layout" else (lambda t: t)
    args = [move(t) for t in (x, w13, w2, weights, ids)]
    if path == "sorted":
        got = triton_experts.fused_experts(*args, swiglu_limit=limit, block_m=16, block_n=16, block_k=16,
                                           small_tokens=0)
    elif path == "small":
        got = triton_experts_small.fused_experts_small(*args, 16, 16, swiglu_limit=limit)
    else:
        got = deep_gemm_experts.fused_experts(*args, swiglu_limit=limit, gemm=deep_gemm_experts.grouped_gemm_reference,
                                              alignment=4)
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)


# ---- realistic sizes on the GPU (bf16, Qwen3-30B-A3B's expert shapes) ----


@gpu_test
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
def test_gpu_triton_fused_experts_at_qwen3_30b_sizes(tokens):
    from flotilla.kernels.moe import triton_experts

    _check_fused(triton_experts.fused_experts, tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)


@gpu_test
def test_gpu_float32_experts_fit_shared_memory_at_every_tier():
    """A float32 model's sorted GEMMs at each tier of tiles, the top one (over 32 slots per expert) included, whose
    bf16-sized K tiles in float32 needed more shared memory than an H100 has (triton's OutOfResources)."""
    from flotilla.kernels.moe import triton_experts

    for tokens in (64, 256, 1024):  # 4, 16 and 64 slots per expert
        _check_fused(triton_experts.fused_experts, tokens, 2048, 768, 128, 8, torch.float32, seed=tokens)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_clamped_swiglu_experts_at_deepseek_v4_flash_sizes(tokens):
    """V4-Flash's experts (H 4096, I 2048, 256 experts, top-6) with their swiglu_limit of 10, on the path each batch
    takes, against the float32 reference: as close to it as torch's own bfloat16 computation is (the clamped
    activations reach 110, where bfloat16 steps by 0.5, so a fixed tolerance would measure the rounding)."""
    from flotilla.kernels.moe import triton_experts

    x, w13, w2, weights, ids = _case(tokens, 4096, 2048, 256, 6, torch.bfloat16, seed=tokens, device=DEVICE)
    x = 8 * x  # gate and up values past the limit
    want = torch_ref.fused_experts(x.float(), w13.float(), w2.float(), weights, ids, swiglu_limit=10.0)
    rounded = torch_ref.fused_experts(x, w13, w2, weights, ids, swiglu_limit=10.0).float()
    got = triton_experts.fused_experts(x, w13, w2, weights, ids, swiglu_limit=10.0).float()
    err, torch_err = (got - want).abs().max().item(), (rounded - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-2, (err, torch_err)
    assert torch_err < 0.05 * want.abs().max().item()  # (the bound is not loose: bf16 rounding, not a lost clamp)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_gpu_small_batch_experts_at_qwen3_30b_sizes(tokens):
    from flotilla.kernels.moe import triton_experts_small

    _check_fused(triton_experts_small.fused_experts_small, tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_per_slot_down_pass_gives_the_token_major_bits_at_qwen3_30b_sizes(tokens):
    """FLOTILLA_MOE_TILES ds=1 on the GPU: the same bits as the token-major down pass, counters back at 0, over
    several launches (a counter left behind would corrupt the next)."""
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe import triton_experts_small

    for seed in range(3):
        x, w13, w2, weights, ids = _case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=seed, device=DEVICE)
        want = triton_experts_small.fused_experts_small(x, w13, w2, weights, ids)
        got = triton_experts_small.fused_experts_small(x, w13, w2, weights, ids, down={"per_slot": 1})
        assert torch.equal(got, want)
        assert not arrival_counters(x.device).any()


@gpu_test
@pytest.mark.skipif(deep_gemm_experts.import_deep_gemm() is None, reason="deep_gemm is not installed")
@pytest.mark.parametrize("tokens", [64, 4096])
def test_gpu_deep_gemm_fused_experts_at_qwen3_30b_sizes(tokens):
    _check_fused(deep_gemm_experts.fused_experts, tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)
