"""DetokenizerActor: token ids -> text deltas, with stop strings, one TextDelta per step.

Per sequence it keeps an IncrementalDetokenizer (actors/incremental_detokenizer.py), created from the
sequence's first delta (which carries its sampling options and the prompt's last tokens). When a stop
string matches, the sequence ends here: the client gets its last text with finish_reason "stop", and
the scheduler gets an AbortCmd so the sequence stops computing and frees its blocks.

Text goes to the engine's front end, except a sequence's whose first delta names another one (`reply_to`: a
front end on another node routed the request here through the shared registry): one TextDelta per front end
and step. Such front ends are watched (actors/front_end_watch.py): the sequences of one that is gone are
aborted, as a client's disconnect aborts its own.
"""

from __future__ import annotations

import logging

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.front_end_watch import FrontEndWatch
from flotilla.actors.incremental_detokenizer import IncrementalDetokenizer, TokenizerInfo
from flotilla.models.model_folder import load_decoding_tokenizer, model_dir
from flotilla.config import EngineConfig
from flotilla.transport.channels import Outbox
from flotilla.transport.messages import AbortCmd, SeqText, SeqTokens, TextDelta, TokenDelta

log = logging.getLogger(__name__)


class DetokenizerActor(Actor):
    """Incremental detokenization for every running sequence of an engine."""

    kind = "detokenizer"
    inbox = (TokenDelta,)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.frontend = str(ctx.config.get("frontend", "frontend"))
        self.info: TokenizerInfo | None = None
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.counts: dict[str, int] = {}
        self.stopped: set[str] = set()
        """Sequences this actor ended on a stop string, until the scheduler's final delta for them."""
        self.routes: dict[str, tuple[str, int]] = {}
        """Sequences whose text goes to another node's front end: rid -> (its inbox, the sequence's data-parallel
        rank), until their final delta."""
        self.watch = FrontEndWatch(self._front_end_gone, self.config.disagg.frontend_grace_s)

    async def setup(self) -> dict[str, str]:
        if not self.config.model.skip_tokenizer_init:
            self.info = TokenizerInfo(load_decoding_tokenizer(model_dir(self.config)))
        return {}

    async def teardown(self) -> None:
        await self.watch.close()

    def _watch_front_end(self, address: str) -> None:
        """Open the outbox to another node's front end once, its monitor attached before it connects (so that the
        watch sees the connection)."""
        if address not in self._outboxes:
            out = Outbox(self.zmq, address, connect=False)
            self.watch.watch(address, out.sock)
            out.sock.connect(address)
            self._outboxes[address] = out

    async def _front_end_gone(self, address: str) -> None:
        """Another node's front end stopped listening: nobody reads its sequences, so they stop computing."""
        rids = [(rid, rank) for rid, (a, rank) in self.routes.items() if a == address]
        if rids:
            log.warning("aborting %d sequences of the front end at %s", len(rids), address)
        for rid, rank in rids:
            await self.send(self.scheduler, AbortCmd(rid=rid, dp_rank=rank), instance=rank)

    async def on_token_delta(self, msg: TokenDelta) -> None:
        out: dict[str | None, list[SeqText]] = {}  # front end (None: the engine's own) -> its sequences' text
        stopped: list[str] = []
        orphans: list[str] = []
        for item in msg.items:
            if item.reply_to is not None:
                self.routes[item.rid] = (item.reply_to, msg.dp_rank)
                self._watch_front_end(item.reply_to)
                if item.reply_to in self.watch.gone and item.finish_reason is None:
                    orphans.append(item.rid)
            route = self.routes.pop(item.rid, None) if item.finish_reason is not None else self.routes.get(item.rid)
            text = self._text(item, stopped)
            if text is not None:
                out.setdefault(route[0] if route else None, []).append(text)
        for address, items in out.items():
            await self.reply(address, TextDelta(items=items))
        for rid in orphans:  # its front end went away before its first token
            await self.send(self.scheduler, AbortCmd(rid=rid, dp_rank=msg.dp_rank), instance=msg.dp_rank)
        for rid in stopped:  # the scheduler (of the sequence's data-parallel rank) stops computing it, frees its blocks
            await self.send(self.scheduler, AbortCmd(rid=rid, dp_rank=msg.dp_rank), instance=msg.dp_rank)

    def _text(self, item: SeqTokens, stopped: list[str]) -> SeqText | None:
        rid = item.rid
        if rid in self.stopped:
            if item.finish_reason is not None:
                self.stopped.discard(rid)
            return None
        if self.info is None:  # skip_tokenizer_init: token ids only
            return self._seq_text(item, "", item.finish_reason, item.stop_token)
        state = self.states.get(rid)
        if state is None:
            sp = item.sampling
            assert sp is not None, f"first delta of {rid} carries no sampling options"
            assert self.info is not None
            state = self.states[rid] = IncrementalDetokenizer(
                self.info, prompt_ids=item.prompt_tail or (), skip_special_tokens=sp.skip_special_tokens,
                stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output)
        ids = item.token_ids
        if item.finish_reason == "stop" and ids and not state.include_stop_str_in_output:
            ids = ids[:-1]  # the EOS or stop token that ended the sequence is not text (as in vLLM)
        text, stop = state.add(ids)
        finish, stop_reason = item.finish_reason, item.stop_token
        if stop is not None:
            finish, stop_reason = "stop", stop
            if item.finish_reason is None:
                self.stopped.add(rid)
                stopped.append(rid)
        if finish is not None:
            text += state.finish()
            if state.stop_reason is not None and stop is None:
                stop_reason = state.stop_reason
            del self.states[rid]
        return self._seq_text(item, text, finish, stop_reason)

    def _seq_text(self, item: SeqTokens, text: str, finish: str | None, stop_reason: str | int | None) -> SeqText:
        rid = item.rid
        n = self.counts.get(rid, 0) + len(item.token_ids)
        if finish is None:
            self.counts[rid] = n
        else:
            self.counts.pop(rid, None)
        return SeqText(rid=rid, text=text, token_ids=item.token_ids, finish_reason=finish, stop_reason=stop_reason,
                       logprobs=item.logprobs, top_ids=item.top_ids, top_logprobs=item.top_logprobs,
                       num_prompt_tokens=item.num_prompt_tokens, num_cached_tokens=item.num_cached_tokens,
                       num_output_tokens=n, queue_time_s=item.queue_time_s, prompt_logprobs=item.prompt_logprobs)
