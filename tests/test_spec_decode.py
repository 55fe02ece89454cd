"""MTP speculative decoding on a tiny random DeepSeek-V3 whose MTP layer the test writes into the checkpoint.

Speculation must not change what a request gets: greedy tokens, seeded sampling and logprobs equal plain
decoding's for a batch of mixed-length prompts with chunked prefill, max_tokens and stop-token cuts, with
one and two drafts. The random MTP layer's drafts are nearly all wrong, so tests also replace them (the
runner's draft hook) with the tokens plain decoding gives, some corrupted: that exercises acceptance and
rollback, and with none corrupted every verify step yields num_speculative_tokens + 1 tokens.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from flotilla import LLM, SamplingParams
from flotilla.actors.block_manager import BlockManager
from flotilla.actors.spec_decode import check_speculative_config
from flotilla.config import EngineConfig, SpeculativeConfig
from flotilla.models.loader import load_model
from flotilla.server.metrics import ServerMetrics
from flotilla.sampling_params import StructuredOutputs
from flotilla.transport.messages import SchedulerStatsEvent, TokenizedRequest
from helpers_engine import write_tiny_tokenizer
from helpers_optional import needs
from helpers_server import start_server, start_servers
from helpers_spec import (STOP_TOKEN, VOCAB, add_mtp_layer, attach_step_graphs, check_all_accepted, check_same,
                          count_step_graphs, device_oracle, make_runner, oracle, requests, run)
from helpers_tiny_models import write_tiny_deepseek_fp8_pair, write_tiny_deepseek_model, write_tiny_model
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = add_mtp_layer(write_tiny_deepseek_model(tmp_path_factory.mktemp("mtp") / "m", "deepseek_v3"))
    write_tiny_tokenizer(d, vocab_size=VOCAB)
    return d


@pytest.mark.parametrize("fp8", [False, True])
def test_dummy_weights_are_the_same_with_and_without_the_mtp_layer(model_dir: Path, tmp_path: Path, fp8: bool) -> None:
    """load_format=dummy draws each tensor from its own name, so building the MTP layer for speculation changes no
    other weight (bench_mtp compares such an engine's tokens with the plain model's)."""
    folder = write_tiny_deepseek_fp8_pair(tmp_path)[0] if fp8 else model_dir
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    plain = dict(load_model(folder, load_format="dummy", progress=False).module.named_parameters())
    mtp = dict(load_model(folder, load_format="dummy", progress=False, model_kwargs={"mtp": True})
               .module.named_parameters())  # fmt: skip
    assert set(plain) < set(mtp) and any(".mtp_layers." in name for name in mtp)
    if fp8:
        assert any(t.dtype == torch.float8_e4m3fn for t in plain.values())
    for name, t in plain.items():
        assert torch.equal(mtp[name], t), name
    again = dict(load_model(folder, load_format="dummy", progress=False).module.named_parameters())
    assert all(torch.equal(again[name], t) for name, t in plain.items())  # and a second load draws the same


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> tuple[dict, dict]:
    tokens, logprobs, sched, verified = run(make_runner(model_dir, None))
    assert not verified and sched.spec_draft_tokens == 0
    assert STOP_TOKEN in tokens["r5"] and tokens["r5"][-1] == STOP_TOKEN and len(tokens["r5"]) < 16, \
        "the fixture's stop-token request should stop early"
    return tokens, logprobs


@pytest.mark.parametrize("num_spec", [1, 2])
def test_speculation_gives_the_tokens_of_plain_decoding(model_dir: Path, plain: tuple, num_spec: int) -> None:
    runner = make_runner(model_dir, num_spec)
    assert runner.model.num_layers == 4 and len(runner.kv_caches) == 4  # the MTP layer's own cache layer
    tokens, logprobs, sched, verified = run(runner)
    check_same((tokens, logprobs), plain)
    assert sched.spec_draft_tokens == sum(k for k, _ in verified) > 0
    assert max(k for k, _ in verified) == num_spec
    assert sched.spec_accepted_tokens == sum(n - 1 for _, n in verified)


@pytest.fixture(scope="module")
def corrupted(model_dir: Path, plain: tuple) -> Callable[[int], dict]:
    """num_spec -> speculation with the oracle's drafts (plain decoding's tokens, some wrong), run once and shared by
    the tests below: run()'s results, and what the publish hook and the traced steps saw (tracing changes nothing
    the runner computes)."""
    done: dict[int, dict] = {}

    def get(num_spec: int) -> dict:
        if num_spec not in done:
            done[num_spec] = _traced_run(model_dir, plain, num_spec)
        return done[num_spec]
    return get


def _traced_run(model_dir: Path, plain: tuple, num_spec: int) -> dict:
    runner = make_runner(model_dir, num_spec)
    spec = runner.spec
    spec.draft_hook = oracle(plain[0], corrupt=True)
    passes, published, decode_steps, returned, early = [0], {}, set(), {}, []
    mtp_forward = runner.model.mtp_forward
    runner.model.mtp_forward = lambda *a, **kw: passes.__setitem__(0, passes[0] + 1) or mtp_forward(*a, **kw)
    spec.publish = lambda result: published.setdefault(result.step, (result, passes[0]))
    execute = runner.execute

    def traced(plan):
        known = [runner.seqs.get(rid) for rid in plan.rids]
        if plan.rids and all(s is not None and s.length > s.num_prompt_tokens for s in known):
            decode_steps.add(plan.step)
        before = passes[0]
        result = returned[plan.step] = execute(plan)
        if plan.step in published:
            early.append(published[plan.step][1] == before < passes[0])  # before the step's first MTP pass?
        return result

    runner.execute = traced
    tokens, logprobs, sched, verified = run(runner)
    return dict(tokens=tokens, logprobs=logprobs, sched=sched, verified=verified, published=published,
                decode_steps=decode_steps, returned=returned, early=early)


@pytest.mark.parametrize("num_spec", [1, 2])
def test_accepted_and_rejected_drafts_give_the_tokens_of_plain_decoding(plain: tuple, corrupted, num_spec: int) -> None:
    got = corrupted(num_spec)
    sched, verified = got["sched"], got["verified"]
    check_same((got["tokens"], got["logprobs"]), plain)
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens
    assert {n for _, n in verified} == set(range(1, num_spec + 2))  # none, some and all drafts accepted


@pytest.mark.parametrize("num_spec", [1, 2])
def test_a_step_of_decodes_publishes_its_result_before_it_drafts(plain: tuple, corrupted, num_spec: int) -> None:
    """MTPSpeculator.publish gets each step of decodes only's result (the object the step returns) once its tokens are
    known and before any MTP pass of that step, so the worker can send it while the device drafts; a step with prompt
    tokens is not published (its KV may move to another engine as soon as its result is in). The tokens stay plain
    decoding's, with drafts accepted and rejected."""
    got = corrupted(num_spec)
    sched, published, decode_steps = got["sched"], got["published"], got["decode_steps"]
    check_same((got["tokens"], got["logprobs"]), plain)
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens
    assert got["early"] and all(got["early"])  # each published before the step's first MTP pass
    assert set(published) == decode_steps and len(decode_steps) >= 5
    assert all(got["returned"][step] is result for step, (result, _) in published.items())


@pytest.mark.parametrize("num_spec", [1, 2, 3])
def test_forced_acceptance_gives_num_speculative_tokens_plus_one_per_verify_step(model_dir: Path, plain: tuple,
                                                                                 num_spec: int) -> None:
    runner = make_runner(model_dir, num_spec)
    runner.spec.draft_hook = oracle(plain[0], corrupt=False)
    rows: list[tuple[str, int, int]] = []
    tokens, logprobs, sched, verified = run(runner, rows=rows)
    check_same((tokens, logprobs), plain)
    check_all_accepted(rows, plain[0])
    assert sum(k == num_spec for k, _ in verified) > len(verified) // 2
    assert sched.spec_draft_tokens - sched.spec_accepted_tokens == sum(k + 1 - n for _, k, n in rows)


def grammar_requests() -> list[TokenizedRequest]:
    """Requests under a regex (greedy and seeded sampling) beside unconstrained ones; the last shares a prompt."""
    rng = np.random.default_rng(5)
    so = StructuredOutputs(regex="[a-z]{4,8}( [a-z]{4,8}){2,4}")
    kinds = [SamplingParams(max_tokens=20, temperature=0, structured_outputs=so),
             SamplingParams(max_tokens=20, temperature=0.8, seed=3, structured_outputs=so),
             SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    reqs = [TokenizedRequest(rid=f"g{i}", prompt_ids=rng.integers(4, VOCAB, n).astype(np.int32), eos_token_ids=[2],
                             sampling=kinds[i % len(kinds)]) for i, n in enumerate([5, 12, 7, 9, 3, 15])]
    reqs.append(TokenizedRequest(rid="g6", prompt_ids=np.concatenate((reqs[1].prompt_ids, [9, 10])),
                                 eos_token_ids=[2], sampling=kinds[0]))
    return reqs


@pytest.fixture(scope="module")
def plain_under_grammar(model_dir: Path) -> tuple[dict, dict]:
    """Plain decoding's (tokens, logprobs) of grammar_requests()."""
    return run(make_runner(model_dir, None), reqs=grammar_requests())[:2]


@needs("xgrammar", "structured outputs")
@pytest.mark.parametrize("corrupt", [False, True])
def test_drafts_under_a_grammar_are_masked_at_each_position_and_give_the_plain_tokens(model_dir: Path,
                                                                                        plain_under_grammar: tuple,
                                                                                        corrupt: bool) -> None:
    reqs, plain = grammar_requests(), plain_under_grammar
    runner = make_runner(model_dir, 2)
    runner.spec.draft_hook = oracle(plain[0], corrupt, reqs)
    rows: list[tuple[str, int, int]] = []
    tokens, logprobs, _, _ = run(runner, rows=rows, reqs=reqs)
    check_same((tokens, logprobs), plain)
    constrained = {r.rid for r in reqs if r.sampling.structured_outputs is not None}
    verified = [(k, n) for rid, k, n in rows if rid in constrained and k]
    assert verified, "the constrained requests speculated"
    if not corrupt:  # drafts that follow the grammar are kept; corrupted ones that break it are not
        assert sum(n == k + 1 for k, n in verified) > len(verified) // 2
    else:
        assert any(n < k + 1 for k, n in verified)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for rid in constrained:
        text = tok.decode([t for t in tokens[rid] if t != 2])
        assert set(text) <= set("abcdefghijklmnopqrstuvwxyz "), (rid, text)


@pytest.mark.gpu
@pytest.mark.parametrize("num_spec", [1, 3])
def test_forced_acceptance_on_cuda_gives_num_speculative_tokens_plus_one_per_verify_step(model_dir: Path,
                                                                                         num_spec: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    want = run(make_runner(model_dir, None, device="cuda"))[:2]
    runner = make_runner(model_dir, num_spec, device="cuda")
    runner.spec.draft_hook = oracle(want[0], corrupt=False)
    rows: list[tuple[str, int, int]] = []
    tokens, logprobs, _, verified = run(runner, rows=rows)
    check_same((tokens, logprobs), want)
    check_all_accepted(rows, want[0])
    full = [n for k, n in verified if k == num_spec]
    print(f"tokens per verify step at forced acceptance, N={num_spec}: {sum(full) / len(full):.2f}")


def test_a_tiny_kv_cache_preempts_and_still_gives_the_plain_tokens(model_dir: Path, plain: tuple) -> None:
    runner = make_runner(model_dir, 2, num_blocks=20)
    runner.spec.draft_hook = oracle(plain[0], corrupt=True)
    tokens, logprobs, sched, _ = run(runner)
    check_same((tokens, logprobs), plain)
    assert sched.num_preemptions > 0


def test_mtp_needs_a_checkpoint_with_an_mtp_layer(tmp_path: Path, model_dir: Path) -> None:
    bare = write_tiny_deepseek_model(tmp_path / "bare", "deepseek_v3")
    with pytest.raises(ValueError, match="has no MTP layer"):  # (transformers' config.json declares one)
        make_runner(bare, 1)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        make_runner(bare, 1)
    qwen = write_tiny_model(tmp_path / "qwen", "qwen3")
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction layers"):
        make_runner(qwen, 1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be at least 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    for parallel in ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                     {"data_parallel_size": 2, "enable_expert_parallel": True}):  # (each served, tests below)
        check_speculative_config(EngineConfig.from_options(model=str(model_dir), speculative_config=spec, **parallel))
    plain_model = load_model(str(model_dir), progress=False, model_kwargs={"attention_backend": "torch"}).module
    assert plain_model.num_layers == 3 and len(plain_model.model.mtp_layers) == 0  # MTP off: its tensors skipped
    mtp = load_model(str(model_dir), progress=False, model_kwargs={"attention_backend": "torch", "mtp": True}).module
    weights = load_file(str(model_dir / "model.safetensors"))
    torch.testing.assert_close(mtp.model.mtp_layers[0].eh_proj.weight, weights["model.layers.3.eh_proj.weight"])
    torch.testing.assert_close(mtp.model.mtp_layers[0].self_attn.kv_b_proj.weight,
                               weights["model.layers.3.self_attn.kv_b_proj.weight"])


def test_llm_with_speculative_config_gives_the_plain_greedy_tokens(model_dir: Path) -> None:
    """And the same prompt logprobs (a speculating engine scores prompts in its own step)."""
    prompts = [r.prompt_ids.tolist() for r in requests()[:4]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs, scored = {}, {}
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        extra = {} if spec is None else {"speculative_config": spec}
        with LLM(str(model_dir), kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, **extra) as llm:
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[str(spec)] = [o.outputs[0].token_ids for o in got]
        scored[str(spec)] = [(o.prompt_logprobs[0], [lp.logprob for lp in o.prompt_logprobs[1:]],
                              [sorted(lp.top) for lp in o.prompt_logprobs[1:]]) for o in got]
    assert outs["None"] == list(outs.values())[1]
    for (first, plain, plain_top), (_, spec, spec_top), p in zip(scored["None"], list(scored.values())[1], prompts):
        assert first is None and len(plain) == len(p) - 1
        assert spec == pytest.approx(plain, abs=1e-5) and spec_top == plain_top


def generate_planned_ahead(model_dir: Path, prompts: list[list[int]], params: SamplingParams, device: str,
                           plain: list[list[int]] | None = None, corrupt: bool = True) -> tuple[list[list[int]], dict]:
    """An inline speculating LLM whose scheduler plans steps ahead; on a CPU its runner gets the step graphs (rerun
    eagerly) and the scheduler the worker's word that it takes such steps, which only a CUDA runner gives. plain:
    drafts forced to plain decoding's tokens on the device (with `corrupt`, some wrong). -> (tokens, step graph
    counts and the scheduler's drafted and accepted counts)."""
    with LLM(str(model_dir), kv_cache_blocks=128, block_size=4, placement="inline", device=device, dtype="float32",
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:  # fmt: skip
        actors = llm.client.runtime.actors
        runner, scheduler = actors["worker/0"].runner, actors["scheduler/0"]
        if device == "cpu":
            attach_step_graphs(runner)
        # (a CUDA runner takes steps ahead by itself with one draft only: two are forced here, on either device)
        runner.spec.defer = scheduler.core.plan_ahead = True
        scheduler._max_inflight = 2
        counts = count_step_graphs(runner.spec.graphs)
        if plain is not None:
            reqs = [TokenizedRequest(rid=str(i), prompt_ids=np.asarray(p, dtype=np.int32), sampling=params)
                    for i, p in enumerate(prompts)]
            runner.spec.device_draft_hook = device_oracle({str(i): t for i, t in enumerate(plain)}, reqs,
                                                          runner.device, corrupt)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counts.update(drafted=scheduler.core.spec_draft_tokens, accepted=scheduler.core.spec_accepted_tokens)
    return [o.outputs[0].token_ids for o in got], counts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_planned_ahead_through_the_actors_give_the_plain_greedy_tokens(model_dir: Path, device: str) -> None:
    """The worker launches a step planned ahead while the one before is in flight, finishes them in order on its
    runner's thread and sends each result once: plain decoding's greedy tokens, with the MTP layer's own drafts and
    with forced ones."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [r.prompt_ids.tolist() for r in requests()[:5]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), kv_cache_blocks=128, block_size=4, device=device, dtype="float32") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    for forced, corrupt in ((None, False), (plain, True), (plain, False)):
        got, counts = generate_planned_ahead(model_dir, prompts, params, device, forced, corrupt)
        assert got == plain
        assert counts["chained"] >= 3, counts
        if forced is not None and not corrupt:  # every draft forced, the prefill's first ones too: all accepted
            assert counts["accepted"] == counts["drafted"] > 0, counts


def test_speculating_steps_are_sent_without_a_second_trip_through_the_runner_thread(model_dir: Path) -> None:
    """A speculating step finishes at launch (its tokens are on the host when the launch returns): the worker sends
    its result from the event loop (ModelRunner.oldest_finished), not through another round trip to the runner's
    thread, which would add to every step's turnaround (the steps run one at a time)."""
    import threading

    prompts = [r.prompt_ids.tolist() for r in requests()[:2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), kv_cache_blocks=128, block_size=4, placement="inline",
             speculative_config={"method": "mtp", "num_speculative_tokens": 1}) as llm:  # fmt: skip
        worker = llm.client.runtime.actors["worker/0"]
        runner = worker.runner
        threads, launches, finish, launch = [], [], runner.finish_oldest, runner.launch
        runner.finish_oldest = lambda: threads.append(threading.current_thread()) or finish()
        runner.launch = lambda *a, **kw: launches.append(threading.current_thread()) or launch(*a, **kw)
        sent_early, send_published = [], worker._send_published
        worker._send_published = lambda result: sent_early.append(result.step) or send_published(result)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert launches and len(threads) == len(launches)
    assert set(launches).isdisjoint(threads)  # launched on the runner's thread, finished on the event loop's
    # the steps of decodes went out before their drafting (MTPSpeculator.publish), once each, and every token came
    assert len(sent_early) >= 4 and len(set(sent_early)) == len(sent_early) and not worker._published
    assert [len(o.outputs[0].token_ids) for o in got] == [8, 8]


def test_a_step_that_fails_after_its_result_went_out_takes_the_engine_down(model_dir: Path, caplog) -> None:
    """Drafting that fails once its step's tokens were sent leaves drafts (and a hybrid model's states) unknown: the
    worker stops, and the request ends with the engine's error instead of decoding on from a broken state."""
    import logging

    from flotilla.server.engine_client import EngineDeadError

    prompts = [r.prompt_ids.tolist() for r in requests()[:2]]
    with caplog.at_level(logging.INFO), LLM(str(model_dir), kv_cache_blocks=128, block_size=4, placement="inline",
                                            speculative_config={"method": "mtp", "num_speculative_tokens": 1}) as llm:
        spec = llm.client.runtime.actors["worker/0"].runner.spec
        publish, draft, sent = spec.publish, spec._draft, []
        spec.publish = lambda result: sent.append(result.step) or publish(result)

        def broken(*a, **kw):
            if sent:
                raise RuntimeError("drafting broke")
            return draft(*a, **kw)

        spec._draft = broken
        with pytest.raises(EngineDeadError, match="worker/0"):
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert sent and f"step {sent[0]} failed after its result was sent; stopping" in caplog.text


TP_PROMPTS = [r.prompt_ids.tolist() for r in requests()[:4]]
TP_PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 2 + \
    [SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
     SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)]
TP_SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def tp_tokens(model_dir: Path, **kw) -> list[list[int]]:
    """TP_PROMPTS' tokens from an LLM with options `kw` (and the tensor-parallel tests' common ones)."""
    with LLM(str(model_dir), kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, **kw) as llm:
        # the unseeded request alone, after the others: which steps it shares (and so the engine generator's
        # draws before its own) must not depend on when the requests reached the scheduler
        out = llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS[:3]], TP_PARAMS[:3], use_tqdm=False)
        out += llm.generate([{"prompt_token_ids": TP_PROMPTS[3]}], TP_PARAMS[3:], use_tqdm=False)
        deadline = time.monotonic() + 10  # the scheduler's stats follow its steps asynchronously
        while "speculative_config" in kw and time.monotonic() < deadline and (
                llm.client.stats is None or not llm.client.stats.spec_draft_tokens):
            time.sleep(0.05)
        if "speculative_config" in kw:
            assert llm.client.stats.spec_draft_tokens > 0  # drafts really were verified
    return [o.outputs[0].token_ids for o in out]


@pytest.fixture(scope="module")
def one_rank_tokens(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """TP_PROMPTS' tokens at TP=1: plain decoding's, and speculation's."""
    return tp_tokens(model_dir), tp_tokens(model_dir, speculative_config=TP_SPEC)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_speculation_under_tensor_parallelism_gives_one_ranks_tokens(model_dir: Path, one_rank_tokens: tuple,
                                                                    expert_parallel: bool) -> None:
    """TP=2 (and TP=2 with the experts spread over the two ranks): every rank runs the main model and the MTP layer
    on its share and rank 0 samples the verify steps for both. Greedy and seeded requests get plain TP=1 decoding's
    tokens; an unseeded sampled one gets what speculation at TP=1 samples (rank 0 draws what the lone rank draws).
    (Rank 1 taking rank 0's tokens is not observable here: both ranks' samplers start from the same seed and see
    the same gathered logits, so they would draw alike; the broadcast keeps them together when anything differs.)"""
    plain, one_rank = one_rank_tokens
    got = tp_tokens(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                    speculative_config=TP_SPEC, placement="process")
    assert got[:3] == plain[:3] == one_rank[:3]
    assert got[3] == one_rank[3]


def test_speculating_block_manager_recomputes_a_hits_last_block() -> None:
    """The MTP layer's KV at a block's last position was written with the token after it: another sequence
    sharing the block may continue differently, so under speculation that block is recomputed, not shared."""
    tokens = list(range(10, 27))  # 4 full blocks of 4, and one token
    for recompute, hit in ((False, 16), (True, 12)):
        blocks = BlockManager(32, 4, recompute_last_hit=recompute)
        blocks.allocate("a", tokens)
        blocks.commit("a", tokens, len(tokens))
        assert blocks.match_prefix(tokens).num_cached_tokens == hit
        alloc = blocks.allocate("b", tokens)
        assert alloc.num_cached_tokens == hit
        blocks.commit("b", tokens, len(tokens))
        shares_last = blocks.block_ids("b")[3] == blocks.block_ids("a")[3]
        assert shares_last != recompute
        blocks.check_invariants()


def test_metrics_count_draft_and_accepted_tokens() -> None:
    metrics = ServerMetrics("m")

    def stats(drafts: int, accepted: int) -> SchedulerStatsEvent:
        return SchedulerStatsEvent(num_running=0, num_waiting=0, kv_usage=0.0, prefix_cache_hit_rate=0.0,
                                   num_preemptions=0, kv_capacity_tokens=1, spec_draft_tokens=drafts,
                                   spec_accepted_tokens=accepted)
    metrics.render(stats(10, 4))
    text = metrics.render(stats(30, 9)).decode()  # totals since start: the counters grow by the difference
    assert 'flotilla_spec_decode_draft_tokens_total{model_name="m"} 30.0' in text
    assert 'flotilla_spec_decode_accepted_tokens_total{model_name="m"} 9.0' in text


@needs("openai", "the test talks to the server through the real openai client")
def test_serve_takes_vllms_speculative_config_flag_and_exports_acceptance(model_dir: Path) -> None:
    server = start_server(str(model_dir), "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
                          "--kv-cache-blocks", "128", "--block-size", "4", "--device", "cpu", "--dtype", "float32",
                          "--single-process", timeout=120)  # (the flag's path does not depend on the placement)
    try:
        import openai  # here, not at the top: the GPU machine's bundle has no openai, and its tests run this file

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(model=model_dir.name, prompt=[5, 9, 200, 31, 77], max_tokens=10,
                                        temperature=0)
        assert out.usage.completion_tokens == 10
        deadline = time.monotonic() + 10
        while True:  # the scheduler's stats reach the front end beside the tokens, not before them
            text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
            drafts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("flotilla_spec_decode_draft_tokens_total{")]
            if (drafts and drafts[0] > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert drafts and drafts[0] > 0
        assert "flotilla_spec_decode_accepted_tokens_total{" in text
    finally:
        server.stop()


@needs("openai", "the test talks to the server through the real openai client")
def test_speculation_on_a_disaggregated_decode_engine_gives_the_colocated_plain_tokens(model_dir: Path) -> None:
    """1P1D (torch_dist KV moves, the MTP layer's cache layer with the others) with MTP on both engines: the decode
    engine verifies drafts and every request, chat and completion, streamed or not, gets what a colocated engine
    without speculation gives."""
    import helpers_pd as pdh

    common = ["--block-size", "4", "--kv-cache-blocks", "200", "--max-num-seqs", "16"]
    pd_args = ("--engines", "prefill,decode", "--kv-transfer-backend", "torch_dist", "--speculative-config",
               '{"method": "mtp", "num_speculative_tokens": 2}', *common)
    colocated, pd = start_servers(((str(model_dir), "--single-process", *common), {"timeout": 180}),
                                  ((str(model_dir), *pd_args), {"timeout": 180}))  # (both start at once)
    try:
        try:
            reqs = pdh.requests(12, offset=5)
            assert pdh.run_all(pd.url, reqs) == pdh.run_all(colocated.url, reqs)
            deadline = time.monotonic() + 10
            while (m := pdh.metrics(pd.url)) and time.monotonic() < deadline and not any(
                    k.startswith("flotilla_spec_decode_draft_tokens_total") and v > 0 for k, v in m.items()):
                time.sleep(0.1)  # the decode engine's stats follow its steps
            assert any(k.startswith("flotilla_spec_decode_draft_tokens_total") and v > 0 for k, v in m.items())
            assert pdh.engine_metric(m, "flotilla_kv_migration_bytes_total", "decode-0") > 0
        finally:
            assert pd.stop() == 0, "".join(pd.log[-30:])
    finally:
        colocated.stop()


DP_PROMPTS = [{"prompt_token_ids": r.prompt_ids.tolist()} for r in requests()[:5]]
DP_OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def dp_plain(model_dir: Path) -> list:
    """Plain decoding's greedy outputs of DP_PROMPTS on one engine."""
    from helpers_parallel import generate_within

    with LLM(str(model_dir), **DP_OPTIONS, placement="inline") as llm:
        return generate_within(llm, DP_PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), 120)


@pytest.mark.parametrize("all2all", ["all_to_all", "allgather_reducescatter"])
def test_speculation_under_data_parallel_expert_parallelism_gives_plain_tokens(model_dir: Path, dp_plain: list,
                                                                              all2all: str) -> None:
    """DP2 x EP2: each data-parallel rank speculates on its own requests, and every step runs the MTP layer's
    all-to-alls num_speculative_tokens times on both ranks (empty passes where a rank has fewer drafts to make, and
    an idle rank's empty step runs them too), so the ranks' collectives pair up: greedy tokens are plain decoding's,
    with both ranks busy and then with one idle; under either all2all backend (the all-gather's rows, agreed once
    per step, hold every pass of it)."""
    from helpers_parallel import generate_within

    prompts, want = DP_PROMPTS, dp_plain
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(str(model_dir), **DP_OPTIONS, data_parallel_size=2, enable_expert_parallel=True, speculative_config=spec,
             all2all_backend=all2all, placement="process") as llm:  # fmt: skip
        assert generate_within(llm, prompts[:4], greedy, 120) == want[:4]  # both data-parallel ranks busy
        assert llm.client.coordinator.assigned == [2, 2]
        assert generate_within(llm, prompts[4:], greedy, 60) == want[4:]  # one rank idle, running empty steps


@pytest.mark.gpu
def test_bench_mtp_on_cuda_forces_drafts_on_the_device_when_steps_run_ahead(model_dir: Path, tmp_path: Path) -> None:
    """On CUDA (step graphs, steps planned ahead with one draft) bench_mtp forces its drafts where the device makes
    them: every one accepted, the output plain decoding's; with two drafts, or with --max-steps-in-flight 1, the
    host forces them, as before."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flotilla.scripts.dev import bench_mtp

    for steps in (None, 1):
        out = tmp_path / f"mtp-{steps}.json"
        assert bench_mtp.main(["--model", str(model_dir), "--num-speculative-tokens", "1,2", "--decode-in", "12",
                               "--decode-out", "24", "--vocab", str(VOCAB), "--device", "cuda", "--dtype", "float32",
                               "--kv-cache-blocks", "200", "--json", str(out)]
                              + ([] if steps is None else ["--max-steps-in-flight", str(steps)])) == 0
        for rec in json.loads(out.read_text())["mtp"]:
            ahead = steps is None and rec["num_speculative_tokens"] == 1
            assert rec["steps_ahead"] is ahead and rec["cuda_graphs"]
            assert rec["acceptance_rate"] == 1.0 and rec["first_difference"] is None
            assert (rec["chained_steps"] > 0) is ahead, rec


def test_bench_mtp_at_forced_acceptance_gives_n_plus_one_tokens_per_verify_step(model_dir: Path,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """scripts/dev/bench_mtp.py at toy size: every forced draft is accepted, so a verify step yields about N + 1
    tokens (fewer only where max_tokens cuts the last drafts), and the output stayed plain decoding's."""
    from flotilla.scripts.dev import bench_mtp

    out = tmp_path / "mtp.json"
    assert bench_mtp.main(["--model", str(model_dir), "--num-speculative-tokens", "1,2", "--decode-in", "12",
                           "--decode-out", "24", "--vocab", str(VOCAB), "--device", "cpu", "--dtype", "float32",
                           "--kv-cache-blocks", "200", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["plain_tok_per_s"] > 0
    for rec, n in zip(result["mtp"], (1, 2), strict=True):
        assert rec["num_speculative_tokens"] == n and rec["acceptance_rate"] == 1.0 and rec["first_difference"] is None
        assert n + 1 - 0.25 <= rec["tokens_per_verify_step"] <= n + 1
        assert rec["speedup"] > 0
        # every step of the timed run was timed: its prefill and its verify steps (23 tokens after the first)
        assert rec["steps"] == 1 + round(23 / rec["tokens_per_verify_step"])
        assert rec["step_in_worker_ms"] > 0 and rec["step_wall_ms"] > 0  # (how they compare is timing: not asserted)
        assert rec["step_outside_worker_ms"] == pytest.approx(rec["step_wall_ms"] - rec["step_in_worker_ms"], abs=2e-3)


def test_bench_mtps_oracle_leaves_a_departed_sequence_its_own_drafts() -> None:
    """Where a verify step's rounding flips a token (bfloat16 on a GPU), the oracle has nothing to force: the
    model's drafts go on, and the record's first_difference says where the outputs parted."""
    from flotilla.scripts.dev.bench_mtp import first_difference, oracle

    hook, asked = oracle([1, 2], [3, 4, 5]), []

    def drafts(d: list[int]):
        return lambda: asked.append(d) or d

    assert hook(np.array([1, 2]), 2, drafts([9, 9])) == [3, 4]
    assert not asked  # forced without the model's drafts: the step need not wait for them
    assert hook(np.array([1, 2, 3, 4]), 2, drafts([9, 9])) == [5, 9]  # past the known tokens: the model's drafts
    assert hook(np.array([1, 2, 7]), 2, drafts([9, 8])) == [9, 8]  # left plain decoding's path
    assert asked == [[9, 9], [9, 8]]
    assert first_difference([3, 4, 5], [3, 4, 5]) is None
    assert first_difference([3, 6, 5], [3, 4, 5]) == 1
    assert first_difference([3, 4], [3, 4, 5]) == 2
