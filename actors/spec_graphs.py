"""CUDA graphs for MTP speculative decoding (actors/spec_decode.py): the uniform step, where each of B sequences
decodes with all k = num_speculative_tokens drafts, so B * (k + 1) rows.

Three graphs per captured batch size B (the decode ladder, cuda_graphs.capture_sizes), in one memory pool:

- verify: the main model over the B * (k + 1) rows: hidden [B * (k + 1), H];
- propose: the MTP layer over the same rows, reading verify's hidden states and the tokens sampled there (in a
  uniform step every row samples, so the token one position ahead of each row is the one sampled at it): its
  output [B * (k + 1), H];
- draft: each sequence's accepted count (its leading drafts equal to the tokens sampled before them, counted on
  the device from verify's inputs and the sampled tokens), its row of propose's output at the last accepted
  position, the MTP head's argmax (draft 1), then the MTP layer k - 1 more times, one position further each, on its
  own draft and output; the positions, slots and context lengths of those passes are computed in the graph too.
  Out: [B, 1 + k], the accepted count and the k drafts.

Sampling stays outside (its options change per request), as in the decode graphs. All three graphs and the sampler
are queued before the host waits, for the sampled tokens only: the drafts (and the accepted counts, which must agree
with the host's) stay on the device for the next verify, their copy to the host queued behind them. A step
that is not uniform (a prefill chunk, a penalised request without drafts, a batch past the largest size) runs eager;
so does the draft chain of a step where a chain might run past the block table or max_model_len (the host checks
the case where every draft is accepted, the longest).

Attention reads static device tables (the static-table backends of actors/cuda_graphs.py): the verify and propose
graphs run max_query_len k + 1, which the MLA backends send to their prefill kernel (flash_mla's decode kernel
takes one query per sequence); the draft passes are decodes. Padded rows of a batch run on the scratch block, and
their outputs are dropped. On a CPU device the "graphs" rerun their function eagerly over the same static
buffers, which lets tests check every buffer and table the graphs read without a GPU.

A hybrid model (Qwen3.5) verifies with its delta nets' decode kernels token by token (models/qwen3_5_moe.py): the
graph reads each sequence's state slot and each token's history row from static buffers (-1 on padded rows, which
the kernels skip), and the speculator rolls a rejected draft's state back from those rows as after an eager step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from flotilla.actors.cuda_graphs import capture_sizes, static_tables
from flotilla.actors.graph_inputs import StaticGraph, StaticInputs
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.staging import staged, upload

log = logging.getLogger(__name__)


class SpecGraphs:
    """Captured verify / propose / draft passes of uniform speculating steps, one set per batch size."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_batch: int, max_blocks_per_seq: int, num_speculative_tokens: int, device: torch.device,
                 history_base: int | None = None) -> None:  # fmt: skip
        """history_base: a hybrid model's first state-pool row for verify tokens' states (ModelRunner's rows after
        the slots and snapshots); None for a model without recurrent state."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.history_base = history_base
        self.device = device
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.k = k = num_speculative_tokens
        self.q = q = k + 1
        self.sizes = capture_sizes(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        gmax = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        # verify and propose: q rows per sequence, their inputs and tables in one buffer (one copy per step)
        self.inputs = StaticInputs(gmax * q, gmax, max_blocks_per_seq, scratch_block, self.scratch_slot, device)
        self.ids, self.positions, self.slots = self.inputs.ids, self.inputs.positions, self.inputs.slots
        self.seq_lens, self.block_tables = self.inputs.seq_lens, self.inputs.block_tables
        self.seq_lens.fill_(q)  # (until the first step: the captures' warm-up passes read q rows per sequence)
        self.mtp_ids = torch.zeros(gmax * q, **i64)
        self.query_start_loc = torch.arange(0, gmax * q + 1, q, **i32)
        # draft: k - 1 decode passes whose slots and context lengths the graph writes here (pass j in row j)
        self.row_base = torch.arange(0, gmax * q, q, **i64)  # each sequence's first verify row
        self.d_slots = torch.full((max(k - 1, 1), gmax), self.scratch_slot, **i64)
        self.d_seq_lens = torch.ones(max(k - 1, 1), gmax, **i32)
        self.d_query_start_loc = torch.arange(gmax + 1, **i32)
        self.d_block_tables = torch.full((gmax, max_blocks_per_seq), scratch_block, **i32)
        # a hybrid model's state slots [B] and each verify token's history row [B, q] (-1: a padded row, which the
        # delta nets' kernels skip; all -1 at capture, so capturing writes no state)
        self.state = torch.full((gmax * (q + 1),), -1, **i64) if history_base is not None else None
        self.verify_graphs: dict[int, StaticGraph] = {}
        self.propose_graphs: dict[int, StaticGraph] = {}
        self.draft_graphs: dict[int, StaticGraph] = {}
        t0 = time.perf_counter()
        self._capture_all()
        if device.type == "cuda":
            log.info("captured CUDA graphs of speculating steps (%d drafts) for batch sizes %s in %.1f s", k,
                     self.sizes, time.perf_counter() - t0)

    # ---- capture ----------------------------------------------------------------------------------------------

    def _verify_meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
                                 block_tables=self.block_tables[:size], slot_mapping=self.slots[:size * self.q],
                                 max_query_len=self.q, max_seq_len=self.max_blocks_per_seq * self.block_size,
                                 block_size=self.block_size)  # fmt: skip
        if self.state is not None:
            gmax = self.sizes[-1]
            meta.state_slots = self.state[:size]
            meta.verify_history = self.state[gmax:].view(gmax, self.q)[:size]
        return meta

    def _draft_meta(self, size: int, j: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.d_query_start_loc[:size + 1], seq_lens=self.d_seq_lens[j, :size],
                                 block_tables=self.d_block_tables[:size], slot_mapping=self.d_slots[j, :size],
                                 max_query_len=1, max_seq_len=self.max_blocks_per_seq * self.block_size,
                                 block_size=self.block_size)  # fmt: skip

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, kv, q = self.model, self.kv_caches, self.q
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            n = size * q
            vmeta = self._verify_meta(size)
            dmetas = [self._draft_meta(size, j) for j in range(self.k - 1)]

            def clear(metas: list[AttentionMetadata] = [vmeta, *dmetas]) -> None:
                for m in metas:  # per-step state (FlashMLA's scheduling) is computed inside the graph
                    m.backend_state.clear()

            verify = StaticGraph(lambda n=n, m=vmeta: model(self.ids[:n], self.positions[:n], kv, m),
                            self.device, pool, clear)
            self.verify_graphs[size] = verify
            hidden = verify.out  # a CUDA graph's output tensor: fixed; eager mode reads it at replay (below)

            def propose(n: int = n, m: AttentionMetadata = vmeta, size: int = size) -> torch.Tensor:
                h = hidden if hidden is not None else self.verify_graphs[size].out
                return model.mtp_forward(self.mtp_ids[:n], self.positions[:n], h, kv, m)

            self.propose_graphs[size] = StaticGraph(propose, self.device, pool, clear)
            proposed = self.propose_graphs[size].out

            def draft(size: int = size, n: int = n, metas: list[AttentionMetadata] = dmetas) -> torch.Tensor:
                out = proposed if proposed is not None else self.propose_graphs[size].out
                k, bs = self.k, self.block_size
                sampled = self.mtp_ids[:n].view(size, q)  # y_j at row j
                drafted = self.ids[:n].view(size, q)[:, 1:]  # draft j + 1 at row j + 1
                # leading drafts equal to the token sampled before them (padded rows: all, on the scratch block)
                accepted = (drafted == sampled[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
                h = out[self.row_base[:size] + accepted]
                first = self.positions[:n].view(size, q)[:, 0] + accepted  # the last accepted position
                tokens = [model.mtp_logits(h).argmax(dim=-1)]
                for j, m in enumerate(metas):
                    pos = first + 1 + j
                    pages = self.d_block_tables[:size].gather(1, (pos // bs)[:, None]).squeeze(1)
                    self.d_slots[j, :size].copy_(pages.to(torch.int64) * bs + pos % bs)
                    self.d_seq_lens[j, :size].copy_(pos + 1)
                    h = model.mtp_forward(tokens[-1], pos, h, kv, m)
                    tokens.append(model.mtp_logits(h).argmax(dim=-1))
                return torch.cat((accepted[:, None], torch.stack(tokens, dim=1)), dim=1)

            self.draft_graphs[size] = StaticGraph(draft, self.device, pool, clear)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- replay -----------------------------------------------------------------------------------------------

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def padded_size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def verify(self, ids: np.ndarray, cached: np.ndarray, tables: list[np.ndarray],
               drafts: tuple[torch.Tensor, torch.Tensor, np.ndarray, bool] | None = None,
               state_slots: np.ndarray | None = None) -> torch.Tensor:
        """The main model over B sequences of q = k + 1 new tokens each: ids int64 [B * q] (each sequence's last
        token and its k drafts), cached [B] the tokens already in each sequence's cache (its first new position),
        tables each sequence's KV blocks; drafts: (the last step's draft output [*, 1 + k] and sampled tokens
        [* * q] on the device, each sequence's row there, chained), the drafts to verify in place of ids' (which the
        host does not know yet); chained: the last step's result is not on the host either, so `cached` counted
        all its drafts accepted: each sequence's positions, slots and length come back by the drafts it rejected,
        and its last token is the one sampled after its last accepted draft. state_slots [B]: a hybrid model's
        slots, whose verify tokens' states go to rows history_rows(B). -> hidden [B * q, H] (valid until the next
        verify)."""
        batch, q, bs = len(cached), self.q, self.block_size
        size = self.padded_size(batch)
        self._size, self._batch = size, batch
        lens, table = static_tables(size, cached + q, tables, bs, self.scratch_block)
        lens[batch:] = q  # a padded sequence holds its q rows on the scratch block
        pos = (cached[:, None] + np.arange(q)[None, :]).reshape(-1)
        blocks = table[np.repeat(np.arange(batch), q), pos // bs].astype(np.int64)
        self.inputs.write(ids, pos, blocks * bs + pos % bs, lens, table)  # padded rows: on the scratch block
        if self.state is not None:
            gmax, host = self.sizes[-1], np.full(len(self.state), -1, dtype=np.int64)
            host[:batch] = state_slots
            host[gmax:gmax + batch * q] = self.history_rows(batch)
            self.state.copy_(staged(host, self.device), non_blocking=True)
        if drafts is not None:
            out, sampled, rows, chained = drafts
            rows_t = upload(rows, self.device)
            ids = self.ids[:batch * q].view(batch, q)
            ids[:, 1:].copy_(out[rows_t, 1:])
            if chained:
                accepted = out[rows_t, 0]
                ids[:, 0].copy_(sampled.view(-1, q)[rows_t, accepted])
                shift = self.k - accepted
                pos = self.positions[:batch * q].view(batch, q)
                pos.sub_(shift[:, None])
                self.seq_lens[:batch].sub_(shift.to(torch.int32))
                pages = self.block_tables[:batch].gather(1, pos // bs).to(torch.int64)
                self.slots[:batch * q].view(batch, q).copy_(pages * bs + pos % bs)
        return self.verify_graphs[size].replay()[:batch * q]

    def history_rows(self, batch: int) -> np.ndarray:
        """int64 [batch * q]: the state-pool row each verify token's state goes to (a hybrid model's)."""
        assert self.history_base is not None
        return self.history_base + np.arange(batch * self.q, dtype=np.int64)

    def propose(self, sampled: torch.Tensor) -> torch.Tensor:
        """The MTP layer over the last verify's rows, each reading the token sampled at it (sampled int64 [B * q],
        on the device). -> its output [B * q, H] (valid until the next propose)."""
        n = self._batch * self.q
        self.mtp_ids[:n].copy_(sampled)
        self.mtp_ids[n:self._size * self.q].zero_()
        return self.propose_graphs[self._size].replay()[:n]

    def can_draft(self, cached: np.ndarray, tables: list[np.ndarray], max_model_len: int) -> bool:
        """Whether the last verify's sequences (cached [B]: their first new positions) have the KV slots of a whole
        draft chain whatever is accepted: with all k drafts accepted the chain's k - 1 passes end at cached + 2k - 1."""
        if self.k == 1:
            return True
        last = cached + 2 * self.k - 1
        return bool((last < max_model_len).all()
                    and all(p // self.block_size < len(t) for p, t in zip(last.tolist(), tables)))

    def draft(self, cached: np.ndarray, tables: list[np.ndarray]) -> torch.Tensor:
        """[B, 1 + k] int64 on the device: each sequence's accepted count, then its k drafts for the next step, from
        the last verify and propose (can_draft(cached, ...) must hold)."""
        size, batch = self._size, self._batch
        if self.k > 1:  # the pages a chain may reach (the graph looks its slots up in them)
            _, table = static_tables(size, cached + 2 * self.k, tables, self.block_size, self.scratch_block)
            self.d_block_tables[:size, :table.shape[1]].copy_(upload(table, self.device))
        return self.draft_graphs[size].replay()[:batch]
