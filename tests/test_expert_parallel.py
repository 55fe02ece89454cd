"""The expert-parallel MoE layers on 2 real gloo processes against one process running every expert (kernels/moe's
torch reference): dispatch / combine by all-to-all (kernels/moe/expert_parallel.py) and all-gather / reduce-scatter
(kernels/moe/ep_allgather.py, each step padded to an agreed number of rows).

Each rank (tests/helpers_ep_rank.py) keeps half of the experts and runs several steps with its own tokens —
different counts on the two ranks, and steps where one rank (or both) has none — and must get, in float32,
what torch_ref.fused_experts gives for its tokens with all the experts; the placement's load counters must
count each rank's routing and each expert's whole load. The tolerance is float32 rounding: an expert's GEMM
holds both ranks' rows, and a CPU BLAS row's last bits depend on the number of rows (with one rank, where
the batches are the reference's, the result is compared bit for bit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.kernels.moe import get_moe_backend, select_experts, torch_ref
from flotilla.kernels.moe.expert_parallel import (
    ExpertParallelExperts,
    ExpertPlacement,
    available_ep_backends,
    get_ep_backend,
)
from flotilla.transport.endpoints import free_tcp_port

EXPERTS, HIDDEN, INTER, TOP_K, WORLD = 8, 16, 12, 3, 2
TOKENS = [(7, 3), (0, 5), (4, 0), (0, 0), (6, 6)]
"""Tokens of (rank 0, rank 1) in each step."""


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"w13": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 4,
         "w2": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 4}
    for step, counts in enumerate(TOKENS):
        for rank, n in enumerate(counts):
            p = f"step{step}.rank{rank}"
            w[f"{p}.x"] = torch.randn(n, HIDDEN, generator=g)
            w[f"{p}.topk_weights"], w[f"{p}.topk_ids"] = select_experts(
                torch.randn(n, EXPERTS, generator=g) * 3, TOP_K, renormalize=True)
    # a token whose experts all live on the other rank, and one whose experts are all local
    w["step0.rank0.topk_ids"][0] = torch.tensor([7, 4, 5], dtype=torch.int32)
    w["step0.rank0.topk_ids"][1] = torch.tensor([2, 0, 3], dtype=torch.int32)
    return w


@pytest.fixture(scope="module", params=["all_to_all", "allgather_reducescatter"])
def ranks(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("ep")
    w = _inputs()
    save_file(w, str(folder / "inputs.safetensors"))
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    script = Path(__file__).with_name("helpers_ep_rank.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(WORLD), init, str(folder), request.param],
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return w, [load_file(str(folder / f"rank{r}.safetensors")) for r in range(WORLD)]


def test_each_rank_gets_the_single_process_moe_of_its_tokens(ranks) -> None:
    w, outs = ranks
    for step, counts in enumerate(TOKENS):
        for rank, n in enumerate(counts):
            p = f"step{step}.rank{rank}"
            want = torch_ref.fused_experts(w[f"{p}.x"], w["w13"], w["w2"], w[f"{p}.topk_weights"], w[f"{p}.topk_ids"])
            got = outs[rank][f"step{step}.out"]
            assert got.shape == (n, HIDDEN) and got.dtype == torch.float32
            where = f"step {step} rank {rank}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}")


def test_load_counts_per_expert(ranks) -> None:
    w, outs = ranks
    per_rank = EXPERTS // WORLD
    for step in range(len(TOKENS)):
        routed = [torch.bincount(w[f"step{step}.rank{r}.topk_ids"].flatten().long(), minlength=EXPERTS)
                  for r in range(WORLD)]
        for rank in range(WORLD):
            assert torch.equal(outs[rank][f"step{step}.expert_load"], routed[rank])
            owned = slice(rank * per_rank, (rank + 1) * per_rank)
            assert torch.equal(outs[rank][f"step{step}.local_expert_load"], sum(routed)[owned])
    assert outs[0]["step1.expert_load"].sum() == 0  # no tokens: the last step's counts, not a running total
    assert outs[1]["step1.local_expert_load"].sum() > 0


def test_one_rank_is_the_reference() -> None:
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 4).to(dtype)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 4).to(dtype)
        x = torch.randn(11, HIDDEN, generator=g).to(dtype)
        weights, ids = select_experts(torch.randn(11, EXPERTS, generator=g), 4, renormalize=False)
        placement = ExpertPlacement(EXPERTS, 1, 0)
        layer = ExpertParallelExperts(placement, None, get_moe_backend("torch"))
        assert torch.equal(layer(x, w13, w2, weights, ids), torch_ref.fused_experts(x, w13, w2, weights, ids))
        assert torch.equal(placement.expert_load, torch.bincount(ids.flatten().long(), minlength=EXPERTS))


def test_placement_is_contiguous() -> None:
    placement = ExpertPlacement(8, 4, 2)
    assert placement.local_experts == range(4, 6)
    assert placement.expert_to_rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert placement.expert_to_local.tolist() == [0, 1] * 4
    stacked = torch.arange(8).view(8, 1).expand(8, 3)
    assert placement.local_slice(stacked)[:, 0].tolist() == [4, 5]


def test_bad_split_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ExpertPlacement(6, 4, 0)
    with pytest.raises(ValueError, match="not in a group"):
        ExpertPlacement(8, 2, 2)
    placement = ExpertPlacement(8, 2, 0)
    with pytest.raises(ValueError, match="process group has 1"):
        ExpertParallelExperts(placement, None)  # two ranks' placement, no group
    with pytest.raises(ValueError, match="expected 8"):
        placement.local_slice(torch.zeros(6, 2))
    one = ExpertPlacement(8, 1, 0)
    layer = ExpertParallelExperts(one, None, get_moe_backend("torch"))
    x, weights, ids = torch.zeros(2, HIDDEN), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="this rank's 8 experts"):  # a half of the experts on a one-rank layer
        layer(x, torch.zeros(4, 2 * INTER, HIDDEN), torch.zeros(4, HIDDEN, INTER), weights, ids)


def test_deep_ep_is_a_seam_not_a_fake() -> None:
    assert get_ep_backend("auto") == "all_to_all"
    with pytest.raises((ValueError, NotImplementedError), match="deep_ep"):
        get_ep_backend("deep_ep")
    with pytest.raises(ValueError, match="unknown EP backend"):
        get_ep_backend("nope")
    assert "all_to_all" in available_ep_backends()
