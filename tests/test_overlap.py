"""The overlapped step loop: the real ModelRunner launching step N+1 before step N's tokens reached the host.

The scheduler plans ahead (max_steps_in_flight > 1) and the runner launches each plan at once, feeding
tokens it has not settled on the host yet from the previous step's device tensor. Whatever the depth,
every request must get exactly the tokens (and logprobs) of the plain one-step-at-a-time loop: greedy,
seeded sampling, penalties (which make the runner settle pending steps first), chunked prefill and
preemption included.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest

from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.actors.model_runner import ModelRunner
from flotilla.actors.pending_step import PendingStep
from flotilla.config import EngineConfig, SchedulerConfig
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import TokenizedRequest

from helpers_tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def runner_factory(tmp_path_factory):
    model_dir = write_tiny_model(Path(tmp_path_factory.mktemp("overlap")) / "m", "qwen3")

    def make(num_blocks: int) -> ModelRunner:
        config = EngineConfig.from_options(model=str(model_dir), device="cpu", dtype="float32",
                                           kv_cache_blocks=num_blocks, block_size=4)
        return ModelRunner(config, progress=False)
    return make


@pytest.fixture(scope="module")
def cuda_runner_factory(tmp_path_factory):
    """The CUDA path: flashinfer attention, CUDA-graph decodes, tokens copied back behind events."""
    model_dir = write_tiny_model(Path(tmp_path_factory.mktemp("overlap-cuda")) / "m", "qwen3_hd64")

    def make(num_blocks: int) -> ModelRunner:
        config = EngineConfig.from_options(model=str(model_dir), device="cuda", dtype="bfloat16",
                                           kv_cache_blocks=num_blocks, block_size=4, max_num_seqs=8)
        return ModelRunner(config, progress=False)
    return make


def requests() -> list[TokenizedRequest]:
    rng = np.random.default_rng(7)
    kinds = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, top_k=20, seed=3, presence_penalty=0.4, ignore_eos=True),
    ]
    return [TokenizedRequest(rid=f"r{i}", prompt_ids=rng.integers(4, 300, int(rng.integers(3, 40))).astype(np.int32),
                             eos_token_ids=[2], sampling=kinds[i % len(kinds)]) for i in range(12)]


def run(runner: ModelRunner, depth: int, budget: int) -> tuple[dict, dict, int]:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_steps_in_flight=depth)
    blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True)
    sched = BatchScheduler(cfg, blocks, max_model_len=256)
    for req in requests():
        assert sched.add(req)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    launched: deque[int] = deque()
    for _ in range(10_000):
        while len(launched) < depth and (plan := sched.schedule()) is not None:
            runner.launch(plan)  # launched at once, like the worker actor does
            launched.append(plan.step)
        if not launched:
            break
        result = runner.finish_oldest()
        assert result.step == launched.popleft() and result.error is None
        for d in sched.update(result):
            tokens.setdefault(d.rid, []).extend(d.token_ids)
            if d.logprobs is not None:
                logprobs.setdefault(d.rid, []).extend(d.logprobs)
    assert not sched.seqs and runner.num_pending == 0
    return tokens, logprobs, sched.num_preemptions


@pytest.mark.parametrize("num_blocks,budget", [(200, 48), (14, 16)])
def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(runner_factory, num_blocks, budget):
    want_tokens, want_logprobs, _ = run(runner_factory(num_blocks), depth=1, budget=budget)
    assert {len(t) for t in want_tokens.values()} >= {8, 12}
    for depth in (2, 3):
        runner = runner_factory(num_blocks)
        got_tokens, got_logprobs, preemptions = run(runner, depth=depth, budget=budget)
        assert got_tokens == want_tokens, depth
        assert got_logprobs.keys() == want_logprobs.keys()
        for rid in want_logprobs:
            np.testing.assert_allclose(got_logprobs[rid], want_logprobs[rid], rtol=1e-5, atol=1e-6)
        if num_blocks == 14:
            assert preemptions > 0  # the tiny cache forced recomputation with steps pending


@pytest.mark.gpu
def test_overlapped_steps_on_cuda_with_graphs_give_the_tokens_of_one_step_at_a_time(cuda_runner_factory):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = cuda_runner_factory(200)
    assert runner.graphs is not None
    want_tokens, _, _ = run(runner, depth=1, budget=48)
    for depth in (2, 3):
        got_tokens, _, _ = run(cuda_runner_factory(200), depth=depth, budget=48)
        assert got_tokens == want_tokens, depth


@pytest.mark.gpu
def test_launching_a_graph_decode_step_does_not_wait_for_the_device(cuda_runner_factory):
    """The host must be able to run ahead: while the device is still busy (a long sleep kernel queued on its
    stream), launching the next decode step (page tables, FlashInfer plan, graph replay, sampling, the copy
    back) returns without waiting for it. A blocking copy anywhere in the launch (as FlashInfer's plan() makes
    of host page indices) would return only after the sleep."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = cuda_runner_factory(200)
    assert runner.graphs is not None
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=8, max_steps_in_flight=2),
                           BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False),
                           max_model_len=256)
    for req in requests()[:4]:
        sched.add(req)
    for _ in range(3):  # the prompts, then two decode steps: every graph path warmed up
        runner.launch(sched.schedule())
        sched.update(runner.finish_oldest())
    plan = sched.schedule()
    assert len(plan.rids) == sum(plan.num_new_tokens.tolist()) == 4  # a pure decode step: the graph path
    torch.cuda._sleep(2_000_000_000)  # 2e9 cycles: about a second of device time at a datacenter GPU's clock
    busy = torch.cuda.Event()
    busy.record()
    runner.launch(plan)
    still_busy = not busy.query()
    result = runner.finish_oldest()
    assert still_busy, "launching the step waited for the device"
    assert result.error is None and len(result.token_ids) == 4


def test_a_step_that_feeds_unsettled_tokens_really_reads_them_from_the_device(runner_factory):
    runner = runner_factory(64)
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=4, max_steps_in_flight=2),
                           BlockManager(64, 4, enable_prefix_caching=False), max_model_len=256)
    sched.add(requests()[0])
    first = sched.schedule()
    runner.launch(first)
    second = sched.schedule()  # the decode of the token step `first` sampled
    seq = runner.seqs["r0"]
    assert seq.host_length == seq.length - 1 and seq.length - 1 in seq.device_tokens
    runner.launch(second)
    a, b = runner.finish_oldest(), runner.finish_oldest()
    assert (a.step, b.step) == (first.step, second.step)
    assert seq.host_length == seq.length and not seq.device_tokens
    assert seq.tokens[-2:].tolist() == [int(a.token_ids[0]), int(b.token_ids[0])]


def test_decode_steps_of_the_same_sequences_reuse_their_sampling_options(runner_factory):
    runner = runner_factory(64)
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=4, max_steps_in_flight=1),
                           BlockManager(64, 4, enable_prefix_caching=False), max_model_len=256)
    plain = [r for r in requests() if r.sampling.seed is None and r.sampling.repetition_penalty == 1.0
             and r.sampling.presence_penalty == 0.0 and r.sampling.frequency_penalty == 0.0][:2]
    for req in plain:
        sched.add(req)
    seen = []
    for _ in range(4):  # the prompts, then three decode steps of the same two sequences
        runner.launch(sched.schedule())
        sched.update(runner.finish_oldest())
        seen.append(runner._st_cache[1])
    assert seen[1] is seen[2] is seen[3]
    seeded = next(r for r in requests() if r.sampling.seed is not None)
    sched.add(seeded)
    runner.launch(sched.schedule())  # a seeded row hashes its generation index: nothing to reuse
    sched.update(runner.finish_oldest())
    assert runner._st_cache is None


def test_settling_the_pending_steps_while_the_loop_thread_sends_the_finished_oldest(runner_factory, monkeypatch):
    """A grammar or penalties make the runner's thread finish every pending step before it samples; the worker's
    loop thread meanwhile sends (pops) the oldest as soon as it is finished. Neither may break the other (the
    runner's thread iterated the queue the loop thread popped: 'deque mutated during iteration', and every request
    of a batch under structured outputs ended in an error)."""
    runner = runner_factory(64)
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=4, max_steps_in_flight=3),
                           BlockManager(64, 4, enable_prefix_caching=False), max_model_len=256)
    sched.add(requests()[0])
    plans = []
    for _ in range(3):
        plans.append(sched.schedule())
        runner.launch(plans[-1])
    oldest, sent = runner._pending[0], []
    finish = PendingStep.finish

    def finish_then_sent(self: PendingStep):
        result = finish(self)
        if self is oldest and runner._pending[0] is oldest:  # the loop thread finds the oldest finished now
            sent.append(runner.finish_oldest())
        return result

    monkeypatch.setattr(PendingStep, "finish", finish_then_sent)
    runner._drain()
    rest = [runner.finish_oldest(), runner.finish_oldest()]
    assert [r.step for r in sent + rest] == [p.step for p in plans]
    assert all(r.error is None and len(r.token_ids) == 1 for r in sent + rest)
    seq = runner.seqs["r0"]
    assert seq.host_length == seq.length and not seq.device_tokens
