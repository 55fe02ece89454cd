"""Disaggregated prefill/decode policies against two fake workers whose KV caches check every read: the
decode side must see exactly the prompt KV the prefill side computed, outputs must equal a colocated run,
and every block on both sides must come back, aborts at any moment included."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from flotilla.actors.block_manager import BlockManager
from flotilla.actors.disagg import ENDED_MEMORY, DecodeBatchScheduler, PrefillBatchScheduler
from flotilla.config import SchedulerConfig
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import (
    BlocksReleasedEvent,
    KVReadyEvent,
    MigrateKVCmd,
    MigrationDoneEvent,
    TokenizedRequest,
)

from helpers_batching import EOS, VOCAB, FakeWorker, prompt_score, reference, reference_prompt_scores

BS = 4


class Engine:
    """One side: a policy, its block manager and fake worker, steps pipelined to `depth`; `snapshots` > 0: a hybrid
    model's (its worker checks every recurrent state a sequence resumes)."""

    def __init__(self, cls, num_blocks: int, depth: int, snapshots: int = 0, **kw) -> None:
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_steps_in_flight=depth)
        self.blocks = BlockManager(num_blocks, BS, num_state_snapshots=snapshots)
        self.sched = cls(cfg, self.blocks, max_model_len=512, **kw)
        self.worker = FakeWorker(num_blocks, BS, hybrid=snapshots > 0)
        self.inflight: deque = deque()
        self.num_blocks = num_blocks

    def step(self) -> list:
        while len(self.inflight) < self.sched.config.max_steps_in_flight and (p := self.sched.schedule()):
            self.inflight.append(p)
        if not self.inflight:
            return []
        return self.sched.update(self.worker.execute(self.inflight.popleft()))


def run(requests, p_blocks=200, d_blocks=200, depth=2, abort=frozenset(), seed=0, snapshots=0, logprobs=None,
        firsts=None):
    """logprobs: rid -> (prompt_logprobs, logprobs) to ask for; each request's first delta goes into `firsts`."""
    rng = random.Random(seed)
    pre = Engine(PrefillBatchScheduler, p_blocks, depth, snapshots, engine="p")
    dec = Engine(DecodeBatchScheduler, d_blocks, depth, snapshots)
    outputs = {rid: [] for rid, _, _ in requests}
    finished: dict[str, str] = {}
    migrations: deque[MigrateKVCmd] = deque()
    bytes_moved = 0
    for rid, prompt, max_tokens in requests:
        scored, lps = (logprobs or {}).get(rid, (None, None))
        req = TokenizedRequest(rid=rid, prompt_ids=np.asarray(prompt, np.int32), eos_token_ids=[EOS],
                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=scored,
                                                       logprobs=lps), transfer_id=rid)
        sides = [pre, dec] if rng.random() < 0.5 else [dec, pre]  # either side may hear of it first
        for side in sides:
            assert side.sched.add(req)

    def collect(deltas):
        for d in deltas:
            if firsts is not None and d.token_ids and not outputs[d.rid]:
                firsts[d.rid] = d
            outputs[d.rid].extend(d.token_ids)
            if d.finish_reason:
                finished[d.rid] = d.finish_reason

    for _ in range(20_000):
        assert pre.step() == []  # the prefill side never streams tokens of a disaggregated request
        collect(dec.step())
        for msg in pre.sched.outbox:
            assert isinstance(msg, KVReadyEvent)
            collect(dec.sched.on_kv_ready(msg))
        pre.sched.outbox.clear()
        for msg in dec.sched.outbox:
            if isinstance(msg, MigrateKVCmd):
                migrations.append(msg)
            else:
                assert isinstance(msg, BlocksReleasedEvent)
                pre.sched.on_blocks_released(msg)
        dec.sched.outbox.clear()
        if migrations and rng.random() < 0.5:  # migrations take a while: aborts can land meanwhile
            cmd = migrations.popleft()
            # the data plane writes these blocks now: they must still belong to the transfer, and its
            # prefill blocks must still be held (pinned) on the other side
            assert set(cmd.dst_block_ids.tolist()) <= set(dec.blocks.block_ids(cmd.transfer_id))
            assert all(pre.blocks.refcount(b) > 0 for b in cmd.src_block_ids.tolist())
            for src, dst in zip(cmd.src_block_ids.tolist(), cmd.dst_block_ids.tolist()):
                dec.worker.kv[dst * BS:(dst + 1) * BS] = pre.worker.kv[src * BS:(src + 1) * BS]
                bytes_moved += BS
            if snapshots:  # the prompt's recurrent state, from the slot its transfer pins on the prefill side
                assert cmd.src_state_slot in pre.blocks._pinned_states.values()
                dec.worker.snapshots[cmd.dst_state_slot] = pre.worker.snapshots[cmd.src_state_slot]
            collect(dec.sched.on_migration_done(MigrationDoneEvent(transfer_id=cmd.transfer_id)))
        for rid in abort:
            if rid not in finished and rng.random() < 0.05:
                for side in (dec, pre):
                    d = side.sched.abort(rid)
                    if d is not None and side is dec:
                        collect([d])
        pre.blocks.check_invariants()
        dec.blocks.check_invariants()
        if len(finished) == len(requests) and not migrations and not pre.inflight and not dec.inflight \
                and not pre.sched.seqs and not pre.blocks._pins:
            break
    assert len(finished) == len(requests), "every request must end"
    assert pre.blocks.num_free_blocks == pre.num_blocks and not pre.blocks._pins, "prefill blocks all back"
    assert dec.blocks.num_free_blocks == dec.num_blocks, "decode blocks all back"
    assert not (dec.sched.transfers or dec.sched._early or dec.sched._released), "no transfer left behind"
    for side in (pre, dec):
        assert len(side.blocks._free_snapshots) + len(side.blocks._snapshots) == snapshots, "state slots all back"
    if snapshots:
        assert dec.worker.resumed > 0
    return outputs, finished, bytes_moved


def workload(n=12, seed=5):
    rng = random.Random(seed)
    system = [rng.randrange(8, VOCAB) for _ in range(10)]
    return [(f"r{i}", (system if i % 3 == 0 else []) + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 30))],
             rng.randrange(1, 20)) for i in range(n)]


def test_the_decode_side_reports_the_prompt_and_first_token_logprobs_the_prefill_side_computed():
    reqs = workload()
    asked = {rid: ([None, 0, 2][i % 3], [None, 1, 3][i % 3]) for i, (rid, _, _) in enumerate(reqs)}
    firsts: dict = {}
    run(reqs, 30, 40, depth=2, logprobs=asked, firsts=firsts)
    for rid, prompt, _ in reqs:
        k_prompt, k = asked[rid]
        first = firsts[rid]
        if k_prompt is None:
            assert first.prompt_logprobs is None
        else:
            want = reference_prompt_scores(prompt, k_prompt)
            assert first.prompt_logprobs.logprobs == [float(np.float32(w[0])) for w in want]
            assert first.prompt_logprobs.top_ids == ([w[2] for w in want] if k_prompt else [])
        if k is None:
            assert first.logprobs is None
        else:
            lp, _, top_ids, _ = prompt_score(prompt + first.token_ids[:1], k)
            assert first.logprobs[:1] == [float(np.float32(lp))] and first.top_ids[0] == top_ids


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("p_blocks,d_blocks,snapshots", [(200, 200, 0), (30, 40, 0), (200, 200, 3), (30, 40, 2)])
def test_disaggregated_outputs_equal_the_reference(depth, p_blocks, d_blocks, snapshots):
    """With snapshots: a hybrid model, whose prompts' recurrent states move with their KV (through snapshot slots
    the transfer holds on both sides, fewer than the requests in flight: admission and reservation wait for them)."""
    reqs = workload()
    outputs, finished, moved = run(reqs, p_blocks, d_blocks, depth, seed=depth + p_blocks, snapshots=snapshots)
    for rid, prompt, max_tokens in reqs:
        want = reference(prompt, max_tokens)
        assert outputs[rid] == want, rid
        assert finished[rid] == ("stop" if want[-1] == EOS else "length")
    assert moved > 0


@pytest.mark.parametrize("seed", range(20))
def test_migrations_into_blocks_that_ended_sequences_still_had_in_flight_read_no_stale_kv(seed):
    """Three steps in flight and a tight decode cache: a sequence that ends on a stop token is still in the steps
    launched after the one that sampled it, and those write its KV. Its blocks go to a migration only when they are
    back; a migration writes at once, out of the worker's step order, so a block given earlier would take that late
    write into the migrated prompt."""
    reqs = workload(n=24, seed=seed)
    outputs, _, _ = run(reqs, p_blocks=200, d_blocks=24, depth=3, seed=seed)
    assert outputs == {rid: reference(prompt, max_tokens) for rid, prompt, max_tokens in reqs}


@pytest.mark.parametrize(("seed", "n", "p_blocks", "d_blocks", "depth"), [
    (0, 40, 30, 24, 1), (0, 40, 30, 24, 2), (1, 40, 24, 20, 3), (2, 24, 20, 20, 2), (3, 40, 30, 24, 2),
    (3, 40, 24, 20, 3), (4, 40, 30, 24, 1), (5, 40, 24, 20, 2),
])  # fmt: skip
def test_both_caches_full_still_drains_every_request(seed, n, p_blocks, d_blocks, depth):
    """Many requests, tight caches on both sides. Were the decode side to reserve a prompt's blocks as its request
    arrives, decode blocks held for prompts not yet computed and prefill blocks pinned for computed prompts with no
    reservation would wait on each other for good (these runs hang so). The reservation waits for KVReady, so every
    decode block belongs to a computed prompt and both sides drain."""
    reqs = workload(n=n, seed=seed)
    outputs, _, _ = run(reqs, p_blocks, d_blocks, depth, seed=seed)
    assert outputs == {rid: reference(prompt, max_tokens) for rid, prompt, max_tokens in reqs}


@pytest.mark.parametrize("snapshots", [0, 2])
def test_aborts_anywhere_in_the_transfer_release_both_sides(snapshots):
    reqs = workload(16, seed=9)
    aborted = {rid for rid, _, _ in reqs[::2]}
    ended_by_abort = 0
    for seed in range(4):
        outputs, finished, _ = run(reqs, 60, 60, depth=2, abort=aborted, seed=seed, snapshots=snapshots)
        for rid, prompt, max_tokens in reqs:
            want = reference(prompt, max_tokens)
            if finished[rid] == "abort":
                ended_by_abort += 1
                assert rid in aborted and outputs[rid] == want[:len(outputs[rid])]
            else:
                assert outputs[rid] == want
    assert ended_by_abort >= 4  # aborts really landed, at different points of the transfer


def test_a_block_size_mismatch_fails_the_request_and_releases_the_prefill_side():
    dec = Engine(DecodeBatchScheduler, 50, 1)
    req = TokenizedRequest(rid="r", prompt_ids=np.arange(8, 20, dtype=np.int32), transfer_id="r",
                           sampling=SamplingParams(max_tokens=4, temperature=0))
    assert dec.sched.add(req)
    deltas = dec.sched.on_kv_ready(KVReadyEvent(transfer_id="r", block_ids=np.arange(2, dtype=np.int32),
                                                num_tokens=12, first_token=9, src_engine="p", block_size=8))
    assert [d.finish_reason for d in deltas] == ["error"]
    assert [type(m) for m in dec.sched.outbox] == [BlocksReleasedEvent]
    assert dec.blocks.num_free_blocks == 50


def _req(rid: str = "r") -> TokenizedRequest:
    return TokenizedRequest(rid=rid, prompt_ids=np.arange(8, 20, dtype=np.int32), transfer_id=rid,
                            sampling=SamplingParams(max_tokens=4, temperature=0))


def _ready(rid: str = "r", error: str | None = None) -> KVReadyEvent:
    return KVReadyEvent(transfer_id=rid, block_ids=np.arange(3, dtype=np.int32), num_tokens=12, first_token=9,
                        src_engine="p", block_size=BS, error=error)


def test_a_request_refused_by_the_decode_side_answers_its_kv_ready_with_a_release():
    for kv_first in (False, True):
        dec = Engine(DecodeBatchScheduler, 50, 1)
        if kv_first:
            assert dec.sched.on_kv_ready(_ready()) == []
        dec.sched.refuse("r")
        if not kv_first:
            assert dec.sched.on_kv_ready(_ready()) == []
        assert [type(m) for m in dec.sched.outbox] == [BlocksReleasedEvent]
        assert not (dec.sched._early or dec.sched._released)


def test_a_prefill_death_reported_during_the_migration_frees_the_decode_blocks_only_after_it():
    dec = Engine(DecodeBatchScheduler, 50, 1)
    assert dec.sched.add(_req())
    dec.sched.on_kv_ready(_ready())
    assert [type(m) for m in dec.sched.outbox] == [MigrateKVCmd]
    dec.sched.outbox.clear()
    # the front end's word that the prefill engine died, while the data plane still writes the blocks
    assert dec.sched.on_kv_ready(_ready(error="prefill engine p died")) == []
    assert dec.blocks.num_free_blocks < 50
    deltas = dec.sched.on_migration_done(MigrationDoneEvent(transfer_id="r", error="peer gone"))
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert dec.blocks.num_free_blocks == 50
    assert [type(m) for m in dec.sched.outbox] == [BlocksReleasedEvent]


def test_a_release_before_the_hand_off_leaves_no_pin_behind():
    pre = Engine(PrefillBatchScheduler, 50, 1, engine="p")
    assert pre.sched.add(_req())
    pre.sched.on_blocks_released(BlocksReleasedEvent(transfer_id="r"))  # its decode engine died meanwhile
    assert pre.step() == []
    assert pre.sched.outbox == [] and not pre.blocks._pins and not pre.sched.seqs
    assert pre.blocks.num_free_blocks == 50
    assert not pre.sched._released_early


def test_a_release_before_the_request_arrives_drops_the_request_and_holds_nothing():
    pre = Engine(PrefillBatchScheduler, 50, 1, engine="p")
    # the decode engine died while the request was still on its way to this engine: the front end released it
    pre.sched.on_blocks_released(BlocksReleasedEvent(transfer_id="r"))
    assert pre.sched.released_before_arrival("r")
    assert not pre.sched.released_before_arrival("r")  # said once: a second request of that id would run
    assert not pre.sched.released_before_arrival("other")
    # the memory of such releases is bounded (most are of requests that ended here already)
    for i in range(ENDED_MEMORY + 10):
        pre.sched.on_blocks_released(BlocksReleasedEvent(transfer_id=f"stray-{i}"))
    assert len(pre.sched._released_early) == ENDED_MEMORY
    assert not pre.sched.released_before_arrival("stray-0") and pre.sched.released_before_arrival("stray-10")


def test_a_prefill_death_notice_after_the_migration_finished_leaves_nothing_behind():
    dec = Engine(DecodeBatchScheduler, 50, 1)
    assert dec.sched.add(_req())
    dec.sched.on_kv_ready(_ready())
    deltas = dec.sched.on_migration_done(MigrationDoneEvent(transfer_id="r"))
    assert [d.token_ids for d in deltas] == [[9]]
    # the front end's word that the prefill engine died, crossing the MigrationDone: stale, dropped
    assert dec.sched.on_kv_ready(_ready(error="prefill engine p died")) == []
    assert not dec.sched._early and not dec.sched._ended
    assert "r" in dec.sched.seqs  # the request decodes on


def test_a_prefill_failure_that_overtakes_its_request_ends_the_request_when_it_arrives():
    # the front end's death notice (or the prefill side's refusal) reaches the decode side before the request:
    # the request must end with an error at once, not migrate zero blocks and decode from a made-up token
    dec = Engine(DecodeBatchScheduler, 50, 1)
    assert dec.sched.on_kv_ready(_ready(error="prefill engine p died")) == []
    assert dec.sched.add(_req())
    assert [(d.rid, d.finish_reason) for d in dec.sched.ended] == [("r", "error")]
    assert [type(m) for m in dec.sched.outbox] == [BlocksReleasedEvent]  # the prefill side may release
    assert not (dec.sched.transfers or dec.sched._early or dec.sched._released) and "r" not in dec.sched.seqs
    assert dec.blocks.num_free_blocks == 50
