"""MTP speculative decoding, the worker's side: draft with the model's multi-token-prediction layer (DeepSeek-V3's,
models/deepseek_v3.py; Qwen3.5's, models/qwen3_5_moe.py), verify with the main model. actors/batching.py plans the
steps.

A decoding sequence comes to a step with its last token and k drafts (k <= num_speculative_tokens), at
positions L-1 .. L-1+k. The main model runs them as one chunk and samples a token y_j at each of the k+1
positions, exactly as plain decoding would sample there (the same sampler, the same generation index, so a
seeded request draws the same noise). Draft j+1 stands at position L+j; y_j was sampled from the logits of a
prefix that holds drafts 1..j, so y_j is the true next token as long as drafts 1..j equal y_0..y_{j-1}. The
step keeps y_0 .. y_a, where a is the number of leading drafts that equal the token sampled before them: a
accepted drafts plus the bonus token y_a. This is exact for greedy (y_j is the argmax) and for sampling: the
kept tokens are each drawn from the target distribution given the true prefix ("accept only when the draft
equals the sampled token"; the rejection-sampling rule of Leviathan et al. would accept more often when
temperature > 0, but needs the draft's distribution, while this rule keeps seeded requests bit-identical to
plain decoding). Penalised requests get no drafts (their penalties would need each position's own history).

The MTP layer then runs over the step's positions: at position i it reads the main model's hidden state h_i
and the token at i+1 (the next prompt token, or y at sampled positions: y_j equals draft j+1 where that was
accepted, so one pass serves every row and rejected rows only write KV past the accepted end, overwritten
later). Its output at the last accepted position gives draft 1; drafts 2..N run the same layer again, one
position further each, on the previous draft and the layer's own output (as vLLM does), writing their KV in
the slots the scheduler reserved beyond the step (none is written past the table or max_model_len: the chain
stops there).

A step of decodes only hands its result to `publish` as soon as its tokens are known, before the MTP passes: the
worker sends it then, so the scheduler's planning and the round trip of the next plan overlap the drafting instead
of following it. The drafts are argmax tokens of the MTP head, kept on the host in SeqState.drafts. A uniform step
(every sequence decoding with all its drafts) replays CUDA graphs of the verify pass, the MTP pass and the draft
chain where the runner captured them (actors/spec_graphs.py): it is queued whole (SpecStep) and finished once its
sampled tokens are on the host, while the device still drafts. Its drafts stay on the device (PendingDrafts),
their copy to the host queued behind them: a next step of the same sequences, uniform again, reads them into its
verify inputs on the device and the host learns them when it finishes that step; any other step waits for the
copy first.

Steps in flight (`defer`, set where the scheduler plans ahead: actors/batching.py _plan_ahead): the next uniform
step of the same decodes is planned as if this one accepted every draft, and launched before the host has this
one's tokens. Its verify reads this step's accepted counts on the device and corrects each sequence's positions,
slots and context length by the drafts it rejected, takes as its last token the one sampled after the last
accepted draft, and its drafts as they are; a hybrid model's states are rolled back on the device too, from the
history rows. The host checks the drafts when it finishes the steps, in order (vLLM's "zero-bubble" speculation is
the same idea). A step that needs the host's word first (a grammar's mask, a seed's generation index, a prefill)
finishes the one before it first.

A hybrid model's delta nets (Qwen3.5) carry a recurrent state that a rejected draft would leave advanced: the
verify pass keeps the state after each token of a drafting sequence in rows of the state pools, and the slot gets
back the one after its last accepted token (vLLM keeps per-draft states the same way). A step where every sequence
verifies its drafts hands the delta nets those rows on the device too (AttentionMetadata.verify_history): their
decode kernels then run the step token by token, without the reference's host loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from flotilla.actors.data_parallel_worker import mtp_expert_layers
from flotilla.actors.prompt_logprobs import PromptScores, score_prompts
from flotilla.actors.spec_graphs import SpecGraphs
from flotilla.config import EngineConfig
from flotilla.kernels.attention import AttentionMetadata, positions_from_lists
from flotilla.kernels.sampling import SamplerOutput, SamplingTensors, sample
from flotilla.kernels.staging import upload
from flotilla.models.hf_config import load_hf_config
from flotilla.models.parallel import broadcast_from_first
from flotilla.transport.messages import StepResult
from safetensors import safe_open

if TYPE_CHECKING:
    from flotilla.actors.model_runner import ModelRunner
    from flotilla.actors.seq_state import SeqState

DraftHook = Callable[[np.ndarray, int, Callable[[], list[int]]], list[int]]
"""(a sequence's tokens so far, how many drafts the MTP layer made, a function giving them) -> the drafts to verify
instead (tests and bench_mtp force acceptance). The function makes the host wait for the drafts: a hook that
forces them without calling it keeps a graph step's drafting overlapped with the next step's staging."""
DeviceDraftHook = Callable[[list["SeqState"], torch.Tensor, int], torch.Tensor]
"""(a step's sequences, each one's last accepted position [B] on the device, k) -> the k drafts [B, k] for the next
step (from that position + 2 on), on the device."""


def check_speculative_config(config: EngineConfig) -> None:
    """Refuse a speculative_config the engine cannot serve, with the reason (ValueError / NotImplementedError)."""
    spec = config.scheduler.speculative_config
    if spec is None:
        return
    if config.model.model is None:
        raise ValueError("speculative method 'mtp' needs a model with multi-token-prediction layers (DeepSeek-V3's "
                         "num_nextn_predict_layers); the embedded default model has none")
    hf = load_hf_config(config.model.model)
    if hf.num_nextn_predict_layers < 1 or (hf.mla is None and hf.linear_attention is None and hf.deepseek_v4 is None):
        raise ValueError(f"speculative method 'mtp' needs a model with multi-token-prediction layers (DeepSeek-V3's "
                         f"num_nextn_predict_layers or Qwen3.5's mtp_num_hidden_layers in config.json); "
                         f"{config.model.model} ({', '.join(hf.architectures) or hf.model_type}) has none")
    if hf.linear_attention is not None:  # Qwen3.5: `mtp.*`
        layer, first = re.compile(r"^(?:model\.)?mtp\.fc\."), "mtp.fc.weight"
    elif hf.deepseek_v4 is not None:  # DeepSeek-V4: `mtp.0.*`
        layer, first = re.compile(r"^(?:model\.)?mtp\.0\.e_proj\."), "mtp.0.e_proj.weight"
    else:  # DeepSeek-V3: the layer after the decoder stack
        layer = re.compile(rf"^(?:model\.)?layers\.{hf.num_hidden_layers}\.eh_proj\.")
        first = f"model.layers.{hf.num_hidden_layers}.eh_proj.weight"
    if config.model.load_format != "dummy" and not any(map(layer.match, _checkpoint_names(Path(config.model.model)))):
        raise ValueError(f"speculative method 'mtp': {config.model.model} declares multi-token-prediction layers but "
                         f"its checkpoint has no MTP layer (no {first})")


def _checkpoint_names(model_dir: Path) -> list[str]:
    """Tensor names of a safetensors folder, from the index or the files' headers (no tensor is read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


class PendingDrafts:
    """A graph step's drafts, still on the device: [B, k] (rows in the step's order), their copy to the host queued
    behind the draft graph, and the accepted counts the draft graph must agree with (the host's, checked when they
    land). A step launched before the host knows them (SpecStep, chained) reads the draft graph's accepted counts and
    the step's sampled tokens from here too."""

    __slots__ = ("_landed", "accepted", "device", "event", "host", "out", "sampled", "seqs")

    def __init__(self, seqs: list[SeqState], out: torch.Tensor, sampled: torch.Tensor) -> None:
        """out: the draft graph's [B, 1 + k] (accepted count, drafts) on the device; sampled: the step's [B * (k + 1)]
        sampled tokens."""
        self.seqs, self.sampled, self.accepted = seqs, sampled, None
        self.out = out.clone()  # (the graph's output buffer is rewritten by its next replay)
        self.device = self.out[:, 1:]
        cuda = out.device.type == "cuda"
        self.host = self.out.to("cpu", non_blocking=cuda, copy=True)
        self.event, self._landed = None, None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def rows(self, seqs: list[SeqState]) -> np.ndarray | None:
        """Each of `seqs`' row, None unless every one of them has drafts here."""
        index = {id(s): i for i, s in enumerate(self.seqs)}
        rows = [index.get(id(s)) for s in seqs]
        return None if None in rows else np.asarray(rows, dtype=np.int64)

    def landed(self) -> np.ndarray:
        """[B, k] on the host, once the copy has landed (the first call waits for it)."""
        if self._landed is None:
            if self.event is not None:
                self.event.synchronize()
            host = self.host.numpy()
            if self.accepted is not None and not np.array_equal(host[:, 0], self.accepted):
                raise RuntimeError(f"the draft graph counted {host[:, 0].tolist()} accepted drafts, the host "
                                   f"{self.accepted.tolist()}")
            self._landed = host[:, 1:]
        return self._landed

    def settle(self) -> None:
        """Each sequence's drafts into SeqState.drafts (waiting for them if they have not landed)."""
        for s, d in zip(self.seqs, self.landed().tolist()):
            s.drafts = d


class SpecStep:
    """A uniform speculating step in the step graphs (MTPSpeculator.launch_uniform), queued on the device: verify,
    sampling, the sampled tokens' copy to the host, then the MTP passes that draft for the next step. finish() (the
    pending step's interface of actors/pending_step.py) waits for the sampled tokens, checks the drafts and settles
    the accepted tokens. A chained step was launched before the one it follows had finished on the host: its inputs
    (positions, slots, context lengths, last token and drafts) were corrected on the device from that step's
    accepted counts, and the host checks its drafts once that step is finished."""

    def __init__(self, spec: MTPSpeculator, step: int, rids: list[str], seqs: list[SeqState], cached: np.ndarray,
                 ids: np.ndarray, source: tuple[SpecStep | None, np.ndarray | None], chained: bool) -> None:
        self.spec, self.step, self.rids, self.seqs, self.cached, self.ids = spec, step, rids, seqs, cached, ids
        self.source, self.chained = source, chained
        self.result: StepResult | None = None
        self.event: torch.cuda.Event | None = None
        self.host: list[torch.Tensor] = []
        self.drafts: PendingDrafts | None = None
        self.history: np.ndarray | None = None
        """A hybrid model: the state-pool row of each verify token's state."""
        self.rolled_back = False
        """A hybrid model's states already rolled back on the device (roll_back_on_device)."""

    @property
    def finished(self) -> bool:
        return self.result is not None

    def finish(self, publish: bool = False) -> StepResult:
        """The step's result (computed once: a later step may have finished it already). publish: hand it to the
        speculator's publish hook as soon as it is known (a step finished at launch)."""
        if self.result is not None:
            return self.result
        spec, seqs, k = self.spec, self.seqs, self.spec.num_speculative_tokens
        q, batch = k + 1, len(self.seqs)
        last, rows = self.source
        if rows is not None:  # its last token and drafts came from the device: the host learns them now
            if self.chained:
                last.finish()
                self.ids.reshape(batch, q)[:, 0] = [s.buffer[s.length - 1] for s in seqs]
            last.drafts.settle()  # (the step before's other sequences' drafts too, for a later eager step)
            self.ids.reshape(batch, q)[:, 1:] = last.drafts.landed()[rows]
        if self.event is not None:
            self.event.synchronize()
        y = self.host[0].numpy()
        # leading drafts equal to the token sampled before them are accepted; the last row never checks one
        check = (self.ids.reshape(batch, q)[:, 1:] == y.reshape(batch, q)[:, :k])
        accepted = np.cumprod(check, axis=1).sum(axis=1).astype(np.int64)
        keep = (np.arange(q)[None, :] <= accepted[:, None]).reshape(-1)
        result = _settle_accepted(self.step, self.rids, seqs, [k] * batch, accepted, keep, self.host)
        self.result = result
        self.source = (None, None)  # (the step before is not needed any more)
        if publish and spec.publish is not None:
            spec.publish(result)
        drafts = self.drafts
        drafts.accepted = accepted
        if spec.draft_hook is not None:  # the hook's drafts, on the host: no later step reads these
            for i, s in enumerate(seqs):
                s.drafts = spec.draft_hook(s.tokens, k, lambda i=i: drafts.landed()[i].tolist())
            self.drafts = None
        if spec.runner.num_state_slots and not self.rolled_back:
            n = [q] * batch
            spec._roll_back(seqs, list(range(batch)), accepted, [k] * batch, n,
                            np.arange(0, batch * q + 1, q, dtype=np.int64), self.history)
        return result

    def roll_back_on_device(self) -> None:
        """A hybrid model, a chained step about to follow: each sequence's state slot gets the state after its last
        accepted token, from this step's history rows and the draft graph's accepted counts, on the device (finish
        then leaves the states alone)."""
        runner, k = self.spec.runner, self.spec.num_speculative_tokens
        accepted = self.drafts.out[:, 0]
        slots = upload(np.asarray([s.state_slot for s in self.seqs], dtype=np.int64), runner.device)
        rows = int(self.history[0]) + (k + 1) * torch.arange(len(self.seqs), device=accepted.device) + accepted
        # (all k accepted: the slot holds the last token's state already, and that token has no history row)
        runner.model.copy_state(torch.where(accepted < k, rows, slots), slots)
        self.rolled_back = True

    def release(self) -> None:
        """(Its drafts stay: the next step may read them on the device.)"""
        self.host = []


class MTPSpeculator:
    """Runs a whole step of a speculating runner: main forward, sampling, verification, MTP drafting."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.num_speculative_tokens = num_speculative_tokens
        self.graphs: SpecGraphs | None = None
        """CUDA graphs of uniform steps (the runner captures them when its decode steps may use graphs)."""
        self.draft_hook: DraftHook | None = None
        """Tests only: replaces the drafts (e.g. with the tokens plain decoding gives, to force acceptance)."""
        self.device_draft_hook: DeviceDraftHook | None = None
        """Tests and bench_mtp: replaces a graph step's drafts on the device, so that steps planned ahead still chain
        (a host hook makes the host wait for each step's tokens first), and an eager step's (a prefill's) too."""
        self.last: SpecStep | None = None
        """The last uniform step launched in the step graphs: its drafts stay on the device for the next one."""
        self.defer = False
        """Uniform steps come back unfinished (SpecStep): the next one may be launched before the host has their
        tokens (the scheduler plans it ahead; ModelRunner sets this where it can)."""
        self.publish: Callable[[StepResult], None] | None = None
        """Called (on the runner's thread) with a step of decodes only's result as soon as its tokens are known, before
        the MTP layer drafts: the worker sends it then, so that the scheduler plans the next step while the device
        drafts (a speculating step is planned only once the previous one's result is in)."""
        par = runner.config.parallel
        self.mtp_ep_layers = mtp_expert_layers(self.model) \
            if par.data_parallel_size > 1 and par.enable_expert_parallel else []  # fmt: skip
        """The MTP layer's expert-parallel layers when their all-to-alls span data-parallel ranks: every step then
        runs the MTP layer exactly num_speculative_tokens times on every rank (empty passes where a rank has no
        more drafts to make), as the ranks' all-to-alls must pair up."""

    def close(self) -> None:
        """Drop the model, the graphs and the runner (ModelRunner.close): a caller that kept this speculator, as
        bench_mtp did, must not keep the engine's device memory with it. Unusable afterwards."""
        self.__dict__.clear()

    @torch.inference_mode()
    def step(self, step: int, rids: list[str], seqs: list[SeqState], num_new: list[int]) -> StepResult | SpecStep:
        """Run a planned step: rids / seqs / num_new as the plan has them; cached blocks appended. A uniform step in
        the step graphs comes back as a SpecStep, finished already unless `defer`; any other step runs to its end."""
        r, k, g = self.runner, self.num_speculative_tokens, self.graphs
        last, self.last = self.last, None
        # every sequence decodes with all k drafts: the captured passes (actors/spec_graphs.py)
        graphable = g is not None and g.fits(len(seqs)) and all(n == k + 1 for n in num_new)
        if last is not None and not last.finished:
            rows = last.drafts.rows(seqs) if graphable and last.drafts is not None else None
            if rows is not None and self._chains(last, rows, seqs):
                return self.launch_uniform(step, rids, seqs, last, rows, chained=True)
            last.finish()
        cached = [s.num_computed for s in seqs]
        lengths = [s.length for s in seqs]
        if any(s.host_length != s.length for s in seqs):
            raise RuntimeError("a speculating step follows a step whose tokens the host has not settled")
        num_drafts = [max(c + n - length, 0) for c, n, length in zip(cached, num_new, lengths)]
        pending = last.drafts if last is not None else None
        if (graphable and all(d == k for d in num_drafts)
                and g.can_draft(np.asarray(cached, dtype=np.int64), [s.block_ids for s in seqs], r.max_model_len)):
            # the last graph step's drafts: read on the device by a uniform step of its sequences (a grammar masks
            # with the drafts on the host), otherwise onto the host first
            rows = pending.rows(seqs) if pending is not None else None
            if rows is None or any(s.grammar is not None for s in seqs):
                rows = None
                if pending is not None:
                    pending.settle()
            launched = self.launch_uniform(step, rids, seqs, last, rows, chained=False)
            return launched if self.defer else launched.finish(publish=True)
        if pending is not None:
            pending.settle()
        return self._eager_step(step, rids, seqs, num_new, cached, lengths, num_drafts)

    def _chains(self, last: SpecStep, rows: np.ndarray, seqs: list[SeqState]) -> bool:
        """Whether a uniform step of `seqs` (rows `rows` of the unfinished `last`) can be launched before the host
        knows what `last` accepted: the same decodes planned ahead (each one's KV as if every draft were accepted),
        nothing that needs the accepted tokens on the host first (a grammar, a seed's generation index, the tests'
        draft hook), and the whole draft chain's slots in every table."""
        r = self.runner
        cached = np.asarray([s.num_computed for s in seqs], dtype=np.int64)
        return bool(self.draft_hook is None
                    and all(s.grammar is None and s.sampling.seed is None for s in seqs)
                    and np.array_equal(cached, last.cached[rows] + self.num_speculative_tokens + 1)
                    and self.graphs.can_draft(cached, [s.block_ids for s in seqs], r.max_model_len))

    def launch_uniform(self, step: int, rids: list[str], seqs: list[SeqState], last: SpecStep | None,
                       rows: np.ndarray | None, chained: bool) -> SpecStep:
        """Queue a uniform step on the step graphs: verify, sampling, the sampled tokens' copy to the host, the MTP
        passes. rows: each sequence's row in `last`, whose drafts (chained: also its last token, and its positions
        corrected by what `last` accepted) the verify reads on the device; None: the drafts are on the host."""
        r, g, k = self.runner, self.graphs, self.num_speculative_tokens
        q, batch = k + 1, len(seqs)
        cached = np.asarray([s.num_computed for s in seqs], dtype=np.int64)
        tables = [s.block_ids for s in seqs]
        ids = np.zeros(batch * q, dtype=np.int64)
        if not chained:
            for i, s in enumerate(seqs):
                ids[i * q] = s.buffer[cached[i]]  # its last token (a decode: cached = length - 1)
                if rows is None:  # drafts the MTP layer left (missing ones are 0: a wrong draft is rejected)
                    drafts = s.drafts[:k]
                    ids[i * q + 1:i * q + 1 + len(drafts)] = drafts
        launched = SpecStep(self, step, rids, seqs, cached, ids, (last, rows), chained)
        if chained and r.num_state_slots:  # the states `last` left, rolled back before this verify reads them
            last.roll_back_on_device()
        state_slots = None
        if r.num_state_slots:  # a hybrid model: the graph's delta nets keep each token's state too (_roll_back)
            state_slots = np.asarray([s.state_slot for s in seqs], dtype=np.int64)
            launched.history = g.history_rows(batch)
        source = None if rows is None else (last.drafts.out, last.drafts.sampled, rows, chained)
        hidden = g.verify(ids, cached, tables, drafts=source, state_slots=state_slots)
        for s in seqs:
            s.num_computed += q
        samplers = list(range(batch))
        seg = np.full(batch, q, dtype=np.int64)
        out, want = self._sample(seqs, samplers, seg, np.tile(np.arange(q, dtype=np.int64), batch), hidden)
        # the sampled tokens' (and logprobs') copies are queued before the MTP passes (behind them they would wait
        # for them), which then run while the host checks the drafts and the result goes out
        cuda = out.token_ids.device.type == "cuda"
        launched.host = [t.to("cpu", non_blocking=cuda) for t in (out.token_ids, *(
            () if want is None else (out.logprobs.float(), out.top_token_ids, out.top_logprobs.float())))]
        if cuda:
            launched.event = torch.cuda.Event()
            launched.event.record()
        g.propose(out.token_ids)  # the token ahead of every row is the one sampled at it
        drafted = g.draft(cached, tables)
        if self.device_draft_hook is not None:
            drafted = drafted.clone()
            at = g.positions[:batch * q].view(batch, q)[:, 0] + drafted[:, 0]  # each one's last accepted position
            drafted[:, 1:] = self.device_draft_hook(seqs, at, k)
        launched.drafts = PendingDrafts(seqs, drafted, out.token_ids)
        self.last = launched
        return launched

    def _eager_step(self, step: int, rids: list[str], seqs: list[SeqState], num_new: list[int], cached: list[int],
                    lengths: list[int], num_drafts: list[int]) -> StepResult:
        """A step outside the step graphs, run to its end (its drafts made on the host's word)."""
        r, model = self.runner, self.model
        dev = r.device
        starts = np.concatenate(([0], np.cumsum(num_new))).astype(np.int64)
        tables = [s.block_ids for s in seqs]
        ids = np.zeros(int(starts[-1]) + 1, dtype=np.int64)  # one spare: ids[f + 1] is read below
        for s, c, n, d, at in zip(seqs, cached, num_new, num_drafts, starts.tolist()):
            known = c + n - d
            ids[at:at + known - c] = s.buffer[c:known]
            if d:  # drafts the MTP layer left (missing ones are 0: a wrong draft is rejected)
                drafts = s.drafts[:d]
                ids[at + known - c:at + known - c + len(drafts)] = drafts
        meta = AttentionMetadata.from_lists(cached, num_new, tables, r.block_size, device=dev)
        positions = positions_from_lists(cached, num_new, device=dev)
        history = None
        if r.num_state_slots:  # a hybrid model: its delta nets keep each verify token's state (_roll_back)
            meta.state_slots = upload(np.asarray([s.state_slot for s in seqs], dtype=np.int64), dev)
            history = meta.state_history = self._history_rows(num_new, num_drafts, starts)
            if history is not None and all(d > 0 and n == num_new[0] for n, d in zip(num_new, num_drafts)):
                meta.verify_history = upload(history.reshape(len(seqs), num_new[0]), dev)  # (every token has one)
        hidden = model(upload(ids[:-1], dev), positions, r.kv_caches, meta)
        scores = score_prompts(model.compute_logits, hidden, rids, seqs, cached, num_new,
                               r.config.scheduler.max_num_seqs)
        for s, n in zip(seqs, num_new):
            s.num_computed += n

        # every position at or past a sampling sequence's last known token samples: the bonus and the checks
        samplers = [i for i, (c, n, length) in enumerate(zip(cached, num_new, lengths)) if c + n >= length]
        seg = np.asarray([num_drafts[i] + 1 for i in samplers], dtype=np.int64)
        seg_start = np.concatenate(([0], np.cumsum(seg)))[:-1].astype(np.int64)
        local = np.arange(int(seg.sum())) - np.repeat(seg_start, seg)  # row index within its sequence
        first = np.asarray([starts[i] + lengths[i] - 1 - cached[i] for i in samplers], dtype=np.int64)
        rows = np.repeat(first, seg) + local  # flat positions of the sampled rows

        mtp_ids = ids[1:].copy()  # the token one position ahead of each input
        for i, (s, c, n, length) in enumerate(zip(seqs, cached, num_new, lengths)):
            if c + n < length:  # a prefill chunk that ends inside the prompt: the next prompt token
                mtp_ids[starts[i + 1] - 1] = s.buffer[c + n]
        if not samplers:
            model.mtp_forward(upload(mtp_ids, dev), positions, hidden, r.kv_caches, meta)  # its KV only
            self._pad_mtp_passes(1)
            return _with_scores(StepResult(step=step), scores)

        out, want = self._sample(seqs, samplers, seg, local, hidden[upload(rows, dev)])
        # a step of decodes only is published before it drafts (see publish); one with prompt tokens is not: the
        # scheduler may hand such a prompt's KV (the MTP layer's and a hybrid model's states among it) to another engine
        # as soon as its result is in
        publish = self.publish if self.publish is not None and all(
            n - d == 1 and s.length > s.num_prompt_tokens for s, n, d in zip(seqs, num_new, num_drafts)) else None
        host = [out.token_ids.cpu()] if want is None else \
            [out.token_ids.cpu(), out.logprobs.float().cpu(), out.top_token_ids.cpu(), out.top_logprobs.float().cpu()]  # fmt: skip
        y = host[0].numpy()
        # leading drafts equal to the token sampled before them are accepted; the last row never checks one
        check = (ids[rows + 1] == y) & (local < np.repeat(seg, seg) - 1)
        accepted = np.minimum.reduceat(np.where(check, len(y), local), seg_start)
        keep = local <= np.repeat(accepted, seg)

        result = _settle_accepted(step, [rids[i] for i in samplers], [seqs[i] for i in samplers],
                                  [num_drafts[i] for i in samplers], accepted, keep, host)
        result = _with_scores(result, scores)
        if publish is not None:
            publish(result)

        # the drafts of the next step (and a hybrid model's states back to the accepted tokens)
        mtp_ids[rows] = y  # at sampled positions the next token is the one sampled there
        mtp_hidden = model.mtp_forward(upload(mtp_ids, dev), positions, hidden, r.kv_caches, meta)
        last = rows[seg_start + accepted]  # each sequence's row of its last accepted position
        first = np.asarray(lengths)[samplers] - 1 + accepted  # and that position
        drafts = self._draft(mtp_hidden[upload(last, dev)], [seqs[i] for i in samplers], first.tolist())
        if self.device_draft_hook is not None:  # (so that the graph steps' first drafts are forced too)
            forced = self.device_draft_hook([seqs[i] for i in samplers], upload(first, dev),
                                            self.num_speculative_tokens).tolist()
            drafts = [f[:len(d)] for f, d in zip(forced, drafts)]
        for i, d in zip(samplers, drafts):
            s = seqs[i]
            s.drafts = d if self.draft_hook is None else self.draft_hook(s.tokens, len(d), lambda d=d: d)
        if r.num_state_slots:
            self._roll_back(seqs, samplers, accepted, num_drafts, num_new, starts, history)
        return result

    def _history_rows(self, num_new: list[int], num_drafts: list[int], starts: np.ndarray) -> np.ndarray | None:
        """int64 [T]: a state-pool row per token of a sequence that verifies drafts (-1 elsewhere); None without
        drafts. The rows follow the running slots and the snapshots (ModelRunner.state_history_rows)."""
        if not any(num_drafts):
            return None
        r = self.runner
        history = np.full(int(starts[-1]), -1, dtype=np.int64)
        row = r.num_state_slots + r.num_state_snapshots
        for i in np.flatnonzero(num_drafts).tolist():
            history[starts[i]:starts[i] + num_new[i]] = np.arange(row, row + num_new[i])
            row += num_new[i]
        return history

    def _roll_back(self, seqs: list[SeqState], samplers: list[int], accepted: np.ndarray, num_drafts: list[int],
                   num_new: list[int], starts: np.ndarray, history: np.ndarray | None) -> None:
        """A hybrid model's recurrent states back to where each sequence's accepted tokens end: the slot holds the
        state after its last draft; one that rejected some gets the state after its last accepted one."""
        src, dst = [], []
        for i, a in zip(samplers, accepted.tolist()):
            if a < num_drafts[i]:  # token a of the drafts' part (the last known token is draft part's -1)
                src.append(int(history[starts[i] + num_new[i] - num_drafts[i] - 1 + a]))
                dst.append(seqs[i].state_slot)
        if src:
            self.runner.copy_states(src, dst)

    def _sample(self, seqs: list[SeqState], samplers: list[int], seg: np.ndarray, local: np.ndarray,
                hidden: torch.Tensor):
        """Sample every checked position as plain decoding would sample it (generation index included)."""
        r = self.runner
        owner = np.repeat(np.asarray(samplers), seg).tolist()
        params = [seqs[i].sampling for i in owner]
        gen = [seqs[i].length - seqs[i].num_prompt_tokens + j for i, j in zip(owner, local.tolist())]
        history = any(seqs[i].needs_history for i in samplers)
        logits = self.model.compute_logits(hidden)
        if r.rank == 0:  # (structured outputs: row j of a sequence masked for the position after its drafts[:j])
            r.mask_grammars(logits, [seqs[i] for i in owner], verify=True)
        if r.rank != 0:  # tensor parallelism: rank 0 samples for the group and every rank verifies its tokens
            return SamplerOutput(token_ids=broadcast_from_first(
                torch.empty(len(owner), dtype=torch.int64, device=r.device))), None
        st = SamplingTensors.build(
            params, gen, device=r.device, vocab_size=logits.shape[1],
            prompt_token_ids=[seqs[i].tokens[:seqs[i].num_prompt_tokens] for i in owner] if history else None,
            output_token_ids=[seqs[i].tokens[seqs[i].num_prompt_tokens:] for i in owner] if history else None)
        want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        out = sample(logits, st, want, generator=r.generator)
        broadcast_from_first(out.token_ids)  # (int64; a no-op without tensor parallelism)
        return out, want

    def _draft(self, hidden: torch.Tensor, seqs: list[SeqState], positions: list[int]) -> list[list[int]]:
        """Drafts for the next step: the MTP head on `hidden` (its output at each sequence's last accepted
        position), then the layer again, one position further each time, on its own draft and output."""
        r, model = self.runner, self.model
        bs = r.block_size
        tokens = model.mtp_logits(hidden).argmax(dim=-1)
        drafts = [[t] for t in tokens.tolist()]
        live = np.arange(len(seqs))
        passes = 1  # the verify pass's MTP forward
        for _ in range(self.num_speculative_tokens - 1):
            pos = [positions[i] + len(drafts[i]) for i in live.tolist()]
            ok = np.asarray([p < r.max_model_len and p // bs < len(seqs[i].block_ids)
                             for i, p in zip(live.tolist(), pos)], dtype=bool)
            if not ok.all():  # no KV slot reserved there (or past the model's length): its chain stops
                sel = upload(np.flatnonzero(ok), r.device)
                live, tokens, hidden = live[ok], tokens[sel], hidden[sel]
                pos = [p for p, good in zip(pos, ok.tolist()) if good]
            if not len(live):
                break
            meta = AttentionMetadata.from_lists(pos, [1] * len(pos), [seqs[i].block_ids for i in live.tolist()], bs,
                                                device=r.device)
            positions_t = positions_from_lists(pos, [1] * len(pos), device=r.device)
            hidden = model.mtp_forward(tokens, positions_t, hidden, r.kv_caches, meta)
            passes += 1
            tokens = model.mtp_logits(hidden).argmax(dim=-1)
            for i, t in zip(live.tolist(), tokens.tolist()):
                drafts[i].append(t)
        self._pad_mtp_passes(passes)
        return drafts

    def _pad_mtp_passes(self, done: int) -> None:
        """Under data-parallel expert parallelism: the MTP layer's all-to-alls with no tokens until this step ran it
        num_speculative_tokens times (see mtp_ep_layers)."""
        for _ in range(self.num_speculative_tokens - done):
            for layer in self.mtp_ep_layers:
                layer.empty_step()


def _settle_accepted(step: int, rids: list[str], seqs: list[SeqState], num_drafts: list[int], accepted: np.ndarray,
                     keep: np.ndarray, host: list[torch.Tensor]) -> StepResult:
    """Each sampling sequence's accepted drafts and bonus token onto the host (its rejected drafts' KV recomputed
    from here on), and the step's result; host: the sampled tokens [N], then logprobs, top ids and top logprobs of
    every row when asked for; keep: the rows kept."""
    tokens = host[0].numpy()[keep].astype(np.int32)
    at = 0
    for s, d, a in zip(seqs, num_drafts, accepted.tolist()):
        s.num_computed -= d - a
        s.length += a + 1
        for t in tokens[at:at + a + 1].tolist():
            s.settle(t)
        at += a + 1
    result = StepResult(step=step, rids=rids, token_ids=tokens, num_tokens=(accepted + 1).astype(np.int32))
    if len(host) > 1:
        result.logprobs = host[1].numpy()[keep]
        result.top_ids = host[2].numpy().astype(np.int32)[keep]
        result.top_logprobs = host[3].numpy()[keep]
    return result


def _with_scores(result: StepResult, scores: PromptScores | None) -> StepResult:
    """The step's prompt logprobs into its result (a speculative step returns when its work is done)."""
    if scores is not None:
        scores.to_host(blocking=True)
        scores.fill(result)
    return result
