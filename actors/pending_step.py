"""A launched step's results on their way to the host, and the tokens a step feeds that only the device knows yet.

The worker launches step N+1 before step N's sampled tokens reach the host (actors/model_runner.py): PendingStep
holds N's tokens (and logprobs, prompt scores) while their copy to the host runs, and a Patch writes the tokens of
N into N+1's input ids on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from flotilla.actors.prompt_logprobs import PromptScores
from flotilla.kernels.sampling import SamplerOutput
from flotilla.kernels.staging import upload
from flotilla.transport.messages import StepResult

if TYPE_CHECKING:
    from flotilla.actors.seq_state import SeqState


class PendingStep:
    """A launched step: its sampled tokens on the device and their copy to the host in flight."""

    __slots__ = ("step", "rids", "seqs", "out", "host", "event", "logprobs", "prompt", "result")

    @classmethod
    def done(cls, result: StepResult) -> PendingStep:
        p = cls()
        p.step, p.result, p.event = result.step, result, None
        return p

    @classmethod
    def launch(cls, step: int, rids: list[str], seqs: list[SeqState], out: SamplerOutput | None, logprobs: bool,
               device: torch.device, prompt: PromptScores | None = None) -> PendingStep:
        """out: None when the step sampled nothing (a prefill chunk that only scored its prompt tokens)."""
        p = cls()
        p.step, p.rids, p.seqs, p.out, p.logprobs, p.prompt, p.result = step, rids, seqs, out, logprobs, prompt, None
        blocking = device.type != "cuda"
        p.host = [] if out is None else [out.token_ids.to("cpu", torch.int32, non_blocking=not blocking)]
        if prompt is not None:
            prompt.to_host(blocking)
        if logprobs:
            p.host += [out.logprobs.float().to("cpu", non_blocking=not blocking),
                       out.top_token_ids.to("cpu", torch.int32, non_blocking=not blocking),
                       out.top_logprobs.float().to("cpu", non_blocking=not blocking)]
        p.event = None
        if not blocking:
            p.event = torch.cuda.Event()
            p.event.record()
        return p

    def finish(self) -> StepResult:
        if self.result is not None:
            return self.result
        if self.event is not None:
            self.event.synchronize()
        result = StepResult(step=self.step)
        if self.host:
            token_ids = self.host[0].numpy()
            for s, t in zip(self.seqs, token_ids.tolist()):
                s.settle(t)
            result.rids, result.token_ids = self.rids, token_ids
        if self.logprobs:
            result.logprobs, result.top_ids, result.top_logprobs = (t.numpy() for t in self.host[1:])
        if self.prompt is not None:
            self.prompt.fill(result)
        self.result = result
        return result

    def release(self) -> None:
        self.out = self.seqs = self.host = self.event = self.prompt = None


Patch = dict[int, tuple[torch.Tensor, list[int], list[int]]]
"""Tokens a step feeds that live only on the device: id(source tensor) -> (source, flat input indices, rows)."""


def add_patch(patch: Patch, index: int, src: torch.Tensor, row: int) -> None:
    entry = patch.get(id(src))
    if entry is None:
        entry = patch[id(src)] = (src, [], [])
    entry[1].append(index)
    entry[2].append(row)


def apply_patch(input_ids: torch.Tensor, patch: Patch, device: torch.device) -> None:
    """Write tokens that live only on the device into `input_ids` (one gather + scatter per source step; one copy
    where both sides are runs, as when a decode batch follows the step that sampled its tokens, rows in order)."""
    for src, dst, rows in patch.values():
        n = len(dst)
        if dst[-1] - dst[0] == n - 1 and rows == list(range(rows[0], rows[0] + n)):  # (dst only ever increases)
            input_ids[dst[0]:dst[0] + n].copy_(src[rows[0]:rows[0] + n])
            continue
        index = upload(np.array([dst, rows], dtype=np.int64), device)
        input_ids.index_copy_(0, index[0], src.index_select(0, index[1]).to(input_ids.dtype))
