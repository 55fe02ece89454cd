"""CUDA-graph decode over static device tables: the triton attention kernels (GQA "triton", MLA "mla_triton")
captured in graphs like flashinfer's (actors/cuda_graphs.py). The host-side tables are checked here without a
GPU; the `gpu` tests compare graph replay against eager steps through the whole engine."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.actors.cuda_graphs import DecodeGraphs
from flotilla.kernels.attention.flashinfer_backend import WORKSPACE_BYTES, decode_workspace_bytes

from helpers_engine import write_tiny_engine_model
from helpers_tiny_models import write_tiny_deepseek_model, write_tiny_dsa_model


def test_static_tables_take_each_sequences_pages_then_pad_on_the_scratch_block():
    g = DecodeGraphs.__new__(DecodeGraphs)  # no capture: only the host-side tables are under test
    g.block_size, g.scratch_block = 4, 99
    tables = [np.array([5, 6, 7, 0, 0], np.int32), np.array([9, 1, 1], np.int32), np.array([3, 4, 8, 2], np.int32)]
    lens, table = g.static_tables_for(6, np.array([9, 1, 16]), tables)
    assert lens.tolist() == [9, 1, 16, 1, 1, 1]  # padding rows: one token, on the scratch block
    assert table.tolist() == [[5, 6, 7, 99], [9, 99, 99, 99], [3, 4, 8, 2]] + [[99] * 4] * 3
    lens, table = g.static_tables_for(2, np.zeros(0, np.int64), [])
    assert lens.tolist() == [1, 1] and table.tolist() == [[99], [99]]


def test_the_flashinfer_graph_workspace_is_what_flashinfer_asked_for_at_large_batches():
    """decode_workspace_bytes against the split-KV scratch FlashInfer 0.6's graph plan asked for where it overflowed
    the default workspace (its error names the partial outputs' bytes; their log-sum-exps take 1 / head_dim of
    that again): Qwen3-8B's heads at 1,024 sequences on a 132-SM GPU, and Qwen3.5's (32 / 2, head_dim 256) at 512."""
    for batch, heads, tmp_v in ((1024, (32, 8, 128), 335_282_176), (512, (32, 2, 256), 536_346_624)):
        qo, kv, head_dim = heads
        assert decode_workspace_bytes(batch, qo, kv, head_dim, num_sms=132) == tmp_v * (head_dim + 1) // head_dim + 32
        assert decode_workspace_bytes(batch // 4, qo, kv, head_dim, num_sms=132) < WORKSPACE_BYTES  # (256 fits)
    # a group of more than 16 query heads per KV head packs 64 query rows a tile; a small batch pads to the CTAs
    assert decode_workspace_bytes(1, 40, 2, 128, num_sms=132) == 40 * 132 * 64 * 129 * 4 + 32


def test_the_shared_flashinfer_buffers_stay_plannable_outside_inference_mode(monkeypatch):
    """The process's one FlashInferAttention keeps a workspace and wrappers whose plans write into their buffers in
    place: made under inference mode (as the engine runs) they must still be normal tensors, or a later caller
    without inference mode (a benchmark, a test) fails with torch's "Inplace update to inference tensor"."""
    import sys
    from types import SimpleNamespace

    from flotilla.kernels.attention.flashinfer_backend import FlashInferAttention

    class Wrapper:  # FlashInfer's paged wrappers keep buffers of their own beside the workspace they are given
        def __init__(self, workspace, layout, **options):
            self.workspace, self.kv_lens = workspace, torch.zeros(64, dtype=torch.int32)

    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper,
                                                                   BatchPrefillWithPagedKVCacheWrapper=Wrapper))
    cpu = torch.device("cpu")
    attention = FlashInferAttention()
    with torch.inference_mode():
        attention.reserve_workspace(cpu, 1)
        wrappers = attention._wrappers_for(cpu)
    for wrapper in wrappers:
        assert not wrapper.workspace.is_inference() and not wrapper.kv_lens.is_inference()
        wrapper.kv_lens[:3].copy_(torch.arange(3, dtype=torch.int32))  # what a plan does
    with torch.inference_mode():
        attention.reserve_workspace(cpu, WORKSPACE_BYTES + 1)  # a larger workspace: the wrappers are made again
        assert not attention._wrappers_for(cpu)[0].workspace.is_inference()


def _greedy(engine: LLM, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True) for i in range(n)]  # batches shrink
    return [o.outputs[0].token_ids for o in engine.generate([{"prompt_token_ids": p} for p in ps], params,
                                                             use_tqdm=False)]


def _graph_and_eager(model: str, dtype: str = "bfloat16", **options) -> dict[bool, list[list[int]]]:
    outs = {}
    for eager in (True, False):
        with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype=dtype, max_num_seqs=16,
                 enforce_eager=eager, placement="inline", skip_tokenizer_init=True,  # inline: the runner is inspected
                 **options) as engine:  # fmt: skip
            graphs = engine.client.runtime.actors["worker/0"].runner.graphs
            assert (graphs is None) == eager
            assert eager or graphs.static_tables
            outs[eager] = _greedy(engine, 12, seed=21)
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_gqa_attention_in_cuda_graphs_gives_the_eager_tokens(tmp_path):
    outs = _graph_and_eager(str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64")), attention_backend="triton")
    assert outs[False] == outs[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_mla_in_cuda_graphs_gives_the_eager_tokens(tmp_path):
    outs = _graph_and_eager(str(write_tiny_deepseek_model(tmp_path / "ds")))
    assert outs[False] == outs[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_mla_in_cuda_graphs_gives_the_eager_tokens(tmp_path, name):
    """DeepSeek Sparse Attention's indexer, top-k and sparse MLA replayed in decode graphs (prompts longer than
    the tiny configs' top-k, so attention is sparse)."""
    outs = _graph_and_eager(str(write_tiny_dsa_model(tmp_path / name, name)))
    assert outs[False] == outs[True]
