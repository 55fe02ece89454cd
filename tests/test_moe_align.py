"""The one-launch expert grouping (kernels/moe/triton_align.py) against routing.sort_by_expert's torch version.

Both must give the same sizes, padding, block experts and rows in use, and the same slots in every block of
block_m rows (the triton version may order the slots of one expert differently). On CPU the kernel runs under
triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the `gpu` test adds real sizes on CUDA, where
sort_by_expert itself dispatches to the kernel, and checks the fused experts give the same output either way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from flotilla.kernels.moe import routing

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _ids(tokens: int, experts: int, top_k: int, seed: int, device: str = "cpu", skew: bool = False) -> torch.Tensor:
    """topk_ids [tokens, top_k]: k distinct experts per token; `skew` sends most tokens to a few experts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:
        logits[:, : max(top_k, 2)] += 4.0
    return logits.topk(top_k, dim=-1).indices.to(torch.int32).to(device)


def _check_same_grouping(got: routing.ExpertBlocks, want: routing.ExpertBlocks) -> None:
    """Same sizes, padding rows and block experts, and every expert's run holds the same slots. Not the same slots
    per block: an expert with more than block_m slots spreads them over several blocks, and which block a slot
    lands in follows the order within the run, which the kernel's atomics choose on a GPU (triton's CPU interpreter
    serves them in order)."""
    assert got.num_slots == want.num_slots and got.block_m == want.block_m
    assert got.sorted_slots.shape == want.sorted_slots.shape
    assert torch.equal(got.num_padded.cpu(), want.num_padded.cpu())
    assert torch.equal(got.block_experts.cpu(), want.block_experts.cpu())
    rows_expert = want.block_experts.cpu().repeat_interleave(want.block_m)
    got_slots, want_slots = got.sorted_slots.cpu(), want.sorted_slots.cpu()
    assert torch.equal(got_slots == got.num_slots, want_slots == want.num_slots)  # the padding rows

    def runs(slots: torch.Tensor) -> torch.Tensor:  # (expert, slot) of every row in use, as one sortable key
        real = slots != want.num_slots
        return (rows_expert[real].long() * (want.num_slots + 1) + slots[real]).sort().values

    assert torch.equal(runs(got_slots), runs(want_slots))


def test_the_grouping_check_allows_any_order_within_an_expert_run_and_nothing_else() -> None:
    want = routing.sort_by_expert(_ids(37, 8, 2, seed=1, skew=True), 8, 16)  # experts with several blocks each
    real = int((want.block_experts == want.block_experts[0]).sum()) * 16  # the first expert's rows, 2+ blocks
    assert real > 16
    run = want.sorted_slots[:real]
    in_use = run[run != want.num_slots]
    shuffled = want.sorted_slots.clone()
    shuffled[: in_use.numel()] = in_use.flip(0)  # the run's order reversed: slots change blocks
    _check_same_grouping(dataclasses.replace(want, sorted_slots=shuffled), want)
    swapped = want.sorted_slots.clone()
    swapped[[0, real]] = swapped[[real, 0]]  # one slot each of two experts traded
    with pytest.raises(AssertionError):
        _check_same_grouping(dataclasses.replace(want, sorted_slots=swapped), want)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m", "skew"), [
    (1, 128, 8, 16, False),      # batch-1 decode of Qwen3-30B-A3B
    (3, 60, 4, 16, False),       # experts not a power of two
    (37, 8, 2, 16, True),        # every expert busy, several blocks per expert
    (300, 128, 8, 64, False),    # more slots than one loop step (CHUNK)
    (200, 256, 8, 32, True),     # DeepSeek-V3's expert count, skewed
    (0, 16, 2, 16, False),       # empty batch: only padding
])  # fmt: skip
@pytest.mark.parametrize("kernel", ["small", "large"])
def test_one_launch_grouping_matches_the_torch_version(tokens, experts, top_k, block_m, skew, kernel,
                                                       monkeypatch) -> None:  # fmt: skip
    """Both kernels: _align_small_kernel (all slots in registers, the default up to SMALL_MAX_SLOTS) and
    _align_kernel (forced here by a limit of 0)."""
    from flotilla.kernels.moe import triton_align
    from flotilla.kernels.moe.triton_align import align_by_expert

    if kernel == "large":
        monkeypatch.setattr(triton_align, "SMALL_MAX_SLOTS", 0)
    ids = _ids(tokens, experts, top_k, seed=tokens + experts, skew=skew)
    got = align_by_expert(ids, experts, block_m)
    want = routing.sort_by_expert(ids, experts, block_m)  # CPU tensors: the torch version
    _check_same_grouping(got, want)
    # every real slot appears exactly once, padding rows hold the sentinel
    slots = got.sorted_slots[got.sorted_slots < got.num_slots]
    assert torch.equal(slots.sort().values, torch.arange(tokens * top_k, dtype=torch.int32))


@pytest.mark.parametrize("limit", [None, 0])
def test_int64_ids_and_a_strided_view_give_the_same_grouping(limit, monkeypatch) -> None:
    from flotilla.kernels.moe import triton_align
    from flotilla.kernels.moe.triton_align import align_by_expert

    if limit is not None:
        monkeypatch.setattr(triton_align, "SMALL_MAX_SLOTS", limit)
    ids = _ids(20, 16, 4, seed=3)
    wide = torch.zeros(20, 8, dtype=torch.int64)
    wide[:, ::2] = ids
    _check_same_grouping(align_by_expert(wide[:, ::2], 16, 16), routing.sort_by_expert(ids, 16, 16))


@pytest.mark.parametrize(("tokens", "experts", "block_m"), [(5, 16, 16), (64, 128, 16), (300, 60, 32)])
def test_the_small_kernel_leaves_negative_ids_out_of_every_run(tokens, experts, block_m) -> None:
    """Masked routing (expert parallelism: another rank's experts are -1): the histogram counts those slots in bin 0
    and takes them out again, so expert 0's run and every other hold the torch version's slots, -1s in none."""
    from flotilla.kernels.moe.triton_align import align_by_expert

    ids = _ids(tokens, experts, 4, seed=tokens)
    ids[ids % 3 == 0] = -1  # expert 0 among them: its real slots must survive the correction
    ids[0, 0] = 0
    want = routing.sort_by_expert(ids, experts, block_m, masked=True)
    got = align_by_expert(ids, experts, block_m)
    _check_same_grouping(got, want)
    placed = got.sorted_slots[got.sorted_slots < got.num_slots].sort().values
    assert torch.equal(placed, (ids.flatten() >= 0).nonzero().flatten().to(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [2048, 4096, 8192])
def test_on_cuda_the_one_launch_grouping_at_16384_slots_and_beyond_matches_the_torch_version(tokens) -> None:
    from flotilla.kernels.moe.triton_align import align_by_expert

    ids = _ids(tokens, 128, 8, seed=tokens, device="cuda")
    _check_same_grouping(align_by_expert(ids, 128, 64), routing.sort_by_expert_torch(ids, 128, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("tokens", "experts", "block_m"), [(1, 128, 16), (256, 128, 16), (64, 256, 16), (192, 128, 32),
                                                          (600, 128, 64)])  # fmt: skip
def test_on_cuda_sort_by_expert_is_the_one_launch_and_the_experts_do_not_change(tokens, experts, block_m,
                                                                             monkeypatch) -> None:  # fmt: skip
    from flotilla.kernels.moe import triton_experts

    ids = _ids(tokens, experts, 8, seed=tokens, device="cuda")
    fused = routing.sort_by_expert(ids, experts, block_m)
    assert ids.numel() <= routing.FUSED_ALIGN_MAX_SLOTS  # the one-launch path is the one under test
    reference = routing.sort_by_expert_torch(ids, experts, block_m)
    _check_same_grouping(fused, reference)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 512, generator=gen, device="cuda").bfloat16()
    w13 = (torch.randn(experts, 2 * 256, 512, generator=gen, device="cuda") * 512**-0.5).bfloat16()
    w2 = (torch.randn(experts, 512, 256, generator=gen, device="cuda") * 256**-0.5).bfloat16()
    weights = torch.rand(tokens, 8, generator=gen, device="cuda")
    with_fused = triton_experts.fused_experts(x, w13, w2, weights, ids)
    monkeypatch.setattr(triton_experts, "sort_by_expert", routing.sort_by_expert_torch)
    without = triton_experts.fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(with_fused, without)  # rows are computed on their own: the order within an expert is moot


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90_without_a_gpu(tmp_path) -> None:
    """Compiled for Hopper (sm_90) in a child without the interpreter: the atomics, barriers and cumsum."""
    import triton
    from helpers_triton import compile_for_sm90

    ptrs = {n: "*i32" for n in ("ids_ptr", "sorted_ptr", "block_experts_ptr", "num_padded_ptr", "cursor_ptr")}
    specs = [("flotilla.kernels.moe.triton_align", "_align_kernel", {**ptrs, "ids_ptr": ids}, [],
              dict(NUM_EXPERTS=e, E_P2=triton.next_power_of_2(e), BLOCK_M=bm, CHUNK=1024, BLOCK_CHUNK=32, SLOTS_BOUND=2048,
                   ROWS_BOUND=4096, BLOCKS_BOUND=256), 4)
             for ids, e, bm in (("*i32", 128, 16), ("*i64", 256, 64), ("*i32", 60, 32))]  # fmt: skip
    specs += [("flotilla.kernels.moe.triton_align", "_align_small_kernel", {**ptrs, "ids_ptr": ids}, [],
               dict(NUM_EXPERTS=e, E_P2=triton.next_power_of_2(e), BLOCK_M=bm, CHUNK=1024, SLOTS_P2=slots,
                    ROWS_BOUND=8192, BLOCKS_BOUND=256, USE_GDC=True), 8)
              for ids, e, bm, slots in (("*i32", 128, 32, 2048), ("*i64", 256, 16, 4096), ("*i32", 60, 16, 16))]
    compile_for_sm90(specs, tmp_path)



@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(1, 128, 8, 16), (3, 8, 2, 16), (64, 16, 4, 32),
                                                                     (300, 128, 8, 64)])  # fmt: skip
def test_the_rows_bound_is_tight_for_small_batches_and_never_too_small(tokens, experts, top_k, block_m) -> None:
    """padded_rows counts padding only for experts that can get a slot: batch-1 decode of 128 experts at top-8 needs
    8 blocks, not 120; and whatever the routing (spread over as many experts as possible, or piled on a few) the
    rows in use fit."""
    slots = tokens * top_k
    bound = routing.padded_rows(slots, experts, block_m)
    if (tokens, experts) == (1, 128):
        assert bound // block_m == 8
    for skew in (False, True):
        blocks = routing.sort_by_expert(_ids(tokens, experts, top_k, seed=slots, skew=skew), experts, block_m)
        assert blocks.sorted_slots.numel() == bound and int(blocks.num_padded) <= bound
    spread = (torch.arange(slots) % experts).view(tokens, top_k).to(torch.int32)  # as many busy experts as can be
    assert int(routing.sort_by_expert(spread, experts, block_m).num_padded) <= bound
