"""Prompt logprobs (completions' echo with logprobs, vLLM's prompt_logprobs): the prefill that computes a prompt's
KV also scores its tokens, so no second pass runs. The hidden state at prompt position p gives the distribution of
token p + 1; a chunk scores the positions it holds, and the scheduler joins a sequence's chunks in order.

Rows are scored in slices of at most max_num_seqs: the logits the memory profile made room for (a full decode
batch's sampling), so a long prompt chunk needs no more memory than a decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from flotilla.kernels.staging import upload
from flotilla.transport.messages import StepResult

if TYPE_CHECKING:
    from flotilla.actors.seq_state import SeqState


@dataclass(slots=True)
class PromptScores:
    """One step's scored prompt tokens, on the device until `to_host`; rows are rid after rid."""

    rids: list[str]
    counts: np.ndarray
    """Rows per rid, int32."""
    logprobs: torch.Tensor
    """[R] float32: each scored token's logprob."""
    ranks: torch.Tensor
    """[R] int32: its rank (1 = the most likely token)."""
    top_ids: torch.Tensor | None
    """[R, k] int32, the k most likely tokens (None for k = 0)."""
    top_logprobs: torch.Tensor | None
    """[R, k] float32, their logprobs."""
    host: list[torch.Tensor] = field(default_factory=list)

    def to_host(self, blocking: bool) -> None:
        """Start the copies to the host (the caller waits on its step's event before `fill`)."""
        parts = [self.logprobs, self.ranks] + ([self.top_ids, self.top_logprobs] if self.top_ids is not None else [])
        self.host = [t.to("cpu", non_blocking=not blocking) for t in parts]

    def fill(self, result: StepResult) -> None:
        """Put the scores into a step's result (after `to_host` and the step's event)."""
        result.prompt_rids = self.rids
        result.prompt_counts = self.counts
        arrays = [t.numpy() for t in self.host]
        result.prompt_logprobs, result.prompt_ranks = arrays[0], arrays[1]
        if len(arrays) > 2:
            result.prompt_top_ids, result.prompt_top_logprobs = arrays[2], arrays[3]


def score_prompts(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, rids: list[str],
                  seqs: list[SeqState], cached: list[int], num_new: list[int], max_rows: int) -> PromptScores | None:
    """Score the prompt tokens whose predecessors this step computed, for the sequences that asked
    (SeqState.prompt_logprobs); hidden [T, H] is the step's last hidden states, sequence after sequence. Every
    tensor-parallel rank calls it alike (the logits are gathered across ranks)."""
    parts = []
    at = 0
    for rid, s, c, n in zip(rids, seqs, cached, num_new):
        end = min(c + n, s.num_prompt_tokens - 1)  # (the last prompt position predicts the first output token)
        if s.prompt_logprobs is not None and end > c:
            parts.append((rid, s, at, c, end))
        at += n
    if not parts:
        return None
    rows = np.concatenate([np.arange(a, a + e - c) for _, _, a, c, e in parts])
    targets = np.concatenate([s.buffer[c + 1:e + 1] for _, s, _, c, e in parts])
    index = upload(np.stack([rows, targets]).astype(np.int64), hidden.device)
    k = max(s.prompt_logprobs for _, s, _, _, _ in parts)
    logprobs, ranks, top_ids, top_logprobs = [], [], [], []
    for start in range(0, len(rows), max(max_rows, 1)):
        cut = slice(start, start + max(max_rows, 1))
        lp = compute_logits(hidden[index[0, cut]]).log_softmax(dim=-1)
        chosen = lp.gather(1, index[1, cut].unsqueeze(1))
        logprobs.append(chosen.squeeze(1))
        ranks.append((lp > chosen).sum(dim=-1).add_(1).to(torch.int32))
        if k:
            top = lp.topk(min(k, lp.shape[1]), dim=-1, sorted=True)
            top_ids.append(top.indices.to(torch.int32))
            top_logprobs.append(top.values)
    return PromptScores(rids=[p[0] for p in parts], counts=np.asarray([e - c for *_, c, e in parts], dtype=np.int32),
                        logprobs=torch.cat(logprobs), ranks=torch.cat(ranks),
                        top_ids=torch.cat(top_ids) if k else None, top_logprobs=torch.cat(top_logprobs) if k else None)
