"""The continuous-batching policy (pure: no sockets, no asyncio), wrapped by SchedulerActor.

Each step spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs` sequences:
running sequences first (a decode costs one token, an unfinished prompt its next chunk), then waiting
ones in FCFS or priority order, their prompts chunked to fit when chunked prefill is on; beside running
sequences, a prompt is admitted only once all its blocks fit (_rest_fits). When KV blocks run out, the
most recently admitted running sequence is preempted by recompute: its blocks are freed, it returns to
the head of the queue, and later resumes with prompt + output as its new "prompt" (the prefix cache
usually gives most of it back). Greedy output is unchanged by preemption.

A plan carries only what changed (new sequences in full, running ones as token counts and appended
block ids), and `num_computed` advances when a step is *planned*, so step N+1 can be planned before
step N's result is in (the worker feeds each decode the token it sampled itself).

Speculative decoding (config.speculative_config, actors/spec_decode.py): a decode is planned with 1 + k
tokens, its last token and k drafts the worker holds (k <= num_speculative_tokens, fewer near max_tokens
or max_model_len; none for requests with penalties), with KV slots for them and num_speculative_tokens - 1
more (where further drafts are written). The result says how many tokens it got (accepted drafts + 1);
num_computed drops back over the rejected positions (their KV is overwritten later), and the tokens are
stop-checked one by one, so EOS / stop ids / max_tokens cut them where plain decoding would stop.
A speculating step is planned while the last one is in flight only when the worker can take it (`plan_ahead`)
and it is the same batch of decodes again (_plan_ahead): each sequence's drafts in flight are taken as accepted,
the worker corrects the positions on the device, and the result of the step in flight rolls back what was not.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from flotilla.actors.block_manager import Allocation, BlockManager
from flotilla.config import SchedulerConfig
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import (
    ImageItem,
    NewSequence,
    PromptLogprobs,
    SeqTokens,
    StepPlan,
    StepResult,
    TokenizedRequest,
)

PROMPT_TAIL = 8
"""Prompt tokens sent to the detokenizer so the first output token decodes in context."""


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's view of one sequence."""

    rid: str
    prompt_ids: np.ndarray
    sampling: SamplingParams
    stop_ids: frozenset[int]
    """EOS (unless ignore_eos) and stop_token_ids."""
    priority: int
    order: int
    """Arrival counter: FIFO tie-break, and preempted sequences keep their place."""
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is computed or being computed by a planned step."""
    num_cached: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    in_worker: bool = False
    """The worker holds state for it (so the next plan sends only changes)."""
    new_blocks: list[int] = field(default_factory=list)
    """Blocks appended since the last plan."""
    sent_first: bool = False
    reply_to: str | None = None
    """TokenizedRequest.reply_to: another node's front end that gets the sequence's text."""
    aborted: bool = False
    """Aborted while a step that computes it is in flight: finish when the result arrives."""
    pending: int = 0
    """Tokens that planned steps will sample for it but whose results are not in yet."""
    inflight: int = 0
    """Planned steps that compute it and have not returned: while > 0 it cannot be preempted."""
    num_done: int = 0
    """Tokens whose KV is computed by steps that have returned (what the prefix cache may take)."""
    full_blocks_offered: int = 0
    """Full computed blocks already offered to the prefix cache (skip the hashing call when none is new)."""
    transfer_id: str | None = None
    """Disaggregated requests: the id shared by the prefill and the decode side."""
    num_drafts: int = 0
    """Speculative decoding: draft tokens its last planned step verifies."""
    drafts_ahead: int = 0
    """Draft tokens of its steps in flight that a later planned step took as accepted (_plan_ahead)."""
    state_snapshot: int = -1
    """Hybrid models: the snapshot slot its state resumes from (a prefix hit), sent with its first plan."""
    arrival_time: float = 0.0
    """When the front end received the request (wall clock, seconds)."""
    queue_time: float | None = None
    """From arrival to its first scheduled step, seconds (None until then)."""
    images: list[ImageItem] = field(default_factory=list)
    """Multimodal prompts: the images whose embeddings fill their placeholder runs."""
    key_prompt: np.ndarray | None = None
    """The prompt as the prefix cache keys it when it has images: each placeholder run replaced by its image's
    content hash, so that the same text with another image never hits (None: the prompt itself)."""
    prompt_parts: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    """Prompt logprobs: each prefill chunk's scored tokens (logprobs, ranks[, top ids, top logprobs]), in order."""
    _ids: np.ndarray | None = None
    """Prompt + output tokens as int32 with spare capacity, filled up to _ids_len (see token_ids)."""
    _ids_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> np.ndarray:
        """Prompt + output tokens (a read-only view: tokens are only ever appended, so the positions it shows never
        change). Amortised O(tokens added since the last call), not O(length): the prefix cache asks for them
        each time a block fills up, for every running sequence."""
        if not self.output_ids:
            return self.prompt_ids
        n, p = self.num_tokens, len(self.prompt_ids)
        ids = self._ids
        if ids is None or len(ids) < n:  # (re)allocate with room to double
            grown = np.empty(max(2 * n, 64), dtype=np.int32)
            have = p if ids is None else self._ids_len
            grown[:have] = self.prompt_ids if ids is None else ids[:have]
            self._ids, self._ids_len, ids = grown, have, grown
        if self._ids_len < n:
            ids[self._ids_len:n] = self.output_ids[self._ids_len - p:]
            self._ids_len = n
        view = ids[:n]
        view.flags.writeable = False
        return view

    def cache_ids(self) -> np.ndarray:
        """The tokens as the prefix cache keys them: token_ids() with the images' runs replaced (key_prompt)."""
        if self.key_prompt is None:
            return self.token_ids()
        return np.concatenate((self.key_prompt, self.token_ids()[len(self.key_prompt):]))


def image_keys(prompt_ids: np.ndarray, images: list[ImageItem]) -> np.ndarray | None:
    """The prompt with each image's placeholder run filled with its content hash's 32-bit words, negated (no token id
    is negative, so a key never equals text); None without images."""
    if not images:
        return None
    keys = np.array(prompt_ids, dtype=np.int32)
    for image in images:
        words = -1 - (np.frombuffer(image.hash, dtype="<u4").astype(np.int64) & 0x7FFFFFFF)
        keys[image.offset:image.offset + image.length] = np.resize(words, image.length).astype(np.int32)
    return keys


class BatchScheduler:
    """Admission, step planning, preemption and stop checks."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, order, seq)
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._step = itertools.count()
        self._forget: list[str] = []  # rids the worker must drop before the next step
        self.inflight: dict[int, list[tuple[Sequence, int, int]]] = {}
        """Steps in flight: (sequence, tokens, drafts among them) per row."""
        self._lingering: set[str] = set()
        """Ended sequences whose blocks wait for the steps in flight that still compute them (_release)."""
        self.num_preemptions = 0
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_draft_tokens = 0
        """Draft tokens verified since start."""
        self.spec_accepted_tokens = 0
        """Draft tokens accepted since start."""
        self.plan_ahead = False
        """Speculating: the worker runs a step planned before the last one's result is in (_plan_ahead)."""

    # ---- requests in and out ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running)

    def add(self, req: TokenizedRequest) -> bool:
        """Queue a request; False when the waiting queue is full (the caller answers 429)."""
        seq = self._register(req)
        if seq is None:
            return False
        heapq.heappush(self.waiting, (seq.priority, seq.order, seq))
        return True

    def _register(self, req: TokenizedRequest) -> Sequence | None:
        """The request's Sequence, known to the scheduler but not yet queued; None when full."""
        if self.num_waiting >= self.config.max_waiting_requests:
            return None
        if req.rid in self.seqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        sp = req.sampling
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_token_ids))
        prio = req.priority if self.config.policy == "priority" else 0
        prompt = np.asarray(req.prompt_ids, dtype=np.int32)
        seq = Sequence(rid=req.rid, prompt_ids=prompt, sampling=sp, stop_ids=frozenset(stop), priority=prio,
                       order=next(self._order), reply_to=req.reply_to, arrival_time=req.arrival_time,
                       images=req.images, key_prompt=image_keys(prompt, req.images))
        self.seqs[seq.rid] = seq
        return seq

    def abort(self, rid: str) -> SeqTokens | None:
        """Drop a request; returns its final delta (None if unknown or already gone)."""
        seq = self.seqs.get(rid)
        if seq is None:
            return None
        if seq.inflight:
            seq.aborted = True  # a step is writing its KV: release its blocks when that step is done
            return None
        return self._finish(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- planning ------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when there is nothing to run.

        Steps may be planned while earlier ones are in flight: a sequence whose sampled token is still
        pending is planned as if it had it (the worker feeds it its own token), and one that will have hit
        max_tokens when its pending tokens land is not planned again. Only sequences in no step in flight
        are preempted; when none is, planning stops until results come back.
        """
        if self.num_speculative_tokens and self.inflight:
            return self._plan_ahead()
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Sequence, int, int]] = []
        preempted = blocked = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._cut(seq, min(seq.num_tokens + seq.pending - seq.num_computed, budget))
            if n <= 0 or seq.aborted or self._will_finish(seq):
                i += 1
                continue
            drafts = self._num_drafts(seq, n, budget)
            n += drafts
            slots = self._slots_to_append(seq, n) if self.num_speculative_tokens else n
            while (new := self.blocks.append_slots(seq.rid, slots)) is None:
                victim = next((v for v in reversed(self.running) if not v.inflight), None)
                if victim is None:  # everyone is in flight: wait for results to free or finish someone
                    blocked = True
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if blocked:
                break
            if seq.rid not in self.seqs or seq not in self.running:
                continue
            seq.new_blocks.extend(new)
            batch.append((seq, n, drafts))
            budget -= n
            i += 1
        while not (preempted or blocked) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            n = self._admit(seq, budget)
            if n == 0:
                break
            heapq.heappop(self.waiting)
            self.running.append(seq)
            batch.append((seq, n, 0))
            budget -= n
        if not batch and not self._forget:
            return None
        return self._plan(batch)

    def _plan_ahead(self) -> StepPlan | None:
        """Speculating, a step in flight: the next step of the same decodes, planned as if the one in flight accepts
        every draft (the worker corrects each sequence's positions on the device once it knows). Only when every
        running sequence verifies all num_speculative_tokens drafts in that step and can again in this one, and no
        waiting request could be admitted instead (the batch then waits for the result, as plain planning does);
        None otherwise."""
        k = self.num_speculative_tokens
        if (not self.plan_ahead or len(self.inflight) > 1 or not self.running
                or (len(self.running) < self.config.max_num_seqs and self._peek_waiting() is not None)
                or len(self.running) * (k + 1) > self.config.max_num_batched_tokens):
            return None
        (last,) = self.inflight.values()
        drafted = {id(seq) for seq, _, d in last if d == k}
        for seq in self.running:
            sp = seq.sampling
            if (id(seq) not in drafted or seq.aborted or seq.inflight != 1 or sp.seed is not None
                    or sp.structured_outputs is not None):  # (a seed's noise follows the accepted count)
                return None
            # room for a full step after the one in flight yields its k + 1 tokens
            out = len(seq.output_ids) + 2 * (k + 1)
            if (sp.max_tokens is not None and out > sp.max_tokens) or seq.num_tokens + 2 * (k + 1) > self.max_model_len:
                return None
        for seq in self.running:
            new = self.blocks.append_slots(seq.rid, self._slots_to_append(seq, k + 1))
            if new is None:  # (blocks appended to the sequences before it go with a later plan)
                return None
            seq.new_blocks.extend(new)
        for seq in self.running:
            seq.drafts_ahead += k
        return self._plan([(seq, k + 1, k) for seq in self.running])

    def _num_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """Draft tokens to verify with a decode of `n` tokens (0 unless speculating and n is a decode's 1)."""
        if not self.num_speculative_tokens or n != 1 or not seq.output_ids:
            return 0
        sp = seq.sampling
        if sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0:
            return 0  # penalties would need each draft position's own history: not built
        if sp.structured_outputs is not None and sp.structured_outputs.after:
            return 0  # a grammar that starts after a reasoning end tag: not where its drafts may cross the tag
        k = min(self.num_speculative_tokens, budget - 1, self.max_model_len - seq.num_tokens - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - len(seq.output_ids) - 1)
        return max(k, 0)

    def _slots_to_append(self, seq: Sequence, n: int) -> int:
        """Speculating: slots to add so the table covers the step's n tokens and num_speculative_tokens - 1
        beyond (the further drafts' MTP KV); rejected drafts leave slots behind, which later steps reuse."""
        want = seq.num_computed + n + self.num_speculative_tokens - 1
        return max(want - self.blocks.num_slots(seq.rid), 0)

    def _will_finish(self, seq: Sequence) -> bool:
        """Its pending tokens already reach max_tokens or max_model_len: planning more would be waste."""
        if not seq.pending:
            return False
        max_tokens = seq.sampling.max_tokens
        return ((max_tokens is not None and len(seq.output_ids) + seq.pending >= max_tokens)
                or seq.num_tokens + seq.pending >= self.max_model_len)

    def _peek_waiting(self) -> Sequence | None:
        while self.waiting:
            seq = self.waiting[0][2]
            if seq.rid in self.seqs and seq not in self.running:
                return seq
            heapq.heappop(self.waiting)  # aborted while waiting
        return None

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its blocks (prefix hits first); returns the tokens it runs now, 0 = not now."""
        tokens = seq.cache_ids()
        whole = seq.sampling.prompt_logprobs is not None and not seq.sent_first  # every prompt position is scored
        hit = Allocation([], 0) if whole else self.blocks.match_prefix(tokens)
        cached = hit.num_cached_tokens
        remaining = len(tokens) - cached
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0
        if not self._rest_fits(tokens, hit):
            return 0
        points = self.blocks.snapshot_points(tokens, hit)  # (a hybrid model: its chunks end at each)
        n = min(remaining, budget, points[0] - cached if points else remaining)
        alloc = self.blocks.allocate(seq.rid, tokens, num_new_tokens=n, read_cache=not whole)
        if alloc is None:
            return 0
        if not self._reserve_states(seq, points):
            self.blocks.free(seq.rid)
            return 0
        if not seq.output_ids:
            seq.num_cached = alloc.num_cached_tokens
        seq.num_computed = seq.num_done = alloc.num_cached_tokens
        seq.full_blocks_offered = 0
        seq.new_blocks = []
        seq.num_drafts = 0
        seq.state_snapshot = alloc.state_snapshot
        if seq.queue_time is None:
            seq.queue_time = max(time.time() - seq.arrival_time, 0.0) if seq.arrival_time else 0.0
        if self.num_speculative_tokens > 1:  # room for the further drafts' MTP KV (skipped when not there)
            self.blocks.append_slots(seq.rid, self.num_speculative_tokens - 1)
        return len(tokens) - alloc.num_cached_tokens if n == remaining else n

    def _rest_fits(self, tokens: np.ndarray, hit: Allocation) -> bool:
        """With sequences running, a prompt is admitted only when its blocks, all of them, fit beside what those
        sequences still need for their own known tokens and one block each to grow into. Admitted by its first chunk
        alone, a long prompt could take the blocks the running ones need and be preempted before its prefill ends,
        again and again, its chunks computed anew each time (docs/benchmarks.md, "Long contexts")."""
        if not self.running:
            return True
        fresh = self.blocks.blocks_for(len(tokens)) - len(hit.block_ids)
        revived = sum(1 for b in hit.block_ids if self.blocks.refcount(b) == 0)  # (evictable hits count as free)
        claimed = len(self.running)
        for s in self.running:
            known = s.num_tokens + s.pending
            if known - s.num_computed > 1 and s.rid in self.blocks:  # (a prompt not all planned yet)
                claimed += self.blocks.num_new_blocks(s.rid, max(known - self.blocks.num_slots(s.rid), 0))
        return fresh + revived + claimed <= self.blocks.num_free_blocks

    def _reserve_states(self, seq: Sequence, points: list[int]) -> bool:
        """A hybrid model's state snapshots for a sequence just given its blocks (BlockManager.snapshot_points);
        False: it cannot run now."""
        for at in points:
            self.blocks.reserve_snapshot(seq.rid, at)  # (-1 when every slot is taken: no snapshot there)
        return True

    def _cut(self, seq: Sequence, n: int) -> int:
        """The sequence's next chunk of n tokens, ended where its state is to be saved if it crosses that point."""
        snapshot = self.blocks.snapshot_after(seq.rid, seq.num_computed)
        if snapshot is not None and snapshot[0] < seq.num_computed + n:
            return snapshot[0] - seq.num_computed
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.rid)
        if seq.in_worker:
            self._forget.append(seq.rid)
        seq.in_worker = False
        seq.num_computed = seq.num_done = 0
        seq.new_blocks = []
        seq.prompt_parts = []  # (scored again when its prompt is recomputed, unless already sent)
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (seq.priority, seq.order, seq))

    def _plan(self, batch: list[tuple[Sequence, int, int]]) -> StepPlan:
        step = next(self._step)
        new_seqs, rids, counts, appended, save_rows, save_slots = [], [], [], [], [], []
        every_row_samples = True
        for row, (seq, n, drafts) in enumerate(batch):
            rids.append(seq.rid)
            seq.num_drafts = drafts
            if not seq.in_worker:
                new_seqs.append(NewSequence(
                    rid=seq.rid, token_ids=seq.token_ids(), num_computed_tokens=seq.num_computed,
                    block_ids=np.asarray(self.blocks.block_ids(seq.rid), dtype=np.int32), sampling=seq.sampling,
                    num_output_tokens=len(seq.output_ids), state_snapshot=seq.state_snapshot, images=seq.images))
                seq.in_worker = True
                counts.append(0)
            else:
                counts.append(len(seq.new_blocks))
                appended.extend(seq.new_blocks)
            seq.new_blocks = []
            snapshot = self.blocks.snapshot_after(seq.rid, seq.num_computed)
            if snapshot is not None and snapshot[0] == seq.num_computed + n:  # (_cut ends chunks there)
                save_rows.append(row)
                save_slots.append(snapshot[1])
            if seq.num_computed + n >= seq.num_tokens + seq.pending + seq.drafts_ahead:  # reaches its end: samples
                seq.pending += 1
            else:
                every_row_samples = False
            seq.num_computed += n
            seq.inflight += 1
        plan = StepPlan(step=step, new_seqs=new_seqs, rids=rids,
                        num_new_tokens=np.asarray([n for _, n, _ in batch], dtype=np.int32),
                        new_block_counts=np.asarray(counts, dtype=np.int32),
                        new_block_ids=np.asarray(appended, dtype=np.int32), finished_rids=self._forget,
                        state_save_rows=np.asarray(save_rows, dtype=np.int32) if save_rows else None,
                        state_save_slots=np.asarray(save_slots, dtype=np.int32) if save_rows else None,
                        every_row_samples=every_row_samples)
        self._forget = []
        self.inflight[step] = batch
        return plan

    # ---- results ---------------------------------------------------------------------------------------

    def update(self, result: StepResult) -> list[SeqTokens]:
        """Apply a step's sampled tokens: stop checks, finished sequences freed, one delta per sequence."""
        batch = self.inflight.pop(result.step, [])
        sampled = dict(zip(result.rids, range(len(result.rids))))
        starts = None if result.num_tokens is None else np.concatenate(([0], np.cumsum(result.num_tokens))).tolist()
        for seq, n, drafts in batch:
            seq.inflight -= 1
            seq.num_done += n
            if seq.state_snapshot >= 0:  # its first step is back: the state it resumed from may be reused now
                self.blocks.resumed(seq.rid)
                seq.state_snapshot = -1
            if seq.rid in sampled:
                seq.pending -= 1
            if drafts:
                self._rollback(seq, drafts, sampled.get(seq.rid), starts)
            if not seq.inflight and seq.rid in self._lingering:  # its last step in flight is back
                self._lingering.discard(seq.rid)
                self.blocks.free(seq.rid)
        if result.error is not None:
            return [self._finish(seq, "error") for seq, _, _ in batch if seq.rid in self.seqs]
        if result.prompt_rids:
            self._take_prompt_scores(result)
        for seq, _, _ in batch:
            done = min(seq.num_done, seq.num_tokens)
            if seq.rid in self.seqs and done // self.blocks.block_size > seq.full_blocks_offered:
                self.blocks.commit(seq.rid, seq.cache_ids(), done)  # O(L) concat only when a block filled up
                seq.full_blocks_offered = done // self.blocks.block_size
        deltas: list[SeqTokens] = []
        tokens = result.token_ids.tolist() if result.token_ids is not None else []
        for seq, _, _ in batch:
            if seq.rid not in self.seqs:
                continue
            j = sampled.get(seq.rid)
            if seq.aborted:
                if not seq.inflight:  # the last step writing its KV is done: its blocks may go
                    deltas.append(self._finish(seq, "abort"))
                continue
            if j is None:
                continue
            first, end = (j, j + 1) if starts is None else (starts[j], starts[j + 1])
            tok = tokens[first]
            if self._hand_off(seq, tok, result, first):
                continue
            at = first
            while True:  # accepted drafts are stop-checked one by one, as if each were sampled alone
                seq.output_ids.append(tok)
                reason = self._stop_reason(seq, tok)
                at += 1
                if reason is not None or at == end:
                    break
                tok = tokens[at]
            delta = self._delta(seq, tokens[first:at])
            if result.logprobs is not None and seq.sampling.logprobs is not None:
                k = seq.sampling.logprobs
                delta.logprobs = result.logprobs[first:at].tolist()
                delta.top_ids = result.top_ids[first:at, :k].tolist()
                delta.top_logprobs = result.top_logprobs[first:at, :k].tolist()
            if reason is not None:
                delta.finish_reason = reason
                if reason == "stop" and tok in seq.sampling.stop_token_ids:  # (None for EOS, as vLLM says)
                    delta.stop_token = tok
                self._release(seq)
            deltas.append(delta)
        return deltas

    def _take_prompt_scores(self, result: StepResult) -> None:
        """Keep each sequence's scored prompt tokens until its first delta carries them."""
        ends = np.cumsum(result.prompt_counts).tolist()
        top = result.prompt_top_ids is not None
        for rid, end, count in zip(result.prompt_rids, ends, result.prompt_counts.tolist()):
            seq = self.seqs.get(rid)
            if seq is not None and not seq.sent_first:
                cut = slice(end - count, end)
                seq.prompt_parts.append((result.prompt_logprobs[cut], result.prompt_ranks[cut]) + (
                    (result.prompt_top_ids[cut], result.prompt_top_logprobs[cut]) if top else ()))

    def _rollback(self, seq: Sequence, drafts: int, j: int | None, starts: list[int] | None) -> None:
        """A verify step of `drafts` drafts is back: count them, and forget the KV of the rejected ones (and what a
        step planned ahead took as accepted)."""
        accepted = 0 if j is None or starts is None else starts[j + 1] - starts[j] - 1
        rejected = drafts - accepted
        seq.num_computed -= rejected
        seq.num_done -= rejected
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += accepted
        if seq.drafts_ahead:
            seq.drafts_ahead -= drafts

    def _hand_off(self, seq: Sequence, tok: int, result: StepResult, row: int) -> bool:
        """A sampled token (row `row` of the result) that leaves this engine (disaggregated prefill); True =
        handled, no delta."""
        return False

    def released_before_arrival(self, transfer_id: str) -> bool:
        """Whether a disaggregated request arriving now was released already (its partner engine died while the
        request was on its way here): it is dropped, nothing is held for it."""
        return False

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        n_out = len(seq.output_ids)
        if tok in seq.stop_ids and n_out > seq.sampling.min_tokens:
            return "stop"
        if seq.sampling.max_tokens is not None and n_out >= seq.sampling.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _delta(self, seq: Sequence, tokens: list[int]) -> SeqTokens:
        d = SeqTokens(rid=seq.rid, token_ids=tokens, num_prompt_tokens=len(seq.prompt_ids),
                      num_cached_tokens=seq.num_cached)
        if not seq.sent_first:
            seq.sent_first = True
            d.queue_time_s = seq.queue_time
            d.sampling = seq.sampling
            d.prompt_tail = seq.prompt_ids[-PROMPT_TAIL:].tolist()
            d.reply_to = seq.reply_to
            if seq.sampling.prompt_logprobs is not None:
                d.prompt_logprobs = prompt_logprobs(seq.prompt_ids, seq.prompt_parts, seq.sampling.prompt_logprobs)
                seq.prompt_parts = []
        return d

    def _finish(self, seq: Sequence, reason: str) -> SeqTokens:
        delta = self._delta(seq, [])
        delta.finish_reason = reason
        self._release(seq)
        return delta

    def _release(self, seq: Sequence) -> None:
        self.seqs.pop(seq.rid, None)
        if seq in self.running:
            self.running.remove(seq)
        if seq.inflight:
            # A stop token in step N's result ends a sequence that step N+1, already launched, still computes: the
            # worker writes that step's KV into these blocks. They return to the pool when it is back. (A block
            # reused at once is written out of the worker's step order by a KV migration on a decode engine; the
            # late write would land in the migrated prompt.)
            self._lingering.add(seq.rid)
        else:
            self.blocks.free(seq.rid)
        if seq.in_worker:
            self._forget.append(seq.rid)
            seq.in_worker = False


def prompt_logprobs(prompt_ids: np.ndarray, parts: list[tuple[np.ndarray, ...]], k: int) -> PromptLogprobs:
    """A prompt's scored tokens (its prefill chunks' parts, in order) with k alternatives each (a part has as many
    as the most any sequence of its step asked for)."""
    def joined(i: int) -> list:
        return np.concatenate([p[i] if i < 2 else p[i][:, :k] for p in parts]).tolist() if parts else []

    out = PromptLogprobs(token_ids=prompt_ids.tolist(), logprobs=joined(0), ranks=joined(1))
    if k:
        out.top_ids, out.top_logprobs = joined(2), joined(3)
    return out
