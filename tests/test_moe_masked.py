"""Masked routing: expert id -1 marks a slot that adds nothing (kernels/moe/torch_ref.py), which is how the
all-gather expert-parallel layer (kernels/moe/ep_allgather.py) computes only its own experts' share of every rank's
tokens. Each backend with `masked=True` must give what the reference gives with those slots' weights at zero (a
float32 sum of exact zeros: the same numbers), and the groupings must leave those slots out of every run.
Triton runs under its CPU interpreter here (tests/conftest.py); the `gpu` tests repeat it at real sizes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

from flotilla.kernels.moe import routing, select_experts, torch_ref  # noqa: E402
from flotilla.kernels.quant import block_quantize  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
needs_triton = pytest.mark.skipif(not HAS_TRITON or not (ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="triton cannot run here")


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")(fn))


def _masked_case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int,
                 keep: float = 0.5, device: torch.device = DEVICE):  # fmt: skip
    """(x, w13, w2, weights, masked ids, the same routing with the masked slots sent to a real expert at weight
    zero): about `keep` of the slots kept, plus a token with every slot masked and one with none masked."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter**-0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen, device=device), top_k, True)
    drop = torch.rand(tokens, top_k, generator=gen, device=device) >= keep
    if tokens >= 2:
        drop[0], drop[1] = True, False
    masked = torch.where(drop, -1, ids).to(torch.int32)
    return x, w13, w2, weights, masked, torch.where(drop, 0.0, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_skips_masked_slots(dtype) -> None:
    x, w13, w2, weights, masked, zeroed = _masked_case(9, 16, 8, 6, 3, dtype, seed=1, device=torch.device("cpu"))
    ids = masked.clamp(min=0)
    got = torch_ref.fused_experts(x, w13, w2, weights, masked, masked=True)
    # to float32 rounding: an expert's GEMM has more rows with the zero-weight slots, and a CPU BLAS row's last bits
    # depend on the number of rows
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(got, torch_ref.fused_experts(x, w13, w2, zeroed, ids), atol=tol, rtol=tol)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # every slot masked
    assert not torch.equal(got, torch_ref.fused_experts(x, w13, w2, weights, ids))  # the mask did something


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(9, 6, 3, 4), (40, 8, 2, 16), (3, 4, 2, 16),
                                                                     (5, 4, 2, 1)])  # fmt: skip
def test_sort_by_expert_leaves_masked_slots_out(tokens, experts, top_k, block_m) -> None:
    *_, masked, _ = _masked_case(tokens, 8, 4, experts, top_k, torch.float32, seed=tokens, device=torch.device("cpu"))
    blocks = routing.sort_by_expert(masked, experts, block_m, masked=True)
    num_slots = tokens * top_k
    flat = masked.flatten()
    kept = torch.nonzero(flat >= 0).flatten().tolist()
    slots = blocks.sorted_slots.tolist()
    assert len(slots) == routing.padded_rows(num_slots, experts, block_m)
    assert sorted(s for s in slots if s < num_slots) == kept  # each kept slot once, no masked one
    counts = torch.bincount(flat[flat >= 0].long(), minlength=experts)
    num_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(blocks.num_padded) == num_padded
    for b in range(num_padded // block_m):
        run = [s for s in slots[b * block_m:(b + 1) * block_m] if s < num_slots]
        assert run and all(int(flat[s]) == int(blocks.block_experts[b]) for s in run)


@needs_triton
@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(9, 6, 3, 16), (300, 128, 8, 64),
                                                                     (4, 4, 2, 16)])  # fmt: skip
def test_one_launch_grouping_leaves_masked_slots_out_as_the_torch_version_does(tokens, experts, top_k, block_m):
    from flotilla.kernels.moe.triton_align import align_by_expert

    *_, masked, _ = _masked_case(tokens, 8, 4, experts, top_k, torch.float32, seed=tokens)
    got = align_by_expert(masked, experts, block_m)
    want = routing.sort_by_expert(masked.cpu(), experts, block_m, masked=True)
    assert torch.equal(got.num_padded.cpu(), want.num_padded)
    assert torch.equal(got.block_experts.cpu(), want.block_experts)
    experts_of_rows = want.block_experts.repeat_interleave(block_m)

    def runs(slots: torch.Tensor) -> list[tuple[int, int]]:  # (expert, slot) of every row in use
        slots = slots.cpu()
        real = slots < want.num_slots
        return sorted(zip(experts_of_rows[real].tolist(), slots[real].tolist()))

    assert runs(got.sorted_slots) == runs(want.sorted_slots)


def _check_triton(x, w13, w2, weights, masked, zeroed, **tiles) -> None:
    from flotilla.kernels.moe import triton_experts

    got = triton_experts.fused_experts(x, w13, w2, weights, masked, masked=True, **tiles)
    want = triton_experts.fused_experts(x, w13, w2, zeroed, masked.clamp(min=0), **tiles)
    ref = torch_ref.fused_experts(x, w13, w2, weights, masked, masked=True)
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    if bool((masked[0] < 0).all()):  # every slot masked (a case of two tokens or more): rows the kernel never wrote
        assert torch.equal(got[0], torch.zeros_like(got[0]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the CPU interpreter has no bfloat16 dots)
def test_triton_experts_with_masked_slots_match_the_reference(dtype) -> None:
    _check_triton(*_masked_case(7, 32, 16, 4, 2, dtype, seed=3), block_m=16, block_n=16, block_k=16)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_batch_experts_with_masked_slots_match_the_reference(dtype) -> None:
    _check_triton(*_masked_case(3, 32, 16, 4, 2, dtype, seed=5), small_tokens=4, small_block_n=8, small_block_k=16)


@needs_triton
def test_triton_fp8_experts_with_masked_slots_match_the_reference() -> None:
    from flotilla.kernels.moe import triton_experts

    x, w13, w2, weights, masked, zeroed = _masked_case(6, 32, 32, 4, 2, torch.float32, seed=4)
    block = (16, 16)
    w13q, w13s = zip(*(torch_ref.w13_block_quantize(w, block) for w in w13))
    w2q, w2s = zip(*(block_quantize(w, block) for w in w2))
    fp8 = (torch.stack(w13q), torch.stack(w13s), torch.stack(w2q), torch.stack(w2s))
    tiles = dict(block_m=16, block_n=16, block_k=16)
    got = triton_experts.fused_experts_fp8(x, fp8[0], fp8[1], fp8[2], fp8[3], weights, masked, block, True, **tiles)
    want = torch_ref.fused_experts_fp8_w8a8(x, *fp8, zeroed, masked.clamp(min=0), block)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@gpu_test
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_gpu_triton_experts_with_masked_slots_at_qwen3_30b_sizes(tokens) -> None:
    # EP2's share of Qwen3-30B-A3B: about half of each token's 8 slots on this rank's 64 of 128 experts
    _check_triton(*_masked_case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens))


def test_the_gathering_layer_takes_its_rows_in_chunks_with_the_same_result(monkeypatch) -> None:
    # one rank (no group): the layer is its experts on its own rows; chunked, every row still gets its sum
    from flotilla.kernels.moe import ep_allgather, get_moe_backend
    from flotilla.kernels.moe.expert_parallel import ExpertPlacement

    x, w13, w2, weights, _, _ = _masked_case(11, 16, 8, 6, 3, torch.float32, seed=7, device=torch.device("cpu"))
    ids = select_experts(torch.randn(11, 6, generator=torch.Generator().manual_seed(7)), 3, True)[1]
    layer = ep_allgather.GatheredTokenExperts(ExpertPlacement(6, 1, 0), None, get_moe_backend("torch"))
    want = torch_ref.fused_experts(x, w13, w2, weights, ids)
    with ep_allgather.ep_tokens(13):  # two padding rows
        whole = layer(x, w13, w2, weights, ids)
        monkeypatch.setattr(ep_allgather, "CHUNK_ROWS", 4)
        chunked = layer(x, w13, w2, weights, ids)
    torch.testing.assert_close(whole, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked, want, rtol=1e-6, atol=1e-6)
