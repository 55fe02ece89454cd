"""Prefill-decode disaggregation, the pure part: what each side's scheduler does with a transfer.

A disaggregated request reaches both engines with one transfer id.

Prefill side (PrefillBatchScheduler): runs the prompt like any request, but the token it samples after
the prompt leaves the engine: the prompt's blocks are pinned under the transfer id, the sequence is
released, and a KVReadyEvent says which blocks hold the KV. The pin holds until BlocksReleasedEvent, so
an abort on either side never lets those blocks be reused while the decode side may still read them.

Decode side (DecodeBatchScheduler): once KVReady is there, reserves blocks for the whole prompt (retried at
every schedule() while the cache is full) and sends MigrateKVCmd for the blocks its own prefix cache does not
already hold; on MigrationDoneEvent it starts the sequence with the prompt computed and the prefill's first
token as its first output. Every path ends with exactly one BlocksReleasedEvent to the prefill side, aborts
included, and blocks being written by a migration are not freed before it reports.

Why the reservation waits for KVReady: reserved when the request arrives, decode blocks held for prompts not yet
computed and prefill blocks pinned for prompts with nowhere to go can wait on each other for good once both caches
are full. Reserved at KVReady, a decode block is only ever held by a prompt that is already computed, so the decode
side always progresses, and the prefill side's pins with it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np

from flotilla.actors.batching import BatchScheduler, Sequence, prompt_logprobs
from flotilla.transport.messages import (
    BlocksReleasedEvent,
    FirstTokenLogprobs,
    KVReadyEvent,
    Message,
    MigrateKVCmd,
    MigrationDoneEvent,
    SeqTokens,
    StepResult,
    TokenizedRequest,
)


ENDED_MEMORY = 4096
"""How many ended transfer ids the decode side remembers to recognise a late KVReady."""


class PrefillBatchScheduler(BatchScheduler):
    """The prefill engine's policy."""

    def __init__(self, *args, engine: str = "prefill", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.outbox: list[Message] = []
        """KVReadyEvents for the decode side, drained by the actor after each call."""
        self._transfers: set[str] = set()  # rids of disaggregated requests: the decode side streams them
        self._released_early: OrderedDict[str, None] = OrderedDict()
        """Transfer ids released before their hand-off (the decode side died), the last ENDED_MEMORY of them: their
        request may be running here, or still on its way."""

    def add(self, req: TokenizedRequest) -> bool:
        if req.transfer_id is not None:  # only the first token is sampled here
            req = msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, max_tokens=1))
        if not super().add(req):
            return False
        self.seqs[req.rid].transfer_id = req.transfer_id
        if req.transfer_id is not None:
            self._transfers.add(req.rid)
        return True

    def update(self, result) -> list[SeqTokens]:
        return self._own(super().update(result))

    def abort(self, rid: str) -> SeqTokens | None:
        delta = super().abort(rid)
        kept = self._own([delta]) if delta is not None else []
        return kept[0] if kept else None

    def _own(self, deltas: list[SeqTokens]) -> list[SeqTokens]:
        """Deltas of colocated requests; a disaggregated request's ending is the decode side's to stream."""
        out = []
        for d in deltas:
            if d.rid in self._transfers:
                if d.finish_reason is not None:
                    self._transfers.discard(d.rid)
            else:
                out.append(d)
        return out

    def _reserve_states(self, seq: Sequence, points: list[int]) -> bool:
        # a hybrid model: the prompt's recurrent state leaves with its KV, saved where the prompt ends into a snapshot
        # slot the transfer holds until BlocksReleased (before any prefix-cache snapshot: none free, admitted later)
        if (seq.transfer_id is not None and self.blocks.num_state_snapshots
                and self.blocks.reserve_snapshot(seq.rid, len(seq.prompt_ids), owned=True) < 0):
            return False
        return super()._reserve_states(seq, points)

    def _hand_off(self, seq: Sequence, tok: int, result: StepResult, row: int) -> bool:
        if seq.transfer_id is None:
            return False
        if self._released_early.pop(seq.transfer_id, 0) is None:  # nobody will read these blocks: no pin, no KVReady
            self._release(seq)
            self._transfers.discard(seq.rid)
            return True
        prompt_blocks = -(-len(seq.prompt_ids) // self.blocks.block_size)
        self.blocks.pin(seq.rid, seq.transfer_id)
        self.outbox.append(KVReadyEvent(
            transfer_id=seq.transfer_id, num_tokens=len(seq.prompt_ids), first_token=tok, src_engine=self.engine,
            block_size=self.blocks.block_size, block_ids=np.asarray(self.blocks.block_ids(seq.rid)[:prompt_blocks], dtype=np.int32),
            state_slot=self.blocks.pinned_state(seq.transfer_id), first_logprobs=_first_logprobs(seq, result, row),
            prompt_logprobs=None if seq.sampling.prompt_logprobs is None else prompt_logprobs(
                seq.prompt_ids, seq.prompt_parts, seq.sampling.prompt_logprobs)))
        self._release(seq)  # its table goes; the pin keeps the blocks until BlocksReleased
        self._transfers.discard(seq.rid)
        return True

    def _finish(self, seq: Sequence, reason: str) -> SeqTokens:
        released = self._released_early.pop(seq.transfer_id, 0) is None
        if seq.transfer_id is not None and not released:  # ended before the hand-off: the decode side must not wait
            self.outbox.append(KVReadyEvent(transfer_id=seq.transfer_id, block_ids=np.zeros(0, np.int32),
                                            num_tokens=0, first_token=-1, src_engine=self.engine,
                                            error=f"prefill ended: {reason}"))
        return super()._finish(seq, reason)

    def on_blocks_released(self, ev: BlocksReleasedEvent) -> None:
        if self.blocks.unpin(ev.transfer_id):
            return
        # no pin yet: the front end releases a transfer whose decode engine died before the hand-off, whose request
        # runs here or is still on its way (or one that ended here already: remembered for nothing, and forgotten)
        self._released_early[ev.transfer_id] = None
        if len(self._released_early) > ENDED_MEMORY:
            self._released_early.popitem(last=False)

    def released_before_arrival(self, transfer_id: str) -> bool:
        return self._released_early.pop(transfer_id, 0) is None


@dataclass(slots=True)
class _Transfer:
    seq: Sequence
    reserved: bool = False
    ready: KVReadyEvent | None = None
    migrating: bool = False
    aborted: bool = False


class DecodeBatchScheduler(BatchScheduler):
    """The decode engine's policy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transfers: dict[str, _Transfer] = {}
        self._early: dict[str, KVReadyEvent] = {}  # KVReady that overtook its request
        self._released: set[str] = set()  # aborted before KVReady: answer it with BlocksReleased at once
        self._ended: OrderedDict[str, None] = OrderedDict()
        """The last ENDED_MEMORY transfers that ended after their KVReady: a late KVReady for one of them (the
        front end's death notice crossing the MigrationDone) is dropped instead of waiting forever as early."""
        self.outbox: list[Message] = []
        """MigrateKVCmds for the migration actor and BlocksReleasedEvents for the prefill side."""
        self.ended: list[SeqTokens] = []
        """Deltas of requests that ended as they arrived (their KVReady, an error, came first): the actor streams
        them after add()."""

    def add(self, req: TokenizedRequest) -> bool:
        if req.transfer_id is None:
            return super().add(req)
        seq = self._register(req)  # admitted by its transfer, not through the waiting queue
        if seq is None:
            return False
        seq.transfer_id = req.transfer_id
        t = self.transfers[req.transfer_id] = _Transfer(seq=seq, ready=self._early.pop(req.transfer_id, None))
        if t.ready is not None and t.ready.error is not None:  # the prefill side failed (or died) already
            self.ended.append(self._end(t, "error"))
            return True
        self._advance(t)
        return True

    def refuse(self, transfer_id: str) -> None:
        """A transfer's request was refused here (queue full): answer its KVReady with BlocksReleased."""
        if self._early.pop(transfer_id, None) is not None:
            self.outbox.append(BlocksReleasedEvent(transfer_id=transfer_id))
        else:
            self._released.add(transfer_id)

    def on_kv_ready(self, ev: KVReadyEvent) -> list[SeqTokens]:
        t = self.transfers.get(ev.transfer_id)
        if t is None:
            if self._ended.pop(ev.transfer_id, 0) is None:  # it ended already: a stale notice
                return []
            if ev.transfer_id in self._released:  # the request was aborted first
                self._released.discard(ev.transfer_id)
                self.outbox.append(BlocksReleasedEvent(transfer_id=ev.transfer_id))
            else:
                self._early[ev.transfer_id] = ev
            return []
        if t.ready is not None:  # a second KVReady: the front end's word that the prefill engine died
            if ev.error is None:
                return []
            if t.migrating:  # the read fails or lands; the blocks wait for its MigrationDone
                t.aborted = True
                return []
            return [self._end(t, "error")]
        if ev.error is None and ev.block_size != self.blocks.block_size:
            ev = msgspec.structs.replace(ev, error=f"block size {ev.block_size} on the prefill side, "
                                                   f"{self.blocks.block_size} here: the KV cannot be moved")
        elif ev.error is None and (ev.state_slot >= 0) != bool(self.blocks.num_state_snapshots):
            ev = msgspec.structs.replace(ev, error="one engine's model keeps a recurrent state and the other's does "
                                                   "not: the engines serve different models")
        t.ready = ev
        if ev.error is not None:
            return [self._end(t, "error")]
        self._advance(t)
        return []

    def on_migration_done(self, ev: MigrationDoneEvent) -> list[SeqTokens]:
        t = self.transfers.get(ev.transfer_id)
        if t is None or not t.migrating:
            return []
        t.migrating = False
        if t.aborted or ev.error is not None:
            return [self._end(t, "abort" if t.aborted else "error")]
        seq, ready = t.seq, t.ready
        del self.transfers[ev.transfer_id]
        self._remember_ended(ev.transfer_id)
        self.outbox.append(BlocksReleasedEvent(transfer_id=ev.transfer_id))
        seq.num_computed = seq.num_done = ready.num_tokens
        self.blocks.commit(seq.rid, seq.cache_ids(), ready.num_tokens)  # (before the first token: the prompt)
        seq.state_snapshot = self.blocks.resume_own_state(seq.rid)  # (a hybrid model: the migrated state)
        seq.output_ids.append(ready.first_token)
        delta = self._delta(seq, [ready.first_token])
        delta.prompt_logprobs = ready.prompt_logprobs
        first = ready.first_logprobs
        if first is not None and seq.sampling.logprobs is not None:
            k = seq.sampling.logprobs
            delta.logprobs, delta.top_ids, delta.top_logprobs = [first.logprob], [first.top_ids[:k]], [
                first.top_logprobs[:k]]
        reason = self._stop_reason(seq, ready.first_token)
        if reason is not None:
            delta.finish_reason = reason
            stopped_by_id = reason == "stop" and ready.first_token in seq.sampling.stop_token_ids  # (not EOS)
            delta.stop_token = ready.first_token if stopped_by_id else None
            self._release(seq)
        else:
            self.running.append(seq)  # in_worker is False: the next plan sends it in full
        return [delta]

    def abort(self, rid: str) -> SeqTokens | None:
        seq = self.seqs.get(rid)
        t = self.transfers.get(seq.transfer_id) if seq is not None and seq.transfer_id else None
        if t is None:
            return super().abort(rid)
        if t.migrating:  # the migration writes into its blocks: finish when it reports
            t.aborted = True
            return None
        return self._end(t, "abort")

    def schedule(self):
        for t in list(self.transfers.values()):
            if not t.reserved:
                self._advance(t)
        return super().schedule()

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running) - len(self.transfers)

    def _advance(self, t: _Transfer) -> None:
        if t.ready is None or t.migrating:
            return  # nothing is reserved before the prompt is computed (the module docstring says why)
        seq = t.seq
        if not t.reserved:
            alloc = self.blocks.allocate(seq.rid, seq.cache_ids(), num_new_tokens=None)
            if alloc is None:
                return  # retried at the next schedule()
            # a hybrid model: the prompt's recurrent state is migrated too, into a snapshot slot this sequence holds
            # until its first step resumes it
            if self.blocks.num_state_snapshots and self.blocks.own_state(seq.rid) < 0:
                self.blocks.free(seq.rid)
                return  # likewise
            t.reserved = True
            seq.num_cached = alloc.num_cached_tokens
        skip = seq.num_cached // self.blocks.block_size  # blocks our own prefix cache already holds
        table = self.blocks.block_ids(seq.rid)
        pages = len(t.ready.block_ids)
        self.outbox.append(MigrateKVCmd(transfer_id=t.ready.transfer_id, src_engine=t.ready.src_engine,
                                        src_block_ids=t.ready.block_ids[skip:pages],
                                        dst_block_ids=np.asarray(table[skip:pages], dtype=np.int32),
                                        src_state_slot=t.ready.state_slot, dst_state_slot=self.blocks.state_of(seq.rid)))
        t.migrating = True

    def _remember_ended(self, transfer_id: str) -> None:
        self._ended[transfer_id] = None
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _end(self, t: _Transfer, reason: str) -> SeqTokens:
        """Finish a transfer that will not decode; the prefill side is told it may release."""
        tid = t.seq.transfer_id
        self.transfers.pop(tid, None)
        if t.ready is not None:
            self._remember_ended(tid)
            self.outbox.append(BlocksReleasedEvent(transfer_id=tid))
        else:
            self._released.add(tid)  # its KVReady is still to come: answer that one
        return self._finish(t.seq, reason)


def _first_logprobs(seq: Sequence, result: StepResult, row: int) -> FirstTokenLogprobs | None:
    """The handed-off token's logprobs, for the decode engine's first delta (when the request asked)."""
    if result.logprobs is None or seq.sampling.logprobs is None:
        return None
    return FirstTokenLogprobs(logprob=float(result.logprobs[row]), top_ids=result.top_ids[row].tolist(),
                              top_logprobs=result.top_logprobs[row].tolist())
