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


def prompt_score(tokens: list[int], k: int) -> tuple[float, int, list[int], list[float]]:
    """The 'model's score of tokens[-1] after tokens[:-1]: (logprob, rank, top k ids, their logprobs)."""
    h = zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes())
    return -(h % 1000) / 100, 1 + h % 5, [(h + j) % VOCAB for j in range(k)], [-j / 10 for j in range(k)]


def reference_prompt_scores(prompt: list[int], k: int) -> list[tuple[float, int, list[int], list[float]]]:
    """Every prompt token's score but the first's, as the first delta must carry them."""
    return [prompt_score(prompt[:p + 1], k) for p in range(1, len(prompt))]


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
                                 "blocks": ns.block_ids.tolist(), "prompt": len(ns.token_ids) - ns.num_output_tokens,
                                 "score": None if ns.num_output_tokens else ns.sampling.prompt_logprobs,
                                 "logprobs": ns.sampling.logprobs}
            if self.hybrid and ns.num_computed_tokens:
                cached = tuple(ns.token_ids[:ns.num_computed_tokens].tolist())
                assert self.snapshots.get(ns.state_snapshot) == cached, f"{ns.rid}: resumed a wrong state"
                self.resumed += 1
        counts = plan.new_block_counts.tolist() if plan.new_block_counts is not None else [0] * len(plan.rids)
        appended = plan.new_block_ids.tolist() if plan.new_block_ids is not None else []
        at = 0
        sampled, tokens, scored, logprobs = [], [], {}, []
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
            if s["score"] is not None and min(start + n, s["prompt"] - 1) > start:
                scored[rid] = [prompt_score(s["tokens"][:p + 2], s["score"])
                               for p in range(start, min(start + n, s["prompt"] - 1))]
            s["done"] = start + n
            if s["done"] == len(s["tokens"]):
                tok = next_token(s["tokens"])
                s["tokens"].append(tok)
                sampled.append(rid)
                tokens.append(tok)
                logprobs.append(prompt_score(s["tokens"], s["logprobs"] or 0))  # (the sampled token's, scored alike)
        if plan.state_save_rows is not None:
            for row, slot in zip(plan.state_save_rows.tolist(), plan.state_save_slots.tolist()):
                s = self.seqs[plan.rids[row]]
                self.snapshots[slot] = tuple(s["tokens"][:s["done"]])
        result = StepResult(step=plan.step, rids=sampled, token_ids=np.asarray(tokens, dtype=np.int32))
        want = [self.seqs[rid]["logprobs"] for rid in sampled if self.seqs[rid]["logprobs"] is not None]
        if want:  # as the sampler reports them: every row, k = the most any row asked for
            k = max(want)
            result.logprobs = np.asarray([lp[0] for lp in logprobs], dtype=np.float32)
            result.top_ids = np.asarray([(lp[2] + [0] * k)[:k] for lp in logprobs], dtype=np.int32).reshape(-1, k)
            result.top_logprobs = np.asarray([(lp[3] + [0.0] * k)[:k] for lp in logprobs],
                                             dtype=np.float32).reshape(-1, k)
        if scored:  # as the worker's prompt scoring reports them (actors/prompt_logprobs.py)
            rows = [row for part in scored.values() for row in part]
            k = max(len(row[2]) for row in rows)
            result.prompt_rids = list(scored)
            result.prompt_counts = np.asarray([len(p) for p in scored.values()], dtype=np.int32)
            result.prompt_logprobs = np.asarray([r[0] for r in rows], dtype=np.float32)
            result.prompt_ranks = np.asarray([r[1] for r in rows], dtype=np.int32)
            if k:
                result.prompt_top_ids = np.asarray([r[2] + [0] * (k - len(r[2])) for r in rows], dtype=np.int32)
                result.prompt_top_logprobs = np.asarray([r[3] + [0.0] * (k - len(r[3])) for r in rows],
                                                        dtype=np.float32)
        return result

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


