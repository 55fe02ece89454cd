"""CUDA graphs of MTP speculation's uniform steps (actors/spec_graphs.py): on a CPU the "graphs" rerun their passes
eagerly over the same static buffers and tables the CUDA graphs read, so tokens, the MTP layer's own drafts and the
KV cache are compared with eager speculation without a GPU; the `gpu` tests capture real graphs (triton MLA, and
FlashMLA's verify pass of k + 1 tokens per sequence)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flotilla.actors.spec_graphs import SpecGraphs
from flotilla.kernels.mla.flash_mla_backend import flash_mla_usable
from helpers_engine import write_tiny_tokenizer
from helpers_spec import (VOCAB, add_mtp_layer, attach_step_graphs, check_same, check_step_graphs,
                          check_steps_planned_ahead, count_step_graphs, make_runner, run)
from helpers_tiny_models import write_flash_mla_shaped_deepseek, write_tiny_deepseek_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = add_mtp_layer(write_tiny_deepseek_model(tmp_path_factory.mktemp("mtp-graphs") / "m", "deepseek_v3"))
    write_tiny_tokenizer(d, vocab_size=VOCAB)
    return d


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> tuple[dict, dict]:
    tokens, logprobs, _, _ = run(make_runner(model_dir, None))
    return tokens, logprobs


@pytest.mark.parametrize("num_spec", [1, 3])
def test_speculating_step_graphs_give_the_tokens_of_plain_decoding(model_dir: Path, plain: tuple,
                                                                   num_spec: int) -> None:
    """Uniform steps (every sequence decoding with all its drafts) go through SpecGraphs' verify / propose / draft
    passes over static buffers, padded batches included; the rest stay eager. Drafts accepted, rejected and cut
    short all give plain decoding's tokens and logprobs."""
    check_step_graphs(model_dir, num_spec, "cpu", plain)


def check_drafts_stay_on_the_device(model_dir: Path, num_spec: int, device: str, plain_tokens: tuple) -> None:
    """The MTP layer's own drafts (no hook): a graph step leaves them on the device and the next uniform step of
    the same sequences verifies them from there; the rest read them on the host. The same drafts as eager
    speculation's (so the same accepted counts, row by row), plain decoding's tokens, the same KV cache."""
    penalised = ("r4", "r10")
    want = tuple({rid: v for rid, v in d.items() if rid not in penalised} for d in plain_tokens)
    rows: list[list[tuple[str, int, int]]] = []
    caches: list[list[torch.Tensor]] = []
    for graphs in (False, True):
        runner = make_runner(model_dir, num_spec, device=device, enforce_eager=not graphs)
        if graphs and device == "cpu":
            attach_step_graphs(runner)
        counts = count_step_graphs(runner.spec.graphs) if graphs else {}
        rows.append([])
        tokens, logprobs, _, _ = run(runner, budget=64, rows=rows[-1], drop=penalised)
        check_same((tokens, logprobs), want)
        caches.append([c[:runner.num_blocks] for c in runner.kv_caches])
    assert rows[0] == rows[1]
    assert counts["drafts_on_device"] >= 3, counts
    for eager, graphed in zip(*caches):
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_spec", [1, 2])
def test_a_graph_steps_drafts_stay_on_the_device_for_the_next_verify(model_dir: Path, plain: tuple,
                                                                       num_spec: int) -> None:
    check_drafts_stay_on_the_device(model_dir, num_spec, "cpu", plain)


@pytest.mark.gpu
@pytest.mark.parametrize("num_spec", [1, 3])
def test_speculating_step_cuda_graphs_give_the_tokens_of_plain_decoding(model_dir: Path, num_spec: int) -> None:
    """The same on CUDA, where the runner captures the graphs itself (the triton MLA kernels' static tables)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain_cuda = run(make_runner(model_dir, None, device="cuda"))[:2]
    check_step_graphs(model_dir, num_spec, "cuda", plain_cuda)
    check_drafts_stay_on_the_device(model_dir, num_spec, "cuda", plain_cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("num_spec", [1, 3])
def test_speculation_on_flash_mla_in_cuda_graphs_gives_eager_speculations_tokens(tmp_path: Path, num_spec: int) -> None:
    """DeepSeek-V3's MLA shapes in bf16 on FlashMLA: the verify pass is one FlashMLA call of num_spec + 1 tokens per
    sequence, eager and in the step graphs alike, so both give the same tokens."""
    if not flash_mla_usable():
        pytest.skip("needs a Hopper GPU with flash_mla")
    model = add_mtp_layer(write_flash_mla_shaped_deepseek(tmp_path / "ds"))
    got = []
    for eager in (True, False):
        runner = make_runner(model, num_spec, num_blocks=60, device="cuda", enforce_eager=eager, dtype="bfloat16",
                             block_size=64, attention_backend="flash_mla")  # fmt: skip
        assert runner.model.attention_backend_name == "mla_flash_mla"
        assert (runner.spec.graphs is None) == eager
        counts = {} if eager else count_step_graphs(runner.spec.graphs)
        got.append(run(runner, budget=64, drop=("r4", "r10"))[0])
    assert got[0] == got[1]
    assert counts["verify"] >= 2 and counts["draft"] > 0


def test_a_closed_speculating_runner_lets_go_of_its_model_and_cache_while_its_speculator_is_held(model_dir: Path) -> None:
    """A speculator held past its engine's close (bench_mtp holds one) must not keep the engine's memory: its step
    graphs and model would keep the first engine's KV cache, and the next inline engine would run out of memory."""
    import gc
    import time
    import weakref

    runner = make_runner(model_dir, 2)
    attach_step_graphs(runner)
    spec = runner.spec
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    runner.close()
    for _ in range(100):  # (under load one collection may not yet free the model)
        gc.collect()
        if model() is None and cache() is None:
            break
        time.sleep(0.05)
    assert model() is None and cache() is None
    assert spec is not None and not hasattr(spec, "graphs")


def test_speculating_step_graphs_reject_what_is_not_uniform(model_dir: Path) -> None:
    """A prefill chunk or a sequence with fewer drafts than k runs eager; a step where a chain might reach a position
    without a KV slot (past the block table or max_model_len, if every draft were accepted) drafts eagerly."""
    runner = make_runner(model_dir, 3)
    g = SpecGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, max_batch=6,
                   max_blocks_per_seq=64, num_speculative_tokens=3, device=runner.device)
    tables = [np.array([1, 2, 3], np.int32), np.array([4, 5], np.int32)]
    # all 3 drafts accepted, the chain's passes reach cached + 5: 11 and 7, blocks 2 and 1 (of 4 tokens)
    assert g.can_draft(np.array([6, 2]), tables, max_model_len=256)
    assert not g.can_draft(np.array([7, 2]), tables, max_model_len=256)  # 12 would need a fourth block
    assert not g.can_draft(np.array([6, 2]), tables, max_model_len=11)
    assert g.fits(6) and not g.fits(7) and g.padded_size(3) == 4


@pytest.mark.parametrize("num_spec", [1, 2])
def test_steps_planned_ahead_give_the_tokens_of_plain_decoding(model_dir: Path, num_spec: int) -> None:
    check_steps_planned_ahead(model_dir, num_spec, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("num_spec", [1, 2])
def test_steps_planned_ahead_on_cuda_give_the_tokens_of_plain_decoding(model_dir: Path, num_spec: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_steps_planned_ahead(model_dir, num_spec, "cuda")
