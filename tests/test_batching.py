"""The batching policy against a fake worker that checks every KV read: pipelining, preemption, prefix
caching, chunked prefill and aborts must never feed an unknown token or read another sequence's KV."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.config import SchedulerConfig
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import StepPlan, StepResult, TokenizedRequest

from helpers_batching import EOS, VOCAB, FakeWorker, next_token, reference, reference_prompt_scores

def drive(requests, num_blocks: int, depth: int, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
          chunked: bool = True, prefix: bool = True, abort: set[str] = frozenset(), seed: int = 0,
          snapshots: int = 0, score: dict[str, int] | None = None, scored: dict | None = None,
          max_model_len: int = 512, eos: bool = True):
    """snapshots > 0: a hybrid model's worker, whose prefix hits resume recurrent-state snapshots. score: rid ->
    prompt_logprobs; each first delta's prompt logprobs go into `scored`."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          max_steps_in_flight=depth)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, num_state_snapshots=snapshots)
    sched = BatchScheduler(cfg, blocks, max_model_len=max_model_len)
    worker = sched.worker = FakeWorker(num_blocks, block_size, hybrid=snapshots > 0)
    for rid, prompt, max_tokens in requests:
        sched.add(TokenizedRequest(rid=rid, prompt_ids=np.asarray(prompt, np.int32), eos_token_ids=[EOS] if eos else [],
                                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                           prompt_logprobs=(score or {}).get(rid))))
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finished: dict[str, str] = {}
    inflight: deque[StepPlan] = deque()
    for _ in range(20_000):
        while len(inflight) < depth and (plan := sched.schedule()) is not None:
            inflight.append(plan)
        if not inflight:
            break
        for d in sched.update(worker.execute(inflight.popleft())):
            if d.prompt_logprobs is not None:
                assert d.rid not in scored, f"{d.rid}: a second delta with prompt logprobs"
                scored[d.rid] = d.prompt_logprobs
            outputs[d.rid].extend(d.token_ids)
            if d.finish_reason:
                finished[d.rid] = d.finish_reason
        for rid in list(abort):  # abort some requests once they produced a token, at a random moment
            if outputs[rid] and rid not in finished and rng.random() < 0.3:
                d = sched.abort(rid)
                if d is not None:
                    finished[rid] = d.finish_reason
        blocks.check_invariants()
    assert not inflight and not sched.seqs, "every request must end"
    assert blocks.num_free_blocks == num_blocks, "every block must come back"
    return outputs, finished, sched


def workload(n: int = 16, seed: int = 1):
    rng = random.Random(seed)
    system = [rng.randrange(8, VOCAB) for _ in range(13)]  # a shared prefix: prefix-cache hits
    reqs = []
    for i in range(n):
        tail = [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 30))]
        reqs.append((f"r{i}", (system if i % 2 else []) + tail, rng.randrange(1, 25)))
    return reqs


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_blocks,budget,chunked", [(400, 64, True), (24, 16, True), (30, 128, False)])
def test_every_request_gets_its_reference_output(depth, num_blocks, budget, chunked):
    reqs = workload()
    outputs, finished, sched = drive(reqs, num_blocks, depth, budget=budget, chunked=chunked)
    for rid, prompt, max_tokens in reqs:
        want = reference(prompt, max_tokens)
        assert outputs[rid] == want, rid
        assert finished[rid] == ("stop" if want[-1] == EOS else "length")
    if num_blocks == 24:
        assert sched.num_preemptions > 0  # the tiny cache forced recomputation


@pytest.mark.parametrize("num_blocks", [2850, 2900])
def test_a_prompt_whose_rest_cannot_fit_beside_the_running_ones_waits_instead_of_being_preempted_midway(num_blocks):
    """16 prompts of 4,000 tokens, chunks of 1,024, into a cache that holds 11 of them, their outputs and more than a
    chunk besides: the 12th is admitted once its whole prompt fits, so every token is computed once. Admitted by its
    first chunk, it was preempted for lack of blocks before its prefill ended, again and again."""
    rng = random.Random(3)
    reqs = [(f"r{i}", [rng.randrange(8, VOCAB) for _ in range(4000)], 64) for i in range(16)]
    computed = []
    execute = FakeWorker.execute

    def counting(self, plan):
        computed.append(int(plan.num_new_tokens.sum()) if plan.num_new_tokens is not None else 0)
        return execute(self, plan)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeWorker, "execute", counting)
        outputs, _, sched = drive(reqs, num_blocks, depth=3, block_size=16, budget=1024, max_seqs=16, prefix=False,
                                  max_model_len=8192, eos=False)
    assert sched.num_preemptions == 0
    assert sum(computed) == sum(len(prompt) + n - 1 for _, prompt, n in reqs)  # (a last token is never fed back)
    for rid, prompt, n in reqs:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(next_token(tokens))
        assert outputs[rid] == tokens[len(prompt):], rid


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("num_blocks,budget", [(400, 16), (24, 16)])
def test_prompt_logprobs_come_whole_on_the_first_delta_through_chunks_preemption_and_cached_prefixes(
        depth, num_blocks, budget):
    """Each scored sequence gets every prompt token's score but the first's, once, in order, however its prefill
    was chunked, preempted and recomputed, or shared a cached prefix with another (no hit skips a position)."""
    reqs = workload()
    score = {rid: i % 3 for i, (rid, _, _) in enumerate(reqs) if i % 4 != 3}  # k = 0, 1, 2; some not scored
    scored: dict = {}
    outputs, _, sched = drive(reqs, num_blocks, depth, budget=budget, score=score, scored=scored)
    assert set(scored) == set(score)
    for rid, prompt, max_tokens in reqs:
        assert outputs[rid] == reference(prompt, max_tokens)
        if rid not in score:
            continue
        want = reference_prompt_scores(prompt, score[rid])
        got = scored[rid]
        assert got.token_ids == prompt
        assert got.logprobs == [float(np.float32(w[0])) for w in want] and got.ranks == [w[1] for w in want]
        assert got.top_ids == ([w[2] for w in want] if score[rid] else [])
    if num_blocks == 24:
        assert sched.num_preemptions > 0


def test_aborts_at_random_moments_with_steps_in_flight_release_everything():
    reqs = workload(20, seed=3)
    aborted = {rid for rid, _, _ in reqs[::3]}
    outputs, finished, _ = drive(reqs, 60, depth=2, budget=24, abort=aborted, seed=4)
    for rid, prompt, max_tokens in reqs:
        want = reference(prompt, max_tokens)
        if rid in aborted and finished[rid] == "abort":
            assert outputs[rid] == want[:len(outputs[rid])]  # what it produced before the abort is right
        else:
            assert outputs[rid] == want


def test_a_sequences_token_ids_are_its_prompt_then_outputs_however_they_grow():
    from flotilla.actors.batching import Sequence
    seq = Sequence(rid="r", prompt_ids=np.arange(5, dtype=np.int32), sampling=SamplingParams(), stop_ids=frozenset(),
                   priority=0, order=0)
    assert seq.token_ids() is seq.prompt_ids
    views = []
    for tok in range(100, 300):  # past several reallocations of the buffer behind the views
        seq.output_ids.append(tok)
        if tok % 7 == 0:
            views.append((seq.num_tokens, seq.token_ids()))
    for n, view in views:  # earlier views keep showing what they showed
        assert view.tolist() == list(range(5)) + list(range(100, 100 + n - 5))
    assert seq.token_ids().tolist() == list(range(5)) + list(range(100, 300))
    assert not seq.token_ids().flags.writeable


def test_a_sequence_that_stops_with_a_step_in_flight_keeps_its_blocks_until_that_step_is_back():
    """A stop token in step N's result ends a sequence that step N+1, launched already, still computes: the worker
    writes that step's KV into the sequence's blocks, so they must not return to the pool before it is back. On a
    decode engine a KV migration writes a block it was given at once, out of the worker's step order, and the late
    write would then land in the migrated prompt."""
    from flotilla.transport.messages import StepResult

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_steps_in_flight=2)
    blocks = BlockManager(8, 4, enable_prefix_caching=False)
    sched = BatchScheduler(cfg, blocks, max_model_len=64)
    sched.add(TokenizedRequest(rid="a", prompt_ids=np.arange(10, 16, dtype=np.int32), eos_token_ids=[EOS],
                               sampling=SamplingParams(max_tokens=20, temperature=0)))
    first, second = sched.schedule(), sched.schedule()  # the prompt, then a decode step planned ahead
    assert second is not None and second.rids == ["a"]
    table = blocks.block_ids("a")
    (delta,) = sched.update(StepResult(step=first.step, rids=["a"], token_ids=np.asarray([EOS], np.int32)))
    assert delta.finish_reason == "stop" and "a" not in sched.seqs and not sched.has_work()
    assert all(blocks.refcount(b) == 1 for b in table)  # still held: the second step writes them
    assert blocks.num_free_blocks == 8 - len(table)
    assert sched.update(StepResult(step=second.step, rids=["a"], token_ids=np.asarray([3], np.int32))) == []
    assert blocks.num_free_blocks == 8  # back with it
    blocks.check_invariants()


def conversations(n: int = 6, turns: int = 3, seed: int = 7):
    """Multi-turn chats: each turn's prompt is the last one, its reply and a new message (hits past a snapshot
    of the last turn, and past blocks another turn cached without one)."""
    rng = random.Random(seed)
    reqs = []
    for c in range(n):
        prompt = [rng.randrange(8, VOCAB) for _ in range(rng.randrange(5, 20))]
        for t in range(turns):
            max_tokens = rng.randrange(3, 12)
            reqs.append((f"c{c}t{t}", list(prompt), max_tokens))
            prompt += reference(prompt, max_tokens) + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 9))]
    return reqs


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("work,num_blocks,budget,snapshots,max_seqs", [
    ("shared", 400, 16, 4, 8), ("shared", 30, 16, 2, 8), ("shared", 400, 64, 1, 8),
    ("chats", 400, 8, 6, 2), ("chats", 400, 32, 3, 3), ("chats", 40, 8, 4, 4)])
def test_a_hybrid_models_prefix_hits_resume_state_snapshots_taken_where_chunks_end(depth, work, num_blocks, budget,
                                                                                   snapshots, max_seqs):
    reqs = workload(24, seed=5) if work == "shared" else conversations()
    outputs, finished, sched = drive(reqs, num_blocks, depth, budget=budget, snapshots=snapshots, max_seqs=max_seqs)
    for rid, prompt, max_tokens in reqs:
        assert outputs[rid] == reference(prompt, max_tokens), rid
    assert sched.worker.resumed > 0 and sched.blocks.hit_tokens > 0


def test_a_stop_token_id_is_the_stop_reason_and_eos_is_none():
    """vLLM's stop_reason: the matched stop_token_ids entry, None when EOS ended the sequence."""
    for stop_ids, eos_ids, tok in (([], [EOS], EOS), ([5], [EOS], 5), ([EOS], [EOS], EOS)):
        blocks = BlockManager(20, 4)
        sched = BatchScheduler(SchedulerConfig(max_num_seqs=2, max_steps_in_flight=1), blocks, max_model_len=64)
        sched.add(TokenizedRequest(rid="r", prompt_ids=np.arange(8, 14, dtype=np.int32), eos_token_ids=eos_ids,
                                   sampling=SamplingParams(max_tokens=4, temperature=0, stop_token_ids=stop_ids)))
        plan = sched.schedule()
        (delta,) = sched.update(StepResult(step=plan.step, rids=["r"], token_ids=np.asarray([tok], np.int32)))
        assert delta.finish_reason == "stop"
        assert delta.stop_token == (tok if tok in stop_ids else None), (stop_ids, tok)


def test_a_speculating_step_is_planned_ahead_only_as_the_same_decodes_again():
    """With a verify step in flight the next one is planned as if it accepted every draft (k + 1 tokens further on
    each sequence), only while every running sequence verifies all k drafts and no waiting request could be admitted
    instead; the result rolls back what was not accepted, so each sequence's KV count lands where its tokens end."""
    from flotilla.config import SpeculativeConfig

    k = 2
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_steps_in_flight=2,
                          speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=k))
    sched = BatchScheduler(cfg, BlockManager(64, 4), max_model_len=256)
    sched.plan_ahead = True
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for rid in ("r0", "r1"):
        sched.add(TokenizedRequest(rid=rid, prompt_ids=np.arange(4, 9, dtype=np.int32), sampling=params))

    def result(plan: StepPlan, accepted: list[int]) -> StepResult:
        tokens = np.arange(10, 10 + sum(a + 1 for a in accepted), dtype=np.int32)
        return StepResult(step=plan.step, rids=list(plan.rids), token_ids=tokens,
                          num_tokens=np.asarray([a + 1 for a in accepted], dtype=np.int32))

    prefill = sched.schedule()
    assert sched.schedule() is None  # prompts in flight: nothing to plan ahead of
    sched.update(result(prefill, [0, 0]))
    first = sched.schedule()
    assert first.num_new_tokens.tolist() == [k + 1, k + 1]
    ahead = sched.schedule()
    assert ahead is not None and ahead.rids == first.rids and ahead.num_new_tokens.tolist() == [k + 1, k + 1]
    assert sched.schedule() is None  # one step ahead at most
    sched.update(result(first, [k, 0]))  # r0 took both drafts, r1 none
    r0, r1 = sched.seqs["r0"], sched.seqs["r1"]
    assert (r0.num_tokens, r1.num_tokens) == (5 + 1 + k + 1, 5 + 1 + 1)
    # the step in flight started at each one's last token: it computes k + 1 from there
    assert (r0.num_computed, r1.num_computed) == (r0.num_tokens - 1 + k + 1, r1.num_tokens - 1 + k + 1)
    sched.add(TokenizedRequest(rid="r2", prompt_ids=np.arange(4, 7, dtype=np.int32), sampling=params))
    assert sched.schedule() is None  # r2 could be admitted: the batch waits for the step in flight
    sched.update(result(ahead, [1, k]))
    assert (r0.num_computed, r1.num_computed) == (r0.num_tokens - 1, r1.num_tokens - 1)
    assert r0.drafts_ahead == r1.drafts_ahead == 0
    assert sched.spec_draft_tokens == 4 * k and sched.spec_accepted_tokens == k + 1 + k
    plan = sched.schedule()
    assert plan.rids == ["r0", "r1", "r2"] and plan.num_new_tokens.tolist() == [k + 1, k + 1, 3]
