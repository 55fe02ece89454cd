"""CUDA-graph decode under tensor parallelism (opt-in: tp_cuda_graphs): each rank captures its decode
forwards with the NCCL all-reduces inside, and replays them in lockstep. On two GPUs a TP=2 engine must give the
same greedy tokens with graphs as without, with batches that shrink step by step so several captured sizes
replay; likewise TP x EP (the experts spread over the two ranks, masked routing over the shared tokens: no
collective of its own, no host sync)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers_engine import greedy_on_cuda, write_tiny_engine_model
from helpers_tiny_models import write_tiny_moe_model

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _run(model: str, **options) -> tuple[list[list[int]], dict]:
    return greedy_on_cuda(model, tensor_parallel_size=2, **options)


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_decode_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    eager, detail = _run(model, enforce_eager=True)
    assert detail["worker/0"]["cuda_graphs"] == "off"
    graphs, detail = _run(model, tp_cuda_graphs=True)
    assert [detail[f"worker/{r}"]["cuda_graphs"] for r in (0, 1)] == ["on", "on"]
    assert graphs == eager


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_ep2_decode_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    model = str(write_tiny_moe_model(tmp_path / "moe", "qwen3_moe_hd64"))
    eager, detail = _run(model, enforce_eager=True, enable_expert_parallel=True)
    assert detail["worker/1"]["ep"] == "1/2"
    graphs, detail = _run(model, enable_expert_parallel=True, tp_cuda_graphs=True)
    assert [detail[f"worker/{r}"]["cuda_graphs"] for r in (0, 1)] == ["on", "on"]
    assert graphs == eager
