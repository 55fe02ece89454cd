"""Tensor parallelism x expert parallelism (tensor_parallel_size=T, enable_expert_parallel, one data-parallel
rank; vLLM's layout): the routed experts spread over the T tensor-parallel ranks, whole, with no all-to-all.

- the layer (kernels/moe/expert_parallel.py `SharedTokenExperts`): each rank's partial output over the same
  tokens, summed as the block's all-reduce sums them, is the single-process MoE of every expert;
- loading: a rank keeps its experts whole (not a slice of every expert's intermediate dim, as plain TP does)
  and reads no other rank's expert tensors;
- the engine end to end: two worker processes joined by gloo give the one-rank engine's greedy tokens, report
  their experts in the ready detail, and count each routed token once in the per-expert loads (Qwen3-MoE; and
  a Kimi-K2-shaped DeepSeek, whose shared experts stay tensor-parallel);
- what cannot be built is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flotilla import LLM, SamplingParams
from flotilla.config import EngineConfig
from flotilla.kernels.moe import get_moe_backend, select_experts, torch_ref
from flotilla.kernels.moe.expert_parallel import ExpertPlacement, SharedTokenExperts
from flotilla.models import loader, parallel
from flotilla.models.qwen3_moe import Qwen3MoeForCausalLM
from flotilla.server.engine_client import engine_topology
from helpers_engine import write_tiny_tokenizer
from helpers_parallel import expert_loads_reaching, generated_tokens, random_prompts
from helpers_tiny_models import (
    TINY_MOE_CONFIGS,
    load_flotilla_model,
    write_tiny_deepseek_model,
    write_tiny_moe_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

# chunked prefill (16-token budget), mixed prefill + decode steps, steps in flight (the default)
OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CONFIG = TINY_MOE_CONFIGS["qwen3_moe"]  # 8 experts, top-2, layers 0 and 2 sparse, layer 1 dense


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = write_tiny_moe_model(tmp_path_factory.mktemp("tp_ep") / "qwen3_moe", "qwen3_moe")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


@pytest.mark.parametrize("ranks, top_k", [(2, 2), (2, 3), (4, 3)])
def test_the_ranks_partial_outputs_sum_to_the_single_process_moe(ranks: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(ranks * 10 + top_k)
    experts, hidden, inter, tokens = 8, 16, 12, 9
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(experts, hidden, inter, generator=g) / 4
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g) * 3, top_k, renormalize=True)
    ids[0] = torch.arange(experts - top_k, experts, dtype=torch.int32)  # token 0: only the last rank's experts
    want = torch_ref.fused_experts(x, w13, w2, weights, ids)
    backend = get_moe_backend("torch")
    partials = []
    for rank in range(ranks):
        placement = ExpertPlacement(experts, ranks, rank)
        layer = SharedTokenExperts(placement, backend)
        out = layer(x, placement.local_slice(w13), placement.local_slice(w2), weights, ids)
        partials.append(out)
        owned = ids.long() // (experts // ranks) == rank  # [tokens, k]: the slots this rank computes
        # every rank counts every routed slot (so one rank's counts are the engine's); its experts, only theirs
        assert placement.expert_load.sum() == tokens * top_k
        assert placement.expert_load.tolist() == torch.bincount(ids.flatten().long(), minlength=experts).tolist()
        assert placement.local_expert_load.sum() == owned.sum()
        if not owned[0].any():
            assert torch.equal(out[0], torch.zeros(hidden))  # nothing of token 0 is computed here
    torch.testing.assert_close(torch.stack(partials).sum(0), want, rtol=1e-6, atol=1e-6)
    if ranks == 2 and top_k == 2:  # two float32 adds in ascending expert order, as the reference's: to the bit
        assert torch.equal(partials[0] + partials[1], want)
    empty = SharedTokenExperts(ExpertPlacement(experts, ranks, 0), backend)  # a step without tokens
    assert empty(x[:0], w13[: experts // ranks], w2[: experts // ranks], weights[:0], ids[:0]).shape == (0, hidden)


def test_a_tp_ep_rank_keeps_whole_experts_and_reads_only_its_own(moe_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 (the group faked: loading runs no collective) keeps experts 4-7 of each MoE layer, whole and
    equal to the whole model's rows 4-7, while attention and the dense MLP stay tensor-parallel; the loader is
    told to read none of experts 0-3's tensors (its checkpoint_filter, which test_dp_ep sees the loader apply)."""
    whole = load_flotilla_model(moe_dir)
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=1, size=2, group=None))
    monkeypatch.setattr(parallel, "_EP_OVER_TP", False)  # restored after the test, whatever the call below sets
    parallel.expert_parallel_over_tensor_parallel()
    model = loader.load_model(moe_dir, progress=False, model_kwargs={"attention_backend": "torch"}).module
    assert isinstance(model, Qwen3MoeForCausalLM)
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    kept = [n for n in filter(model.checkpoint_filter(), names) if ".mlp.experts." in n]
    assert sorted({int(n.split(".mlp.experts.")[1].split(".")[0]) for n in kept}) == [4, 5, 6, 7]
    assert len(kept) == 2 * 4 * 3  # 2 MoE layers x 4 experts x (gate, up, down)
    assert all(model.checkpoint_filter()(n) for n in names if ".mlp.experts." not in n)
    for i in (0, 2):
        mine, full = model.model.layers[i].mlp.experts, whole.model.layers[i].mlp.experts
        assert mine.placement.local_experts == range(4, 8)
        assert mine.gate_up_proj.shape == (4, 2 * CONFIG["moe_intermediate_size"], 64)  # whole experts
        assert torch.equal(mine.gate_up_proj, full.gate_up_proj[4:]) and torch.equal(mine.down_proj, full.down_proj[4:])
        assert isinstance(mine.ep_experts, SharedTokenExperts)
    dense, whole_dense = model.model.layers[1].mlp, whole.model.layers[1].mlp
    assert dense.down_proj.weight.shape[1] == whole_dense.down_proj.weight.shape[1] // 2  # still tensor-parallel


def _prompts() -> list[dict]:
    return random_prompts(13, (5, 23, 9, 14, 3))


def _tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return generated_tokens(llm, prompts, GREEDY)


def test_tp2_ep2_gives_the_one_rank_tokens_and_counts_each_routed_token_once(moe_dir: Path) -> None:
    prompts = _prompts()
    with LLM(str(moe_dir), **OPTIONS) as llm:
        want = _tokens(llm, prompts)
    with LLM(str(moe_dir), tensor_parallel_size=2, enable_expert_parallel=True, placement="process",
             **OPTIONS) as llm:  # fmt: skip
        client = llm.client
        detail = client.ready_detail
        assert [(detail[f"worker/{r}"]["tp"], detail[f"worker/{r}"]["ep"], detail[f"worker/{r}"]["experts"])
                for r in range(2)] == [("0/2", "0/2", "0-3/8"), ("1/2", "1/2", "4-7/8")]
        assert client.runtime.ready["worker/0"].pid != client.runtime.ready["worker/1"].pid
        got = _tokens(llm, prompts)
        computed = sum(len(p["prompt_token_ids"]) + GREEDY.max_tokens - 1 for p in prompts)
        top_k = CONFIG["num_experts_per_tok"]
        loads = expert_loads_reaching(client, lambda total: total.sum(axis=1).tolist() == [computed * top_k] * 2)
        assert loads.shape == (2, 8)  # both MoE layers, every expert: rank 1's experts counted too
        assert (loads[:, 4:].sum(axis=1) > 0).all() and (loads[:, :4].sum(axis=1) > 0).all()
        assert sorted(client.expert_loads.by_rank) == [0]  # one data-parallel rank reports
    assert all(len(t) == GREEDY.max_tokens for t in got)
    assert got == want


def test_tp2_ep2_kimi_k2_style_deepseek_gives_the_one_rank_tokens(tmp_path: Path) -> None:
    """The DeepSeek family takes the same path (its routed experts are StackedExperts too): Kimi-K2's shape (one
    expert group, two shared experts, which stay tensor-parallel, no q LoRA, tied embeddings), float."""
    model_dir = write_tiny_deepseek_model(tmp_path / "kimi", "deepseek_v3_no_q_lora")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    prompts = _prompts()[:3]
    with LLM(str(model_dir), **OPTIONS) as llm:
        want = _tokens(llm, prompts)
    with LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, placement="process",
             **OPTIONS) as llm:  # fmt: skip
        assert [llm.client.ready_detail[f"worker/{r}"]["experts"] for r in range(2)] == ["0-2/6", "3-5/6"]
        got = _tokens(llm, prompts)
    assert got == want


def test_tp_ep_options_are_checked_before_anything_starts(moe_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"8 experts cannot be split evenly over tensor_parallel_size=3 ranks"):
        LLM(str(moe_dir), tensor_parallel_size=3, enable_expert_parallel=True, placement="process", **OPTIONS)
    config = EngineConfig.from_options(model=str(moe_dir), tensor_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel.expert_parallel_size == 2
    worker = engine_topology(config, "process").spec("worker")
    assert worker.count == 2 and "ep_init_method" not in worker.config  # the experts' group is the TP group
