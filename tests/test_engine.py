"""The engine end to end through the offline LLM API: real actors, real sockets, tiny random models."""

from __future__ import annotations

import asyncio
import logging
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.server.engine_client import RequestFailed
from flotilla.transport.messages import GenerateRequest

from helpers_engine import write_tiny_engine_model
from helpers_tiny_models import load_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_engine_model(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny, kv_cache_blocks=512, block_size=4)
    yield engine
    engine.shutdown()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run(engine: LLM, ps: list[list[int]], max_tokens: int | list[int] = 12, **sp) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, **{**GREEDY, **sp})
              for m in (max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ps))]
    outs = engine.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def scheduler(engine: LLM):
    return engine.client.runtime.actors["scheduler/0"].core


def test_greedy_tokens_match_transformers(tiny, llm):
    hf = load_hf_model(tiny)
    ps = prompts(4, seed=1)
    got = run(llm, ps, max_tokens=16)
    for p, g in zip(ps, got):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0, len(p):].tolist()
        assert g == ref


def test_64_concurrent_requests_each_get_what_they_get_alone(llm):
    ps = prompts(64, seed=2)
    lengths = [random.Random(i).randrange(1, 20) for i in range(64)]
    together = run(llm, ps, lengths)
    alone = [run(llm, [p], m)[0] for p, m in zip(ps, lengths)]
    assert together == alone
    assert [len(t) for t in together] == lengths


def test_preemption_under_a_tiny_kv_budget_keeps_greedy_outputs(tiny, llm):
    ps = prompts(8, seed=3, lo=18, hi=24)
    want = run(llm, ps, max_tokens=20)
    with LLM(tiny, kv_cache_blocks=24, block_size=4, enable_prefix_caching=False) as small:
        got = run(small, ps, max_tokens=20)
        core = scheduler(small)
        assert core.num_preemptions > 0
        assert core.blocks.num_free_blocks == 24
    assert got == want


def test_chunked_prefill_equals_unchunked(tiny, llm):
    ps = prompts(3, seed=4, lo=90, hi=120)
    want = run(llm, ps)
    with LLM(tiny, kv_cache_blocks=512, block_size=4, max_num_batched_tokens=16) as chunked:
        assert run(chunked, ps) == want
    with LLM(tiny, kv_cache_blocks=512, block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=128) as whole:
        assert run(whole, ps) == want


def test_prefix_caching_hits_on_a_shared_system_prompt_and_changes_nothing(tiny, llm):
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    convs = [[system, {"role": "user", "content": q}] for q in ("What is the capital of France?", "Jump, fox!")]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    first = llm.chat(convs[0], sp, use_tqdm=False)[0]
    second = llm.chat(convs[1], sp, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 32  # the system prompt's full blocks came from the cache
    with LLM(tiny, kv_cache_blocks=512, block_size=4, enable_prefix_caching=False) as cold:
        ref = cold.chat(convs, sp, use_tqdm=False)
        assert all(r.num_cached_tokens == 0 for r in ref)
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [r.outputs[0].token_ids for r in ref]
    assert scheduler(llm).blocks.prefix_cache_hit_rate > 0


def test_aborting_half_the_requests_mid_run_frees_every_block(llm):
    client = llm.client
    core = scheduler(llm)
    total = core.blocks.num_blocks

    async def main():
        reqs = [GenerateRequest(rid=client.new_rid("abort"), prompt_token_ids=np.asarray(p, np.int32),
                                sampling=SamplingParams(max_tokens=40, **GREEDY)) for p in prompts(16, seed=5)]

        async def consume(req, abort_after):
            n = 0
            stream = client.stream(req)
            async for delta in stream:
                n += len(delta.token_ids)
                if abort_after and n >= abort_after:
                    await stream.aclose()  # the consumer goes away: the client aborts the request
                    return n
            return n

        return await asyncio.gather(*(consume(r, 3 if i % 2 else 0) for i, r in enumerate(reqs)))

    counts = llm._run(main())
    assert [c for i, c in enumerate(counts) if i % 2 == 0] == [40] * 8
    assert all(c < 40 for i, c in enumerate(counts) if i % 2)

    async def settle():
        for _ in range(200):
            if not core.seqs and core.blocks.num_free_blocks == total:
                return
            await asyncio.sleep(0.01)

    llm._run(settle())
    assert not core.seqs and not core.running
    assert core.blocks.num_free_blocks == total


def test_one_process_per_actor_gives_the_same_outputs(tiny, llm):
    ps = prompts(6, seed=6)
    with LLM(tiny, kv_cache_blocks=512, block_size=4, placement="process") as multi:
        assert run(multi, ps) == run(llm, ps)


def test_sampling_seeds_stops_and_logprobs(llm):
    p = {"prompt_token_ids": prompts(1, seed=7)[0]}
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([{"prompt_token_ids": q} for q in prompts(5, seed=8)] + [p],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [seeded], use_tqdm=False)
    assert crowd[-1].outputs[0].token_ids == alone
    two = llm.generate([p], SamplingParams(temperature=1.0, seed=42, n=2, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids == alone and two.outputs[1].token_ids != alone
    # seeds 42 and 43 share no choice's stream (a choice seeded seed + i would: 42's second is 43's first)
    next_seed = llm.generate([p], SamplingParams(temperature=1.0, seed=43, n=2, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0]
    assert not {tuple(o.token_ids) for o in two.outputs} & {tuple(o.token_ids) for o in next_seed.outputs}
    lp = llm.generate([p], SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert len(lp.logprobs) == 5
    for tok, entry in zip(lp.token_ids, lp.logprobs):
        assert len(entry.top) == 3 and max(entry.top, key=entry.top.get) == tok  # greedy = the top token
        assert entry.logprob == pytest.approx(entry.top[tok])
    # a stop string ends the text before it; the tokens up to it are still reported
    full = llm.generate(["The quick brown"], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop = full.text[4:7]
    cut = llm.generate(["The quick brown"], SamplingParams(max_tokens=20, stop=[stop], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]


def test_requests_that_cannot_run_fail_clearly_and_the_engine_keeps_serving(llm):
    with pytest.raises(RequestFailed, match="maximum context length is 256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(RequestFailed, match="max_tokens|requested"):
        llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=250), use_tqdm=False)
    with pytest.raises(RequestFailed, match="token ids"):
        llm.generate([{"prompt_token_ids": [5, 10_000]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(run(llm, prompts(2, seed=9))[0]) == 12


def test_a_kv_cache_smaller_than_max_model_len_ends_sequences_when_full_and_refuses_longer_prompts(tiny, caplog):
    """16 KV tokens (4 blocks of 4) under max_model_len 256: a sequence that reaches the cache's size can never be
    scheduled again, so it ends there ("length") instead of waiting for good, and the ready line says so; a prompt
    that fills the cache is refused with a 400-style error, and the engine keeps serving."""
    with caplog.at_level(logging.INFO, logger="flotilla"), LLM(tiny, kv_cache_blocks=4, block_size=4) as small:
        (ready,) = [r.getMessage() for r in caplog.records if r.name == "flotilla.llm"]
        assert " max_model_len=256 (sequences end at 16: the KV cache holds 16 tokens) max_num_seqs=" in ready, ready
        (out,) = small.generate([{"prompt_token_ids": list(range(5, 11))}],
                                SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)  # fmt: skip
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 16 - 6
        refused = "at most 16 tokens .the KV cache holds 16 tokens.*prompt has 30 tokens"
        with pytest.raises(RequestFailed, match=refused):
            small.generate([{"prompt_token_ids": list(range(5, 35))}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(run(small, [[5, 6, 7]], max_tokens=4)[0]) == 4
        assert scheduler(small).blocks.num_free_blocks == 4


def test_without_chunked_prefill_a_prompt_beyond_the_step_budget_is_refused_not_left_waiting(tiny, caplog):
    """Without chunked prefill a prompt runs whole in one step of at most max_num_batched_tokens, and so does any
    recompute after preemption: a longer one would wait for good. The engine's max_model_len comes down to the budget."""
    with caplog.at_level(logging.INFO, logger="flotilla"), \
            LLM(tiny, kv_cache_blocks=64, block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=16) as llm:
        (ready,) = [r.getMessage() for r in caplog.records if r.name == "flotilla.llm"]
        assert "max_model_len=256 (sequences end at 16: without chunked prefill a step takes 16 tokens)" in ready, ready
        with pytest.raises(RequestFailed, match="at most 16 tokens .without chunked prefill a step takes 16 tokens"):
            llm.generate([{"prompt_token_ids": list(range(5, 35))}], SamplingParams(max_tokens=4), use_tqdm=False)
        (out,) = llm.generate([{"prompt_token_ids": list(range(5, 15))}],
                              SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)  # fmt: skip
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 16 - 10


def test_penalties_reach_the_sampler_through_the_worker(llm):
    p = [{"prompt_token_ids": prompts(1, seed=10, lo=20, hi=21)[0]}]
    plain = llm.generate(p, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    penal = llm.generate(p, SamplingParams(max_tokens=24, repetition_penalty=3.0, frequency_penalty=2.0,
                                           presence_penalty=2.0, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    assert len(penal) == 24 and penal != plain
    assert len(set(penal)) >= len(set(plain))  # penalising repeats never makes the output more repetitive here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_on_cuda_gives_the_cpu_greedy_tokens(tiny, llm):
    ps = prompts(8, seed=11)
    with LLM(tiny, kv_cache_blocks=512, block_size=4, device="cuda", max_num_seqs=16) as gpu:
        assert run(gpu, ps, max_tokens=16) == run(llm, ps, max_tokens=16)
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
        p = [{"prompt_token_ids": ps[0]}]
        # seeded noise is bit-identical on CPU and CUDA, so even sampled tokens agree
        assert gpu.generate(p, seeded, use_tqdm=False)[0].outputs[0].token_ids == \
            llm.generate(p, seeded, use_tqdm=False)[0].outputs[0].token_ids


def test_priority_policy_runs_lower_priority_values_first(tiny):
    order: list[str] = []
    with LLM(tiny, kv_cache_blocks=256, block_size=4, max_num_seqs=1, policy="priority") as engine:
        client = engine.client

        async def main():
            async def one(name, prio, max_tokens):
                req = GenerateRequest(rid=client.new_rid(name), prompt_token_ids=np.asarray(prompts(1, seed=12)[0], np.int32),
                                      sampling=SamplingParams(max_tokens=max_tokens, **GREEDY), priority=prio)
                async for d in client.stream(req):
                    if d.finish_reason:
                        order.append(name)

            # "first" runs alone for 16 steps while the others queue; then they run lowest value first
            await asyncio.gather(one("first", -1, 16), one("low", 5, 2), one("high", 0, 2), one("mid", 2, 2))

        engine._run(main())
    assert order == ["first", "high", "mid", "low"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_and_torch_attention_give_the_same_greedy_tokens_on_cuda(tmp_path):
    pytest.importorskip("flashinfer")
    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    ps = prompts(8, seed=13)
    outs = {}
    for backend in ("flashinfer", "torch"):
        with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 attention_backend=backend) as engine:
            assert engine.client.ready_detail["worker/0"]["attention"] == backend
            outs[backend] = run(engine, ps, max_tokens=8)
    assert outs["flashinfer"] == outs["torch"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [None, 4])
def test_flashinfer_prefill_with_triton_decode_gives_flashinfers_greedy_tokens_on_cuda(tmp_path, monkeypatch, split):
    """attention_backend "flashinfer_triton" (FlashInfer's prefill, triton's decode in static-table graphs) against
    flashinfer alone, CUDA graphs on for both; with the split lowered to 4 sequences, the 12-sequence batches replay
    graphs that decode with FlashInfer (planned per step) and the smaller ones graphs over triton's static tables."""
    pytest.importorskip("flashinfer")
    import flotilla.kernels.attention as attention

    if split is not None:
        monkeypatch.setattr(attention, "FLASHINFER_DECODE_ABOVE", split)
    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    ps = prompts(12, seed=17)
    outs = {}
    for backend in ("flashinfer", "flashinfer_triton"):
        with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 attention_backend=backend, placement="inline") as engine:
            assert engine.client.ready_detail["worker/0"]["attention"] == backend
            graphs = engine.client.runtime.actors["worker/0"].runner.graphs
            assert graphs is not None
            if backend == "flashinfer_triton":
                assert graphs.planned_sizes == ({8, 16} if split == 4 else set())
            outs[backend] = run(engine, ps, max_tokens=10)
            outs[backend + "_one_by_one"] = [run(engine, [p], max_tokens=6)[0] for p in ps[:2]]  # batch-1 graphs
    assert outs["flashinfer_triton"] == outs["flashinfer"]
    assert outs["flashinfer_triton_one_by_one"] == outs["flashinfer_one_by_one"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_gives_the_eager_tokens(tmp_path):
    pytest.importorskip("flashinfer")
    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    ps = prompts(12, seed=14)
    lengths = [3 + i for i in range(12)]  # batches shrink step by step: several graph sizes replay
    outs = {}
    for eager in (True, False):
        with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 enforce_eager=eager, placement="inline") as engine:  # inline: the runner is inspected here
            assert (engine.client.runtime.actors["worker/0"].runner.graphs is None) == eager
            outs[eager] = run(engine, ps, max_tokens=lengths)
    assert outs[False] == outs[True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_fused_ops_give_the_torch_ops_greedy_tokens_on_cuda(tmp_path):
    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    ps = prompts(8, seed=15)
    outs = {}
    for ops in ("triton", "torch"):
        with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 fused_ops=ops) as engine:
            assert engine.client.ready_detail["worker/0"]["fused_ops"] == ops
            outs[ops] = run(engine, ps, max_tokens=8)
    first_diff = [(i, next(j for j, (a, b) in enumerate(zip(x, y)) if a != b))
                  for i, (x, y) in enumerate(zip(outs["triton"], outs["torch"])) if x != y]
    assert not first_diff, f"(prompt, first differing output token): {first_diff}"


def test_unknown_fused_ops_are_refused_before_anything_starts(tiny):
    with pytest.raises(Exception, match="fastest"):
        LLM(tiny, kv_cache_blocks=64, block_size=4, fused_ops="fastest")


def test_step_trace_records_every_step_and_summarises_it(tiny, tmp_path):
    from flotilla.actors.step_trace import summarize
    trace = tmp_path / "trace.jsonl"
    with LLM(tiny, kv_cache_blocks=256, block_size=4, max_num_batched_tokens=64, step_trace=str(trace)) as engine:
        run(engine, prompts(6, seed=3, lo=40, hi=60), max_tokens=5)
    rows = [__import__("json").loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    assert all(r["arrived"] <= r["launched"] <= r["done"] for r in rows)
    s = summarize(str(trace))
    # 6 prompts of 40-59 tokens through a 64-token budget: several prompt steps, then decodes of up to 6 rows
    assert s["prefill_or_mixed"]["steps"] >= 4 and s["decode"]["steps"] >= 4
    assert s["prefill_or_mixed"]["tokens"] + s["decode"]["tokens"] == sum(r["tokens"] for r in rows)
    assert s["decode"]["tokens"] == s["decode"]["seqs"]
    assert all(s[kind]["launch_ms_per_step"] > 0 for kind in ("decode", "prefill_or_mixed"))
    # the decode steps by batch size: 6 rows drain to 1 (buckets >=4, >=2, >=1); together no more than all decodes
    buckets = s["decode_by_batch"]
    assert set(buckets) <= {">=4", ">=2", ">=1"} and ">=4" in buckets
    assert sum(b["steps"] for b in buckets.values()) <= s["decode"]["steps"]


def test_a_stopped_inline_engine_drops_its_model_and_kv_cache(tiny):
    """An inline engine's worker lets go of its model and KV cache when it stops, so a second engine in the same
    process finds the device memory free (as bench_mtp's second inline engine needs)."""
    import gc
    import weakref

    with LLM(tiny, kv_cache_blocks=64, block_size=16, placement="inline") as engine:
        runner = engine.client.runtime.actors["worker/0"].runner
        model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
        del runner
        assert run(engine, prompts(2, seed=4), max_tokens=3)
    gc.collect()
    assert engine.client.runtime.actors["worker/0"].runner is None
    assert model() is None and cache() is None
    with LLM(tiny, kv_cache_blocks=64, block_size=16, placement="inline") as again:  # and the next one serves
        assert run(again, prompts(2, seed=4), max_tokens=3)


def test_the_offline_llm_logs_a_ready_line_with_its_kv_capacity(tiny, caplog):
    """As `serve` does (the same words after its address): the model, the KV cache in tokens and blocks, the
    kernels."""
    with caplog.at_level(logging.INFO, logger="flotilla"):
        LLM(tiny, kv_cache_blocks=64, block_size=4, served_model_name="tiny-model").shutdown()
    assert [r.getMessage() for r in caplog.records if r.name == "flotilla.llm"] == [
        "flotilla ready: offline LLM model=tiny-model kv_capacity=256 tokens (64 blocks of 4) max_model_len=256 "
        "max_num_seqs=256 max_num_batched_tokens=8192 device=cpu dtype=float32 kv_dtype=float32 kernels=attention:torch,sampler:torch placement=inline"]


@pytest.mark.slow
def test_with_no_logging_configured_the_offline_llm_logs_on_stderr(tiny):
    """vLLM's offline LLM prints its INFO lines; flotilla's too, unless the application configured logging itself."""
    script = "import logging, sys\n" \
             "if sys.argv[1] == 'configured': logging.basicConfig(level=logging.WARNING)\n" \
             f"from flotilla import LLM\nLLM({tiny!r}, kv_cache_blocks=16, block_size=4).shutdown()\n"
    for how, shown in (("bare", True), ("configured", False)):
        run = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert ("flotilla ready: offline LLM model=llama kv_capacity=64 tokens" in run.stderr) is shown, run.stderr
