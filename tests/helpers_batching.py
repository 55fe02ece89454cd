"""A fake GPU worker for scheduling tests: its KV cache records (position, token) per slot, so every read
of a wrong or missing KV is caught; and a deterministic 'model' to compute reference outputs."""

from __future__ import annotations

import zlib

import numpy as np

from flotilla.transport.messages import StepPlan, StepResult

VOCAB, EOS = 50, 7


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history (like greedy decoding)."""
    return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) % VOCAB


class FakeWorker:
    """Executes plans like the GPU worker; its KV cache stores (position, token) so reads can be checked. `hybrid`:
    also a recurrent state per sequence (the tokens it consumed), valid at one position only: saved into snapshot
    slots where the plan says, and a sequence with cached tokens must resume a snapshot of exactly those."""

    def __init__(self, num_blocks: int, block_size: int, hybrid: bool = False) -> None:
        self.bs = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.seqs: dict[str, dict] = {}
        self.hybrid = hybrid
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.resumed = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_rids:
            self.seqs.pop(rid, None)
        for ns in plan.new_seqs:
            self.seqs[ns.rid] = {"tokens": ns.token_ids.tolist(), "done": ns.num_computed_tokens,
                                 "blocks": ns.block_ids.tolist()}
            if self.hybrid and ns.num_computed_tokens:
                cached = tuple(ns.token_ids[:ns.num_computed_tokens].tolist())
                assert self.snapshots.get(ns.state_snapshot) == cached, f"{ns.rid}: resumed a wrong state"
                self.resumed += 1
        counts = plan.new_block_counts.tolist() if plan.new_block_counts is not None else [0] * len(plan.rids)
        appended = plan.new_block_ids.tolist() if plan.new_block_ids is not None else []
        at = 0
        sampled, tokens = [], []
        for rid, n, c in zip(plan.rids, (plan.num_new_tokens.tolist() if plan.rids else []), counts):
            s = self.seqs[rid]
            s["blocks"].extend(appended[at:at + c])
            at += c
            start = s["done"]
            assert start + n <= len(s["tokens"]), f"{rid}: asked to compute a token the worker does not know"
            for pos in range(start):  # the context it attends to is its own (or an identical prefix's)
                assert self.kv[self.slot(s, pos)] == (pos, s["tokens"][pos]), f"{rid}: wrong KV at {pos}"
            for pos in range(start, start + n):
                self.kv[self.slot(s, pos)] = (pos, s["tokens"][pos])
            s["done"] = start + n
            if s["done"] == len(s["tokens"]):
                tok = next_token(s["tokens"])
                s["tokens"].append(tok)
                sampled.append(rid)
                tokens.append(tok)
        if plan.state_save_rows is not None:
            for row, slot in zip(plan.state_save_rows.tolist(), plan.state_save_slots.tolist()):
                s = self.seqs[plan.rids[row]]
                self.snapshots[slot] = tuple(s["tokens"][:s["done"]])
        return StepResult(step=plan.step, rids=sampled, token_ids=np.asarray(tokens, dtype=np.int32))

    def slot(self, s: dict, pos: int) -> int:
        return s["blocks"][pos // self.bs] * self.bs + pos % self.bs


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    tokens = list(prompt)
    while len(out) < max_tokens:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if tok == EOS:
            break
    return out


