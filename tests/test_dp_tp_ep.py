"""Data parallelism x tensor parallelism (x expert parallelism): data_parallel_size=2, tensor_parallel_size=2, four
worker processes joined by gloo.

- without expert parallelism the two data-parallel ranks are independent TP2 replicas (a TP world each);
- with enable_expert_parallel the four ranks form one world: the experts spread over all four (each keeps
  E / 4, whole), each data-parallel rank's two ranks are a tensor-parallel sub-group, and each TP rank sends
  half of its data-parallel rank's tokens to the experts' ranks by all-to-all (kernels/moe/expert_parallel.py
  `token_share`); the TP all-reduce restores the other half;
- or, with all2all_backend allgather_reducescatter, each TP rank all-gathers its half (kernels/moe/ep_allgather.py
  `token_share`) and the reduce-scatter and the TP all-reduce bring the sums back;
- either way the engine gives the one-process engine's greedy tokens, with both data-parallel ranks busy and
  with one idle (under EP its two ranks run empty steps through the all-to-alls), and under EP the per-expert
  loads count each routed token once (Qwen3 dense, Qwen3-MoE; DeepSeek-V3 with its shared expert under EP);
- what cannot be built is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.config import EngineConfig
from flotilla.kernels.moe import get_moe_backend, select_experts, torch_ref
from flotilla.kernels.moe.ep_allgather import GatheredTokenExperts, ep_tokens
from flotilla.kernels.moe.expert_parallel import ExpertParallelExperts, ExpertPlacement
from flotilla.server.engine_client import engine_topology
from helpers_engine import write_tiny_engine_model, write_tiny_tokenizer
from helpers_optional import needs
from helpers_parallel import expert_loads_reaching, generate_within, random_prompts
from helpers_tiny_models import TINY_MOE_CONFIGS, write_tiny_deepseek_model, write_tiny_moe_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, placement="process")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DP2_TP2 = dict(data_parallel_size=2, tensor_parallel_size=2)


def _prompts() -> list[dict]:
    """Four for both data-parallel ranks, then one for a single rank (not seen before: no prefix-cache hit)."""
    return random_prompts(17, (5, 19, 9, 3, 7))


def _generate_within(llm: LLM, prompts: list[dict], timeout_s: float) -> list[list[int]]:
    return generate_within(llm, prompts, GREEDY, timeout_s)


def _one_process_tokens(model_dir: Path, prompts: list[dict]) -> list[list[int]]:
    with LLM(str(model_dir), **{**OPTIONS, "placement": "inline"}) as llm:
        return _generate_within(llm, prompts, timeout_s=60)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = write_tiny_moe_model(tmp_path_factory.mktemp("dp_tp_ep") / "qwen3_moe", "qwen3_moe")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


@pytest.mark.parametrize("shares", [2, 3])
def test_the_token_shares_cover_every_token_once(shares: int) -> None:
    """The sharing ranks' outputs (zeros outside each one's rows), summed as the TP all-reduce sums them, are the
    one-process MoE (to rounding: the experts' GEMMs see other batches); each share counts every token's routing (one rank's counts are all of them)."""
    g = torch.Generator().manual_seed(shares)
    experts, hidden, inter, tokens, top_k = 8, 16, 12, 7, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(experts, hidden, inter, generator=g) / 4
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g) * 3, top_k, renormalize=True)
    want = torch_ref.fused_experts(x, w13, w2, weights, ids)
    outs = []
    for share in range(shares):
        placement = ExpertPlacement(experts, 1, 0)  # one EP rank: the all-to-alls are copies
        layer = ExpertParallelExperts(placement, None, get_moe_backend("torch"), token_share=(share, shares))
        out = layer(x, w13, w2, weights, ids)
        rows = range(share * -(-tokens // shares), min((share + 1) * -(-tokens // shares), tokens))
        assert placement.local_expert_load.sum() == len(rows) * top_k  # only its share went through dispatch
        assert placement.expert_load.sum() == tokens * top_k
        assert not out[[i for i in range(tokens) if i not in rows]].any()
        outs.append(out)
    torch.testing.assert_close(sum(outs[1:], outs[0]), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="token share 2 is not one of 2"):
        ExpertParallelExperts(ExpertPlacement(experts, 1, 0), None, token_share=(2, 2))
    # the all-gather layer's shares (one EP rank, rows agreed at 9): the same sums
    gathered = []
    for share in range(shares):
        layer = GatheredTokenExperts(ExpertPlacement(experts, 1, 0), None, get_moe_backend("torch"),
                                     token_share=(share, shares))
        with ep_tokens(9):
            gathered.append(layer(x, w13, w2, weights, ids))
        assert layer.placement.expert_load.sum() == tokens * top_k
    torch.testing.assert_close(sum(gathered[1:], gathered[0]), want, rtol=1e-6, atol=1e-6)


def test_dp2_tp2_dense_qwen3_gives_the_one_process_tokens(tmp_path: Path) -> None:
    """Without expert parallelism: two independent TP2 replicas (a rendezvous each), both busy, then one idle."""
    model_dir = write_tiny_engine_model(tmp_path / "qwen3", "qwen3")
    prompts = _prompts()
    want = _one_process_tokens(model_dir, prompts)
    with LLM(str(model_dir), **DP2_TP2, **OPTIONS) as llm:
        detail = llm.client.ready_detail
        assert [(detail[f"worker/{w}"]["dp"], detail[f"worker/{w}"]["tp"]) for w in range(4)] == [
            ("0/2", "0/2"), ("0/2", "1/2"), ("1/2", "0/2"), ("1/2", "1/2")]
        assert len({llm.client.runtime.ready[f"worker/{w}"].pid for w in range(4)}) == 4
        assert _generate_within(llm, prompts[:4], timeout_s=120) == want[:4]
        assert llm.client.coordinator.assigned == [2, 2]
        assert _generate_within(llm, prompts[4:], timeout_s=60) == want[4:]
    assert all(len(t) == GREEDY.max_tokens for t in want)


@pytest.fixture(scope="module")
def moe_want(moe_dir: Path) -> list[list[int]]:
    """The one-process engine's tokens of _prompts() on the tiny Qwen3-MoE (both parametrizations' reference)."""
    return _one_process_tokens(moe_dir, _prompts())


# (allgather_reducescatter's dispatch under DP x EP: test_dp_ep.py, for Qwen3-MoE and FP8 DeepSeek-V3)
@pytest.mark.parametrize(("expert_parallel", "all2all"), [(False, "auto"), (True, "all_to_all")])
def test_dp2_tp2_qwen3_moe_gives_the_one_process_tokens_busy_and_with_one_rank_idle(
        moe_dir: Path, moe_want: list, expert_parallel: bool, all2all: str) -> None:  # fmt: skip
    prompts, want = _prompts(), moe_want
    with LLM(str(moe_dir), **DP2_TP2, enable_expert_parallel=expert_parallel, all2all_backend=all2all,
             **OPTIONS) as llm:
        client = llm.client
        detail = client.ready_detail
        if expert_parallel:  # experts over all four ranks, global rank = dp * 2 + tp
            assert [(detail[f"worker/{w}"]["ep"], detail[f"worker/{w}"]["experts"]) for w in range(4)] == [
                ("0/4", "0-1/8"), ("1/4", "2-3/8"), ("2/4", "4-5/8"), ("3/4", "6-7/8")]
        else:
            assert "ep" not in detail["worker/0"]
        got = _generate_within(llm, prompts[:4], timeout_s=120)
        assert client.coordinator.assigned == [2, 2]
        assert got == want[:4]
        # one request: one DP rank runs it while both TP ranks of the other run empty steps (under EP)
        assert _generate_within(llm, prompts[4:], timeout_s=60) == want[4:]
        # (which rank: both have no request left, and their last KV usage reports, which may lag, break the tie)
        assert sorted(client.coordinator.assigned) == [2, 3]
        if expert_parallel:  # every token computed went to top_k experts per MoE layer, counted once
            top_k = TINY_MOE_CONFIGS["qwen3_moe"]["num_experts_per_tok"]
            computed = sum(len(p["prompt_token_ids"]) + GREEDY.max_tokens - 1 for p in prompts)
            loads = expert_loads_reaching(client, lambda t: t.sum(axis=1).tolist() == [computed * top_k] * 2)
            assert loads.shape == (2, 8) and (loads > 0).sum() > 4  # more than one rank's experts were used
            assert sorted(client.expert_loads.by_rank) == [0, 1]


def test_dp2_tp2_ep4_deepseek_v3_gives_the_one_process_tokens(tmp_path: Path) -> None:
    """DeepSeek-V3's MoE block adds its tensor-parallel shared expert's partial to the routed experts' token shares
    before the one all-reduce; a dense first layer, grouped routing (float checkpoint)."""
    model_dir = write_tiny_deepseek_model(tmp_path / "deepseek_v3", "deepseek_v3")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    prompts = _prompts()
    want = _one_process_tokens(model_dir, prompts)
    with LLM(str(model_dir), **DP2_TP2, enable_expert_parallel=True, **OPTIONS) as llm:
        assert [llm.client.ready_detail[f"worker/{w}"]["experts"] for w in range(4)] == [
            "0-1/8", "2-3/8", "4-5/8", "6-7/8"]
        assert _generate_within(llm, prompts[:4], timeout_s=120) == want[:4]
        assert _generate_within(llm, prompts[4:], timeout_s=60) == want[4:]  # one DP rank idle


def test_dp_tp_ep_options_are_checked_before_anything_starts(moe_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"8 experts cannot be split evenly over "
                                         r"data_parallel_size x tensor_parallel_size=6 ranks"):
        LLM(str(moe_dir), data_parallel_size=3, tensor_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
    config = EngineConfig.from_options(model=str(moe_dir), enable_expert_parallel=True, **DP2_TP2)
    assert config.parallel.expert_parallel_size == 4
    worker = engine_topology(config, "process").spec("worker")
    assert worker.count == 4 and worker.config["ep_init_method"].startswith("tcp://127.0.0.1:")
    assert "dist_init_methods" not in worker.config  # the TP groups are sub-groups of the EP ranks' world


@needs("openai", "the test talks to the server through the real openai client")
def test_flotilla_serve_runs_dp2_tp2_ep4_and_answers_like_one_process(moe_dir: Path) -> None:
    """The same topology behind `flotilla serve` and the real openai client: concurrent greedy completions over
    token-id prompts give the one-process engine's text, and /metrics counts the experts' tokens."""
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from helpers_server import start_server

    prompts = _prompts()[:4]
    with LLM(str(moe_dir), **{**OPTIONS, "placement": "inline"}) as llm:
        want = [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    server = start_server(str(moe_dir), "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                          "--enable-expert-parallel", "--kv-cache-blocks", "128", "--block-size", "4", timeout=240)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def text(p: dict) -> str:
            out = client.completions.create(model=moe_dir.name, prompt=p["prompt_token_ids"], temperature=0,
                                            max_tokens=GREEDY.max_tokens, extra_body={"ignore_eos": True})  # fmt: skip
            return out.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(text, prompts)) == want
        deadline = time.monotonic() + 20  # the workers report expert loads every half second, after their steps
        while "flotilla_expert_tokens_total{" not in urllib.request.urlopen(server.url + "/metrics",
                                                                           timeout=10).read().decode():
            assert time.monotonic() < deadline, "no expert token counts in /metrics"
            time.sleep(0.2)
    finally:
        server.stop()
