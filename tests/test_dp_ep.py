"""Data parallelism x expert parallelism end to end: an engine with data_parallel_size=2 (two schedulers, two
worker processes; under enable_expert_parallel the workers joined by gloo, each holding half the experts) gives
the greedy tokens of the one-rank engine, with requests spread over both ranks and with one rank idle while
the other works (its empty steps keep the MoE all-to-alls paired), for Qwen3-MoE and for DeepSeek-V3 / Kimi-K2
(FP8 block-scaled and float checkpoints; shared experts and dense layers whole on every rank); a rank reads
and dequantizes only its own experts' tensors; plus the coordinator's and the lockstep's pure rules, and the
options refused before anything starts."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.actors.data_parallel import StepLockstep
from flotilla.config import EngineConfig
from flotilla.kernels.moe import torch_ref
from flotilla.kernels.quant import FP8_DTYPE, block_dequantize
from flotilla.models import deepseek_v3, loader, parallel, qwen3_moe
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
from flotilla.server.dp_coordinator import DPCoordinator, ExpertLoads, sum_stats
from flotilla.server.engine_client import engine_topology
from flotilla.server.metrics import ServerMetrics
from flotilla.transport.messages import ExpertLoadEvent, SchedulerStatsEvent
from helpers_engine import write_tiny_engine_model, write_tiny_tokenizer
from helpers_optional import needs, optional
from helpers_parallel import expert_loads_reaching, generate_within, generated_tokens, random_prompts
from helpers_server import start_server
from helpers_tiny_models import (
    FP8_BLOCK as BLOCK,
    TINY_DEEPSEEK_CONFIGS,
    TINY_MOE_CONFIGS,
    load_flotilla_model,
    write_tiny_deepseek_fp8_pair,
    write_tiny_deepseek_model,
    write_tiny_moe_model,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

openai = optional("openai")

# chunked prefill (16-token budget), mixed prefill + decode steps, steps in flight (the default)
OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts() -> list[dict]:
    return random_prompts(11, (5, 23, 9, 14))


def _tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return generated_tokens(llm, prompts, GREEDY)


def _generate_within(llm: LLM, prompts: list[dict], timeout_s: float) -> list[list[int]]:
    return generate_within(llm, prompts, GREEDY, timeout_s)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = write_tiny_moe_model(tmp_path_factory.mktemp("dp_ep") / "qwen3_moe", "qwen3_moe")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


def test_dp2_dense_qwen3_gives_the_one_rank_tokens(tmp_path: Path) -> None:
    model_dir = write_tiny_engine_model(tmp_path / "qwen3", "qwen3")
    prompts = _prompts()
    with LLM(str(model_dir), **OPTIONS) as llm:
        want = _tokens(llm, prompts)
    with LLM(str(model_dir), data_parallel_size=2, **OPTIONS) as llm:
        got = _tokens(llm, prompts)
        assert llm.client.coordinator.assigned == [2, 2]  # a burst spreads over both ranks
        detail = llm.client.ready_detail
        assert [detail[f"worker/{r}"]["dp"] for r in range(2)] == ["0/2", "1/2"]
        assert "ep" not in detail["worker/0"]  # data parallelism alone: whole replicas
        assert llm.client.runtime.ready["worker/0"].pid != llm.client.runtime.ready["worker/1"].pid
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got)


ALL2ALL = pytest.mark.parametrize("all2all", ["all_to_all", "allgather_reducescatter"])
"""Both ways wide EP moves tokens (kernels/moe/expert_parallel.py, kernels/moe/ep_allgather.py)."""


@pytest.fixture(scope="module")
def moe_want(moe_dir: Path) -> list[list[int]]:
    """The one-rank engine's greedy tokens of _prompts() on the tiny Qwen3-MoE (both all-to-all backends' reference)."""
    with LLM(str(moe_dir), **OPTIONS) as llm:
        return _tokens(llm, _prompts())


@ALL2ALL
def test_dp2_ep2_qwen3_moe_gives_the_one_rank_tokens_busy_and_with_one_rank_idle(moe_dir: Path, moe_want: list,
                                                                                   all2all: str) -> None:
    prompts, want = _prompts(), moe_want
    with LLM(str(moe_dir), data_parallel_size=2, enable_expert_parallel=True, all2all_backend=all2all,
             **OPTIONS) as llm:
        client = llm.client
        detail = client.ready_detail
        assert [(detail[f"worker/{r}"]["ep"], detail[f"worker/{r}"]["experts"]) for r in range(2)] == [
            ("0/2", "0-3/8"), ("1/2", "4-7/8")]
        got = _generate_within(llm, prompts, timeout_s=120)
        assert client.coordinator.assigned == [2, 2]
        assert got == want
        # every token the ranks computed went to top_k experts in each MoE layer (layer 1 is dense)
        top_k = TINY_MOE_CONFIGS["qwen3_moe"]["num_experts_per_tok"]
        computed = sum(len(p["prompt_token_ids"]) + GREEDY.max_tokens - 1 for p in prompts)
        busy = expert_loads_reaching(client, lambda total: total.sum(axis=1).tolist() == [computed * top_k] * 2)
        assert busy.shape == (2, 8)
        assert sorted(client.expert_loads.by_rank) == [0, 1]
        # one request: one rank runs it, the other has nothing and runs empty steps through the all-to-alls
        alone = _generate_within(llm, prompts[2:3], timeout_s=60)
        # (which rank: both have no request left, and their last KV usage reports, which may lag, break the tie)
        assert sorted(client.coordinator.assigned) == [2, 3]
        assert alone == want[2:3]
        expert_loads_reaching(client, lambda total: (total.sum(axis=1) > busy.sum(axis=1)).all())


@pytest.fixture(scope="module")
def deepseek_fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny DeepSeek-V3 (8 experts in 4 groups, top-3 of the best 2 groups, one shared expert, a dense first
    layer, routed_scaling_factor 2.5) with every linear, routed experts included, FP8 block-scaled; and the
    same weights dequantized (float32)."""
    fp8_dir, float_dir = write_tiny_deepseek_fp8_pair(tmp_path_factory.mktemp("dp_ep_deepseek"))
    write_tiny_tokenizer(fp8_dir, vocab_size=320)
    return fp8_dir, float_dir


def _deepseek_prompts() -> list[dict]:
    return random_prompts(5, (7, 19, 11, 4))


@pytest.fixture(scope="module")
def deepseek_fp8_want(deepseek_fp8_dirs: tuple[Path, Path]) -> list[list[int]]:
    """The one-rank engine's greedy tokens of _deepseek_prompts() on the FP8 DeepSeek-V3 (both backends' reference)."""
    with LLM(str(deepseek_fp8_dirs[0]), **OPTIONS) as llm:
        return _tokens(llm, _deepseek_prompts())


@ALL2ALL
def test_dp2_ep2_fp8_deepseek_v3_gives_the_one_rank_tokens_busy_and_with_one_rank_idle(
        deepseek_fp8_dirs: tuple[Path, Path], deepseek_fp8_want: list, all2all: str) -> None:  # fmt: skip
    deepseek_fp8_dir = deepseek_fp8_dirs[0]
    config = TINY_DEEPSEEK_CONFIGS["deepseek_v3"]
    prompts, want = _deepseek_prompts(), deepseek_fp8_want
    with LLM(str(deepseek_fp8_dir), data_parallel_size=2, enable_expert_parallel=True, all2all_backend=all2all,
             **OPTIONS) as llm:
        client = llm.client
        detail = client.ready_detail
        assert [(detail[f"worker/{r}"]["ep"], detail[f"worker/{r}"]["experts"]) for r in range(2)] == [
            ("0/2", "0-3/8"), ("1/2", "4-7/8")]
        got = _generate_within(llm, prompts, timeout_s=60)
        assert client.coordinator.assigned == [2, 2]
        assert got == want
        # every token computed went to top_k experts in each MoE layer (layer 0 is dense: not counted)
        moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
        computed = sum(len(p["prompt_token_ids"]) + GREEDY.max_tokens - 1 for p in prompts)
        expected = [computed * config["num_experts_per_tok"]] * moe_layers
        busy = expert_loads_reaching(client, lambda total: total.sum(axis=1).tolist() == expected)
        assert busy.shape == (moe_layers, config["n_routed_experts"])
        # one request: one rank runs it while the other, idle, runs empty steps through the all-to-alls
        alone = _generate_within(llm, prompts[1:2], timeout_s=30)
        # (which rank: both have no request left, and their last KV usage reports, which may lag, break the tie)
        assert sorted(client.coordinator.assigned) == [2, 3]
        assert alone == want[1:2]
        expert_loads_reaching(client, lambda total: (total.sum(axis=1) > busy.sum(axis=1)).all())


def test_dp2_ep2_kimi_k2_style_deepseek_gives_the_one_rank_tokens(tmp_path: Path) -> None:
    """Kimi-K2's shape of the class: one expert group, two shared experts, no q LoRA, tied embeddings (float)."""
    model_dir = write_tiny_deepseek_model(tmp_path / "kimi", "deepseek_v3_no_q_lora")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    prompts = _deepseek_prompts()
    with LLM(str(model_dir), **OPTIONS) as llm:
        want = _tokens(llm, prompts)
    with LLM(str(model_dir), data_parallel_size=2, enable_expert_parallel=True, **OPTIONS) as llm:
        assert llm.client.ready_detail["worker/1"]["experts"] == "3-5/6"
        got = _generate_within(llm, prompts, timeout_s=60)
        assert llm.client.coordinator.assigned == [2, 2]
    assert got == want


def test_an_expert_parallel_deepseek_rank_reads_only_its_own_experts_and_keeps_them_fp8(
        deepseek_fp8_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Rank 1 of 2 (the group faked: loading runs no collective) keeps experts 4-7 of each MoE layer in FP8, equal
    to the checkpoint's experts 4-7 (dequantized: the whole float model's rows 4-7); experts 0-3's FP8 weights and
    scales are not read, and no expert is dequantized at load (only kv_b_proj is)."""
    config = TINY_DEEPSEEK_CONFIGS["deepseek_v3"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    deepseek_fp8_dir, float_dir = deepseek_fp8_dirs
    whole = load_flotilla_model(float_dir)
    monkeypatch.setattr(parallel, "_EP", parallel.EPGroup(rank=1, size=2, group=None))
    monkeypatch.setattr(qwen3_moe, "ExpertParallelExperts", lambda placement, group, backend: None)
    dequantized: list[tuple[int, ...]] = []
    real_dequantize = deepseek_v3.block_dequantize
    monkeypatch.setattr(deepseek_v3, "block_dequantize",
                        lambda q, s, block: dequantized.append(tuple(q.shape)) or real_dequantize(q, s, block))
    read: list[str] = []
    real_stream = loader._stream_tensors

    def stream(*args, **kwargs):
        for name, tensor in real_stream(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "_stream_tensors", stream)
    model = loader.load_model(deepseek_fp8_dir, progress=False, model_kwargs={"attention_backend": "torch"}).module
    assert isinstance(model, DeepseekV3ForCausalLM)
    experts = [n for n in read if ".mlp.experts." in n]
    assert all(int(n.split(".mlp.experts.")[1].split(".")[0]) >= 4 for n in experts)
    assert len(experts) == moe_layers * 4 * 3 * 2  # 4 experts x (gate, up, down) x (weight, scale)
    mine_dequantized = config["num_hidden_layers"]  # kv_b_proj; the routed experts stay FP8
    assert len(dequantized) == mine_dequantized
    for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        mine, full = model.model.layers[i].mlp.experts, whole.model.layers[i].mlp.experts
        assert mine.placement.local_experts == range(4, 8) and mine.gate_up_proj.shape[0] == 4
        assert mine.gate_up_proj.dtype == FP8_DTYPE
        for e in range(4):
            w13 = torch_ref.w13_block_dequantize(mine.gate_up_proj[e], mine.gate_up_proj_scale_inv[e], BLOCK)
            w2 = block_dequantize(mine.down_proj[e], mine.down_proj_scale_inv[e], BLOCK)
            assert torch.equal(w13, full.gate_up_proj[4 + e]) and torch.equal(w2, full.down_proj[4 + e])
        shared, whole_shared = model.model.layers[i].mlp.shared_experts, whole.model.layers[i].mlp.shared_experts
        assert shared.down_proj.weight.shape == whole_shared.down_proj.weight.shape  # whole on every rank
    # load_weights fed every tensor (no loader in between) drops the other rank's experts before dequantizing
    dequantized.clear()
    fresh = DeepseekV3ForCausalLM(model.config, attention_backend="torch")
    weights = load_file(str(deepseek_fp8_dir / "model.safetensors"))
    assert fresh.load_weights(weights.items()) == set(dict(fresh.named_parameters()))
    assert len(dequantized) == mine_dequantized


def test_expert_parallel_and_data_parallel_options_are_checked_before_anything_starts(moe_dir: Path,
                                                                                       tmp_path: Path) -> None:
    dense = write_tiny_engine_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ValueError, match="enable_expert_parallel needs a MoE model; dense has no routed experts"):
        LLM(str(dense), data_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
    with pytest.raises(ValueError, match="the default model has no experts"):
        engine_topology(EngineConfig.from_options(enable_expert_parallel=True), "process")
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over data_parallel_size=3"):
        LLM(str(moe_dir), data_parallel_size=3, enable_expert_parallel=True, **OPTIONS)
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        EngineConfig.from_options(data_parallel_size=0)
    with pytest.raises(ValueError, match="one process per rank: use placement='process'"):
        LLM(str(moe_dir), data_parallel_size=2, placement="inline")
    with pytest.raises(ValueError, match="prefill or decode role is not built yet"):
        engine_topology(EngineConfig.from_options(model=str(moe_dir), data_parallel_size=2, role="prefill"), "process")
    gather = dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="allgather_reducescatter")
    assert EngineConfig.from_options(tensor_parallel_size=2, **gather).parallel.gathers_tokens  # DP x TP x EP
    assert not EngineConfig.from_options(all2all_backend="allgather_reducescatter").parallel.gathers_tokens


def test_data_parallel_topology_wires_one_scheduler_per_rank_and_an_ep_rendezvous(moe_dir: Path) -> None:
    topo = engine_topology(EngineConfig.from_options(model=str(moe_dir), data_parallel_size=2,
                                                     enable_expert_parallel=True), "process")
    assert topo.spec("scheduler").count == 2 and topo.spec("worker").count == 2
    assert topo.spec("worker").config["ep_init_method"].startswith("tcp://127.0.0.1:")
    dense = engine_topology(EngineConfig.from_options(model=str(moe_dir), data_parallel_size=2,
                                                      tensor_parallel_size=2), "process")
    assert dense.spec("worker").count == 4 and "ep_init_method" not in dense.spec("worker").config
    methods = dense.spec("worker").config["dist_init_methods"]  # a TP group per DP rank
    assert len(set(methods)) == 2


def _stats(rank: int, kv_usage: float, running: int = 0) -> SchedulerStatsEvent:
    return SchedulerStatsEvent(num_running=running, num_waiting=0, kv_usage=kv_usage, prefix_cache_hit_rate=0.0,
                               num_preemptions=0, kv_capacity_tokens=100, dp_rank=rank)


def test_coordinator_gives_each_request_to_the_least_loaded_rank() -> None:
    c = DPCoordinator(3)
    assert [c.pick() for _ in range(4)] == [0, 1, 2, 0]  # a burst spreads; ties go to the lower rank
    c.finished(1)  # rank 1 has the fewest unfinished requests now
    assert c.pick() == 1
    c.finished(0)
    c.finished(0)
    c.finished(2)
    assert c.unfinished == [0, 1, 0]
    c.observe(_stats(0, kv_usage=0.7))
    c.observe(_stats(2, kv_usage=0.2))
    assert c.pick() == 2  # equal counts: the emptier KV cache wins
    assert c.assigned == [2, 2, 2]
    c.observe(_stats(3, kv_usage=0.0))  # no such rank: dropped, the receive loop goes on
    assert len(c.stats) == 3
    total = c.total_stats()
    assert total.kv_capacity_tokens == 200 and total.kv_usage == pytest.approx(0.45)
    assert sum_stats([]) is None


def test_lockstep_announces_only_when_ahead_and_owes_steps_when_behind() -> None:
    a, b = StepLockstep(), StepLockstep()
    assert not a.owed
    assert a.count_sent() == 1 and a.count_sent() == 2  # ahead of everyone: announce each count
    b.on_peer(2)
    assert b.owed
    empty = b.empty_plan()
    assert empty.step < 0 and not empty.rids and StepLockstep.is_empty_step(empty.step)
    assert b.count_sent() is None and b.owed  # catching up: nothing to announce
    assert b.count_sent() is None and not b.owed
    assert b.count_sent() == 3  # now ahead
    assert b.empty_plan().step != empty.step
    b.on_peer(1)  # an older announcement does not lower the mark
    assert b.peak == 2


def test_expert_loads_sum_over_ranks_into_the_metrics_counter() -> None:
    loads = ExpertLoads()
    assert loads.total() is None
    loads.observe(ExpertLoadEvent(dp_rank=0, expert_tokens=np.array([[3, 0], [1, 1]], dtype=np.int64)))
    loads.observe(ExpertLoadEvent(dp_rank=1, expert_tokens=np.array([[1, 0], [0, 2]], dtype=np.int64)))
    loads.observe(ExpertLoadEvent(dp_rank=1, expert_tokens=np.array([[2, 0], [0, 2]], dtype=np.int64)))  # newer
    assert loads.total().tolist() == [[5, 0], [1, 3]]
    metrics = ServerMetrics("m")
    metrics.render(None, expert_tokens=loads.total())
    text = metrics.render(None, expert_tokens=loads.total() + 1).decode()
    assert 'flotilla_expert_tokens_total{expert="0",layer="0",model_name="m"} 6.0' in text
    assert 'flotilla_expert_tokens_total{expert="1",layer="0",model_name="m"} 1.0' in text


@needs("openai", "the test talks to the server through the real openai client")
def test_flotilla_serve_runs_dp2_ep2_and_exports_the_ranks_and_expert_loads(moe_dir: Path) -> None:
    server = start_server(str(moe_dir), "--data-parallel-size", "2", "--enable-expert-parallel",
                          "--kv-cache-blocks", "128", "--block-size", "4", timeout=120)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompts = ["The quick brown fox", "What is the capital of France?"] * 4

        def run(p: str) -> str:
            return client.completions.create(model=moe_dir.name, prompt=p, max_tokens=8, temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(run, prompts))
        assert len({o for o, p in zip(outs, prompts) if p == prompts[0]}) == 1  # whichever rank ran it
        assert len({o for o, p in zip(outs, prompts) if p == prompts[1]}) == 1
        deadline = time.monotonic() + 10
        while True:
            text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
            experts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("flotilla_expert_tokens_total{")]
            if sum(experts) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(experts) == 2 * 8 and sum(experts) > 0  # 2 MoE layers x 8 experts, summed over both ranks
        routed = {line.split('dp_rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("flotilla_dp_requests_routed_total{")}
        assert set(routed) == {"0", "1"} and sum(routed.values()) == len(prompts) and min(routed.values()) >= 2
    finally:
        assert server.stop() == 0
