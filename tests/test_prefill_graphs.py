"""CUDA graphs of one sequence's prompt chunks (actors/prefill_graphs.py): on a CPU the "graphs" rerun the forward
eagerly over the same static buffers, padding rows and tables the CUDA graphs read, so a runner with them gives the
tokens and logprobs of an eager runner without a GPU (DeepSeek-V3's MLA, and GQA models: a dense one and a
Qwen3-MoE); the `gpu` tests capture real graphs (triton's MLA prefill; triton's GQA prefill)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.actors.model_runner import ModelRunner
from flotilla.actors.prefill_graphs import PrefillGraphs, prefill_graph_backends
from flotilla.config import SchedulerConfig
from flotilla.kernels.attention import AttentionMetadata
from helpers_spec import make_runner, requests
from helpers_tiny_models import write_tiny_deepseek_model, write_tiny_model, write_tiny_moe_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_model(tmp_path_factory.mktemp("prefill-graphs") / "m", "deepseek_v3")


@pytest.fixture(scope="module")
def gqa_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefill-graphs-gqa")
    return {"qwen3_hd64": write_tiny_model(root / "qwen3", "qwen3_hd64"),
            "qwen3_moe": write_tiny_moe_model(root / "moe", "qwen3_moe")}


def one_at_a_time(runner: ModelRunner, budget: int) -> tuple[dict, dict]:
    """Every request of helpers_spec.requests() alone, to its end: each prompt chunk is a step of one sequence (and
    the later requests hit an earlier one's prompt blocks in the prefix cache). -> (tokens, logprobs) by request."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_steps_in_flight=1)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    sched = BatchScheduler(cfg, blocks, max_model_len=runner.max_model_len)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for req in requests():
        assert sched.add(req)
        while sched.seqs:
            plan = sched.schedule()
            assert plan is not None
            result = runner.execute(plan)
            assert result.error is None, result.error
            for d in sched.update(result):
                tokens.setdefault(d.rid, []).extend(d.token_ids)
                if d.logprobs is not None:
                    logprobs.setdefault(d.rid, []).extend(d.logprobs)
    assert blocks.hit_tokens > 0  # r12 and r13 started after r1's prompt blocks
    return tokens, logprobs


def count_runs(graphs: PrefillGraphs) -> list[tuple[int, int]]:
    """(cached, tokens) of every chunk the graphs run, filled in as the runner steps."""
    runs: list[tuple[int, int]] = []
    real = graphs.run

    def counted(ids: np.ndarray, cached: int, block_ids: np.ndarray) -> torch.Tensor:
        runs.append((cached, len(ids)))
        return real(ids, cached, block_ids)

    graphs.run = counted
    return runs


def check_against_eager(model_dir: Path, device: str, budget: int, **options: object) -> list[tuple[int, int]]:
    """The tokens and logprobs of a runner whose single-sequence chunks replay prefill graphs against an eager
    runner's (both with `options`); the chunks the graphs ran."""
    eager = one_at_a_time(make_runner(model_dir, None, device=device, enforce_eager=True, **options), budget)
    runner = make_runner(model_dir, None, device=device, **options)
    if device == "cpu":  # (a CUDA runner builds its own: they are on by default)
        runner.prefill_graphs = PrefillGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks,
                                              runner.max_model_len, budget, runner.device)  # fmt: skip
    assert runner.prefill_graphs is not None
    runs = count_runs(runner.prefill_graphs)
    got = one_at_a_time(runner, budget)
    assert got[0] == eager[0]
    for rid, want in eager[1].items():
        np.testing.assert_allclose(got[1][rid], want, rtol=1e-4, atol=1e-4)
    return runs


def test_prompt_chunks_of_one_sequence_replay_padded_graphs_and_give_the_eager_tokens(model_dir: Path) -> None:
    """Chunks of 1-16 tokens pad to the 16-token graph, 17-32 to the 32-token one; a chunk after a prefix-cache hit
    or an earlier chunk continues at its position; the padding rows change nothing the real rows read."""
    runs = check_against_eager(model_dir, "cpu", budget=32)
    sizes = {16 if n <= 16 else 32 for _, n in runs}
    assert sizes == {16, 32} and any(cached > 0 for cached, _ in runs) and len(runs) >= len(requests())


@pytest.mark.parametrize("name", ["qwen3_hd64", "qwen3_moe"])
def test_gqa_models_prompt_chunks_in_padded_graphs_give_the_eager_tokens(gqa_dirs: dict[str, Path],
                                                                          name: str) -> None:
    """The same for GQA models (their K/V store per layer, RoPE, and for Qwen3-MoE the experts at 16 and 32 rows,
    where the padding rows' tokens reach the routing too)."""
    runs = check_against_eager(gqa_dirs[name], "cpu", budget=32)
    assert {16 if n <= 16 else 32 for _, n in runs} == {16, 32} and len(runs) >= len(requests())


def test_a_chunk_whose_padding_would_pass_max_model_len_is_left_to_the_eager_forward(model_dir: Path) -> None:
    runner = make_runner(model_dir, None)
    graphs = PrefillGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, max_model_len=40,
                           max_tokens=100, device=runner.device)  # fmt: skip
    assert graphs.sizes == [16, 32]  # (64 would pass max_model_len itself)
    assert graphs.bucket(17) == 32 and graphs.bucket(33) is None
    assert graphs.fits(0, 17) and graphs.fits(8, 17) and not graphs.fits(9, 17) and not graphs.fits(0, 0)
    with pytest.raises(ValueError, match="no prefill graph for 17 tokens after 9"):
        graphs.run(np.zeros(17, dtype=np.int64), 9, np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match="fits a step budget of 8"):
        PrefillGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, 40, 8, runner.device)


@pytest.mark.gpu
def test_prefill_cuda_graphs_give_the_eager_tokens(model_dir: Path) -> None:
    """The same on CUDA, where the runner captures the graphs itself (by default, triton's MLA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runs = check_against_eager(model_dir, "cuda", budget=32)
    assert len(runs) >= len(requests())


@pytest.mark.gpu
def test_gqa_prefill_cuda_graphs_give_the_eager_tokens(gqa_dirs: dict[str, Path]) -> None:
    """GQA models under prefill_cuda_graphs "all": the runner captures triton's prefill kernel. (flashinfer_triton's
    graphs run the same triton kernels, test_flashinfer_triton_sends_only_a_prefill_graphs_chunk_to_triton checks
    that they do; its eager FlashInfer kernels take no float32 model, which these token-exact checks need.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name in ("qwen3_hd64", "qwen3_moe"):
        runs = check_against_eager(gqa_dirs[name], "cuda", budget=32, attention_backend="triton",
                                   prefill_cuda_graphs="all")
        assert len(runs) >= len(requests()), name


def test_prefill_graphs_are_on_for_mla_unless_switched_off_and_for_gqa_when_asked() -> None:
    """prefill_cuda_graphs: the MLA backends by default ("auto"), triton and flashinfer_triton (GQA) too with "all",
    none with "off"."""
    from flotilla.config import EngineConfig

    mla = ("mla_triton", "mla_flash_mla")
    for mode, backends in (("auto", mla), ("all", (*mla, "triton", "flashinfer_triton")), ("off", ())):
        assert prefill_graph_backends(mode) == backends, mode
    assert EngineConfig().worker.prefill_cuda_graphs == "auto"
    assert EngineConfig.from_options(prefill_cuda_graphs="off").worker.prefill_cuda_graphs == "off"


def test_flashinfer_triton_sends_only_a_prefill_graphs_chunk_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without host copies FlashInfer cannot plan a chunk, so a prefill graph's goes to triton's prefill kernel; an
    eager chunk (host copies) stays on FlashInfer, and so does a decode graph's FlashInfer size, whose metadata has no
    host copies either but is planned before each replay (sending it to triton would capture the wrong kernel)."""
    pytest.importorskip("triton")
    from flotilla.kernels import attention
    from flotilla.kernels.attention import flashinfer_backend
    from flotilla.kernels.triton import attention as triton_attention

    calls: list[str] = []

    class FakeFlashInfer:
        store_kv = staticmethod(lambda *a, **k: None)

        def forward(self, *args: object) -> str:
            calls.append("flashinfer")
            return "flashinfer"

    monkeypatch.setattr(flashinfer_backend, "shared", FakeFlashInfer)
    monkeypatch.setattr(triton_attention, "paged_prefill_attention", lambda *a, **k: calls.append("triton prefill"))
    monkeypatch.setattr(triton_attention, "paged_decode_attention", lambda *a, **k: calls.append("triton decode"))
    forward = attention._flashinfer_triton().forward

    def meta(num_seqs: int, max_query_len: int, host: bool) -> AttentionMetadata:
        m = AttentionMetadata.from_lists([0] * num_seqs, [max_query_len] * num_seqs, [[0]] * num_seqs, 16)
        return m if host else dataclasses.replace(m, host=None)

    kv = torch.zeros(1, 2, 16, 1, 8)
    for m in (meta(1, 16, host=False), meta(1, 16, host=True), meta(100, 1, host=False), meta(2, 1, host=False)):
        forward(torch.zeros(m.num_tokens, 1, 8), kv, m, 1.0)
    assert calls == ["triton prefill", "flashinfer", "flashinfer", "triton decode"]
