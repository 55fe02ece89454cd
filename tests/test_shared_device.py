"""Ranks that share one GPU (ParallelConfig.ranks_share_device): tensor parallelism and DP x EP run their GPU kernels
with two processes on one device, their collectives over gloo through host memory (NCCL refuses two ranks on one
GPU), and give the one-rank engine's greedy tokens. On CPU: the host staging itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.kernels import comm
from helpers_engine import write_tiny_engine_model, write_tiny_tokenizer
from helpers_parallel import generated_tokens, random_prompts
from helpers_tiny_models import write_tiny_moe_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = dict(device="cuda", dtype="float32", kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16,
               max_num_seqs=4)


def test_staged_collectives_pass_host_tensors_through_and_copy_device_results_back(monkeypatch):
    seen = []

    def double(*tensors):
        seen.append([t.device.type for t in tensors])
        for t in tensors:
            t.mul_(2)

    x = torch.ones(3)
    comm.staged(double, x)  # off: the tensor itself
    monkeypatch.setattr(comm, "_THROUGH_HOST", True)
    comm.staged(double, x)  # on, but nothing on a GPU: the tensor itself
    assert seen == [["cpu"], ["cpu"]] and x.tolist() == [4.0, 4.0, 4.0]
    if torch.cuda.is_available():
        y = torch.ones(3, device="cuda")
        comm.staged(double, y)
        assert seen[-1] == ["cpu"] and y.tolist() == [2.0, 2.0, 2.0]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return write_tiny_engine_model(tmp_path_factory.mktemp("shared") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    model_dir = write_tiny_moe_model(tmp_path_factory.mktemp("shared") / "qwen3_moe", "qwen3_moe")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


def _tokens(model_dir: Path, **options) -> tuple[list[list[int]], dict]:
    with LLM(str(model_dir), **OPTIONS, **options) as llm:
        tokens = generated_tokens(llm, random_prompts(11, (5, 23, 9, 14)), GREEDY)
        detail = {k: {**d, "pid": llm.client.runtime.ready[k].pid} for k, d in llm.client.ready_detail.items()}
    return tokens, detail


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_two_tensor_parallel_ranks_on_one_gpu_give_the_one_rank_tokens(name, dense_dir, moe_dir):
    model_dir = dense_dir if name == "dense" else moe_dir
    want, _ = _tokens(model_dir)
    got, detail = _tokens(model_dir, placement="process", tensor_parallel_size=2, ranks_share_device=True)
    assert [detail[f"worker/{r}"]["tp"] for r in range(2)] == ["0/2", "1/2"]
    assert detail["worker/0"]["pid"] != detail["worker/1"]["pid"]
    assert got == want


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("all2all", ["all_to_all", "allgather_reducescatter"])
def test_dp2_ep2_on_one_gpu_gives_the_one_rank_tokens(all2all, moe_dir):
    want, _ = _tokens(moe_dir)
    got, detail = _tokens(moe_dir, data_parallel_size=2, enable_expert_parallel=True, all2all_backend=all2all,
                          ranks_share_device=True)
    assert [detail[f"worker/{r}"]["ep"] for r in range(2)] == ["0/2", "1/2"]
    assert got == want


def test_the_real_shape_check_writes_a_random_checkpoint_and_compares_two_ranks_with_one(dense_dir, tmp_path):
    """scripts/dev/check_shared_device.py at toy size on a CPU (its ranks over gloo, not sharing a GPU): a seeded
    random checkpoint of the folder's config, two tensor-parallel ranks' greedy tokens against one rank's."""
    from flotilla.scripts.dev import check_shared_device

    out = tmp_path / "check.json"
    assert check_shared_device.main(["--model", str(dense_dir), "--device", "cpu", "--prompts", "2", "--max-tokens",
                                     "4", "--engine-options", '{"kv_cache_blocks": 128, "block_size": 4}',
                                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["equal"] and result["tokens"] == 8 and result["first_difference"] == [None, None]
