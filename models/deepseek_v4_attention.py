"""DeepSeek-V4's attention (models/deepseek_v4.py has the architecture and the cache rows): the query, the one
key-value head, the compressors that pool windows of tokens into entries, CSA's lightning indexer, and the two
paths that attend: the torch reference and the triton kernels."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.rope import rope_inv_freq
from flotilla.models.hf_config import DeepseekV4Params, HFModelConfig
from flotilla.models.parallel import all_reduce, divide, tp_group

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm: a float32 weight times the float32 normalised input, in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms(x, self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] dims of x [T, ..., D]; cos/sin [T, rope_dim / 2]."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    rope = x[..., -r:].float()
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], (rope * cos + turned * sin).to(x.dtype)], dim=-1)


class Rotary:
    """cos / sin tables [positions, rope_dim / 2] of one RoPE base (and scaling)."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict | None) -> None:
        self.inv_freq = rope_inv_freq(rope_dim, theta, scaling)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos(), freqs.sin()


class Compressor(nn.Module):
    """Pools windows of `rate` tokens' projections into compressed entries [E, dim] (roped at w * rate). With
    `overlap` (CSA) every token projects two series of `dim`: entry w pools window w-1's first series and window w's
    second, over 2 * rate slots."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.rate, self.overlap, self.width = dim, rate, overlap, width
        self.kv_proj = nn.Linear(hidden, width, bias=False, dtype=torch.float32)
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=torch.float32)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * width]: each token's kv then gate projections (what its cache row keeps)."""
        x = x.float()
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(self, cur: torch.Tensor, prev: torch.Tensor | None, w: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Entries [n, dim] of windows w [n] from their tokens' projections cur [n, rate, 2 * width] and, with overlap,
        the window before's prev [n, rate, 2 * width] (ignored where w == 0: window 0 has none)."""
        kv, gate = cur[..., :self.width], cur[..., self.width:] + self.position_bias
        if self.overlap:
            d = self.dim
            first = (w == 0)[:, None, None]
            prev_kv = prev[..., :d].masked_fill(first, 0.0)
            prev_gate = (prev[..., self.width:self.width + d] + self.position_bias[:, :d]).masked_fill(first, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = self.kv_norm((kv * gate.softmax(dim=1)).sum(dim=1))
        cos, sin = rotary(w * self.rate)
        return rotate(pooled, cos, sin)

    def entries(self, rows: torch.Tensor, rotary: Rotary, first: int = 0) -> torch.Tensor:
        """Entries first, first + 1, ... [E, dim] of the windows whose tokens' projections rows [S, 2 * width] hold,
        as many as finish in them. With overlap and first > 0 the rows begin one window earlier (window first - 1
        feeds entry first)."""
        lead = 1 if self.overlap and first > 0 else 0
        n = rows.shape[0] // self.rate - lead
        if n <= 0:
            return rows.new_zeros(0, self.dim, dtype=torch.float32)
        windows = rows[:(n + lead) * self.rate].float().view(n + lead, self.rate, 2 * self.width)
        prev = None
        if self.overlap:  # (window w - 1's rows, any rows for window 0, which pool masks)
            prev = windows[:-1] if lead else torch.cat([windows[:1], windows[:-1]])
        w = torch.arange(n, device=rows.device) + first
        return self.pool(windows[lead:], prev, w, rotary)


class Indexer(Compressor):
    """CSA's lightning indexer: a compressor of its own (index_head_dim, overlapping) and query heads whose scores
    weigh the entries."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, rate: int) -> None:
        super().__init__(config.hidden_size, v4.index_head_dim, rate, True, config.rms_norm_eps)
        self.heads, self.topk = v4.index_n_heads, v4.index_topk
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False, dtype=torch.float32)


def row_offsets(tables: torch.Tensor, at: torch.Tensor, block_size: int, width: int, column: int) -> torch.Tensor:
    """Where column `column` of the rows at positions `at` [T, K] (-1: none) starts in the flat cache of rows `width`
    wide, each token's positions read through its block table tables [T, blocks]; -1 for none."""
    p = at.clamp(min=0)
    slot = tables.gather(1, p // block_size) * block_size + p % block_size
    return torch.where(at >= 0, slot * width + column, -1)


class StepRows:
    """What every layer's attention needs of a step's batch, taken from its metadata once per step (not per layer).
    A step of decodes only (max_query_len 1: a CUDA graph's) reads nothing back from the device: its decoding rows,
    block tables and positions come from the metadata's tensors, and the kernels' path pools the windows its tokens
    finish under a mask (pool_mask). Other steps read the query starts and lengths to the host (qsl, lens) for the
    torch reference's per-sequence loops and the kernels' prompt chunks."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        self.meta = meta
        self._windows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self.block_size = meta.block_size
        self.block_tables = meta.block_tables
        self.decodes_only = meta.max_query_len == 1
        if self.decodes_only:
            n = meta.num_seqs
            self.qsl: list[int] = list(range(n + 1))
            self.decoding = list(range(n))
            self.rows = torch.arange(n, device=device)
            self.tables = meta.block_tables[:n].long()
            self.positions = meta.seq_lens[:n].long() - 1  # each new token's
            return
        self.qsl = (meta.host.query_start_loc if meta.host is not None else meta.query_start_loc).tolist()
        self.decoding = [b for b in range(len(self.qsl) - 1) if self.qsl[b + 1] - self.qsl[b] == 1]
        if self.decoding:
            index = torch.tensor(self.decoding, device=device)
            self.rows = torch.tensor([self.qsl[b] for b in self.decoding], device=device)
            self.tables = meta.block_tables[index].long()
            self.positions = meta.seq_lens[index].long() - 1

    @functools.cached_property
    def lens(self) -> list[int]:
        """Each sequence's length after the step, on the host (read back on first use)."""
        return (self.meta.host.seq_lens if self.meta.host is not None else self.meta.seq_lens).tolist()

    def window_offsets(self, positions: torch.Tensor, window: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's block table [T, blocks], int64; where its window's rows (the last `window` positions up to
        its own, -1 before the first) start in the flat cache of rows `width` wide [T, window]), computed once per
        step: every layer's window is the same rows."""
        key = (window, width)
        if key not in self._windows:
            from flotilla.kernels.mla.dsa_triton import token_sequences

            tables = self.meta.block_tables.long()[token_sequences(self.meta, positions.shape[0]).long()]
            pos = positions.long()[:, None] - window + 1 + torch.arange(window, device=positions.device)[None, :]
            self._windows[key] = tables, row_offsets(tables, pos.clamp(min=-1), self.block_size, width, 0)
        return self._windows[key]

    def pool_mask(self, rate: int) -> torch.Tensor:
        """bool [len(decoding)]: the decoding tokens that end a window of `rate` tokens (computed on the device)."""
        if rate not in self._masks:
            self._masks[rate] = (self.positions + 1) % rate == 0
        return self._masks[rate]

    def ending(self, rate: int) -> torch.Tensor | None:
        """Indices (into `decoding`) of the sequences whose new token ends a window of `rate` tokens; None: none
        (read back: the torch reference's path)."""
        found = torch.nonzero(self.pool_mask(rate)).flatten()
        return found if found.numel() else None


class DeepseekV4Attention(nn.Module):
    """One layer's attention, with its compressor (CSA, HCA) and indexer (CSA); see models/deepseek_v4.py's
    docstring."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, kernels: str = "torch") -> None:
        """kernels: "triton" attends through the kernels, "torch" through the reference."""
        super().__init__()
        self.kernels = kernels
        self.kind = v4.layer_type(layer_idx)
        self.rate = v4.rate(layer_idx)
        tp = tp_group().size
        self.heads = divide(config.num_attention_heads, tp, "attention heads")  # (this rank's)
        self.head_dim = config.head_dim
        self.window = config.sliding_window or 128
        self.groups = divide(v4.o_groups, tp, "o_groups")
        eps = config.rms_norm_eps
        self.eps = eps
        self.q_a_proj = nn.Linear(config.hidden_size, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(v4.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.o_a_proj = nn.Linear(config.num_attention_heads * config.head_dim // v4.o_groups,
                                  self.groups * v4.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.groups * v4.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.compressor = (Compressor(config.hidden_size, self.head_dim, self.rate, self.kind == CSA, eps)
                           if self.rate else None)
        if self.kind == CSA:  # (inside the compressor, as transformers names it)
            self.compressor.indexer = Indexer(config, v4, self.rate)
        # a row's columns: kv head | compressor projections | indexer projections | entry | indexer entry
        at = self.head_dim
        if self.compressor is not None:
            self.proj_at, at = at, at + 2 * self.compressor.width
        if self.indexer is not None:
            self.iproj_at, at = at, at + 2 * self.indexer.width
        if self.compressor is not None:
            self.entry_at, at = at, at + self.compressor.dim
        if self.indexer is not None:
            self.ientry_at, at = at, at + self.indexer.dim
        self.row_width = at  # (an entry lives in the row of its window's last token)

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def _store_entries(self, flat: torch.Tensor, slots: Callable[[torch.Tensor], torch.Tensor], p0: int, p1: int,
                       rotary: Rotary) -> None:
        """Pool the windows that this step's tokens (positions p0..p1) finish and write each entry (and its indexer
        entry) into the row of the window's last token, where later steps read it."""
        rate = self.rate
        w_lo, w_hi = (p0 + rate) // rate - 1, (p1 + 1) // rate  # windows w with p0 <= (w + 1) * rate - 1 <= p1
        if w_hi <= w_lo:
            return
        lead = 1 if self.compressor.overlap and w_lo > 0 else 0
        rows = flat[slots(torch.arange((w_lo - lead) * rate, w_hi * rate, device=flat.device))]
        ends = slots(torch.arange(w_lo + 1, w_hi + 1, device=flat.device) * rate - 1)
        comp = self.compressor
        entries = comp.entries(rows[:, self.proj_at:self.proj_at + 2 * comp.width], rotary, first=w_lo)
        flat[ends, self.entry_at:self.entry_at + comp.dim] = entries.to(flat.dtype)
        if self.indexer is not None:
            idx = self.indexer
            ientries = idx.entries(rows[:, self.iproj_at:self.iproj_at + 2 * idx.width], rotary, first=w_lo)
            flat[ends, self.ientry_at:self.ientry_at + idx.dim] = ientries.to(flat.dtype)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries q [n, heads, D] over keys where mask [n, S] allows, with the sinks in the softmax's denominator:
        keys [S, D] shared by the queries (a sequence's chunk), or [n, S, D] each query's own (batched decode; there
        a masked key may hold anything, and is zeroed)."""
        own = keys.dim() == 3
        keys = keys.float().masked_fill(~mask[..., None], 0.0) if own else keys.float()
        logits = torch.einsum("nhd,nsd->nhs" if own else "nhd,sd->nhs", q.float(), keys) * self.head_dim**-0.5
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sinks = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("nhs,nsd->nhd" if own else "nhs,sd->nhd", probs, keys)

    def _pool_decoding(self, flat: torch.Tensor, step: StepRows, rotary: Rotary, masked: bool = False) -> None:
        """The windows that the step's decoding tokens finish, pooled (batched) into those tokens' rows. masked:
        without reading anything back (a CUDA graph's step): every decoding token pools and writes its row's entry
        columns, which are read only where a window ends; one that finishes no window pools its own row over and over
        (a cheap read) instead of a window's."""
        if masked:
            sel, ending = slice(None), step.pool_mask(self.rate)
        elif (sel := step.ending(self.rate)) is None:
            return
        bs, rate, tables, p = step.block_size, self.rate, step.tables[sel], step.positions[sel]

        def slots(pos: torch.Tensor) -> torch.Tensor:
            pos = pos.clamp(min=0)
            return tables.gather(1, pos // bs) * bs + pos % bs

        w = (p + 1) // rate - 1  # their token ends window w = length / rate - 1: pool it into that token's row
        r = torch.arange(rate, device=flat.device)[None, :]
        at = slots(p[:, None])[:, 0]
        cur, prev = slots(w[:, None] * rate + r), slots((w[:, None] - 1) * rate + r)
        if masked:
            cur, prev = (torch.where(ending[:, None], rows, at[:, None]) for rows in (cur, prev))
        cur, prev = flat[cur], flat[prev]
        parts = [(self.compressor, self.proj_at, self.entry_at)]
        if self.indexer is not None:
            parts.append((self.indexer, self.iproj_at, self.ientry_at))
        for comp, proj_at, entry_at in parts:
            cols = slice(proj_at, proj_at + 2 * comp.width)
            flat[at, entry_at:entry_at + comp.dim] = comp.pool(cur[..., cols].float(), prev[..., cols].float(), w,
                                                               rotary).to(flat.dtype)

    def _attend_listed(self, flat: torch.Tensor, cache: torch.Tensor, q: torch.Tensor, iq: torch.Tensor | None,
                       iw: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata, step: StepRows,
                       rotary: Rotary) -> torch.Tensor:
        """The kernels' path for every token of the step: the windows its tokens finish pooled first, then each
        token's keys as cache offsets (window rows, then the entries it sees) read by the sink-attention kernel."""
        from flotilla.kernels.mla.dsa_triton import select_topk
        from flotilla.kernels.triton.sink_attention import sink_attention

        bs, width = step.block_size, flat.shape[1]
        if self.compressor is not None:
            if step.decoding:
                self._pool_decoding(flat, step, rotary, masked=step.decodes_only)
            for b, length in enumerate([] if step.decodes_only else step.lens):  # prompt chunks: the windows each
                lo, hi = step.qsl[b], step.qsl[b + 1]  # finishes
                if hi - lo > 1:
                    table = step.block_tables[b].long()
                    self._store_entries(flat, lambda p, table=table: table[p // bs] * bs + p % bs, length - (hi - lo),
                                        length - 1, rotary)
        tables, window = step.window_offsets(positions, self.window, width)
        lists = [window]
        pos = positions.long()
        entries = meta.max_seq_len // self.rate if self.compressor is not None else 0
        if entries:
            rate = self.rate
            if self.indexer is not None:
                idx = self.indexer
                ids = select_topk(iq.contiguous(), iw, cache[..., self.ientry_at:self.ientry_at + idx.dim], meta,
                                  idx.topk, idx.dim**-0.5, rate=rate).long()
            else:  # every entry finished at or before the token
                e = torch.arange(entries, device=pos.device)[None, :]
                ids = torch.where(e < ((pos + 1) // rate)[:, None], e, -1)
            lists.append(row_offsets(tables, torch.where(ids >= 0, (ids + 1) * rate - 1, -1), bs, width, self.entry_at))
        return sink_attention(q.contiguous(), flat.view(-1), torch.cat(lists, dim=1).contiguous(), self.sinks,
                              self.head_dim**-0.5)

    def _decode(self, flat: torch.Tensor, q: torch.Tensor, iq: torch.Tensor | None, iw: torch.Tensor | None,
                step: StepRows, rotary: Rotary) -> torch.Tensor:
        """Attention of the step's decoding sequences, one new token each (q [n, heads, D]), batched: each token's
        window rows and its sequence's entries, gathered through the block tables; windows its token finishes pooled
        first."""
        dev, bs, n = flat.device, step.block_size, len(step.decoding)
        tables, p = step.tables, step.positions

        def slots(pos: torch.Tensor, tables: torch.Tensor = tables) -> torch.Tensor:
            pos = pos.clamp(min=0)
            return tables.gather(1, pos // bs) * bs + pos % bs

        window = p[:, None] - self.window + 1 + torch.arange(self.window, device=dev)[None, :]  # [n, W]
        keys, mask = flat[slots(window), :self.head_dim], window >= 0
        if self.compressor is not None:
            rate = self.rate
            self._pool_decoding(flat, step, rotary)
            most = max(step.lens[b] for b in step.decoding) // rate
            if most:
                e = torch.arange(most, device=dev)[None, :]
                ends = flat[slots(((e + 1) * rate - 1).expand(n, -1))]  # [n, E, row]
                seen = e < ((p + 1) // rate)[:, None]
                entries = ends[..., self.entry_at:self.entry_at + self.compressor.dim]
                if self.indexer is not None:
                    ikeys = ends[..., self.ientry_at:self.ientry_at + self.indexer.dim].float()
                    ikeys = ikeys.masked_fill(~seen[..., None], 0.0)
                    scores = torch.einsum("nhd,ned->nhe", iq.float(), ikeys)
                    scores = (F.relu(scores) * self.indexer.dim**-0.5 * iw[:, :, None]).sum(dim=1)
                    scores = scores.masked_fill(~seen, float("-inf"))
                    top = scores.topk(min(self.indexer.topk, most), dim=-1).indices
                    seen = seen & torch.zeros_like(seen).scatter_(-1, top, True)
                keys, mask = torch.cat([keys, entries], dim=1), torch.cat([mask, seen], dim=1)
        return self._attend(q, keys, mask)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, compress_rotary: Rotary,
                cache: torch.Tensor, meta: AttentionMetadata, step: StepRows) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = rotary(positions)
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = rms(self.q_b_proj(q_res).view(t, self.heads, self.head_dim), self.eps).to(x.dtype)
        q = rotate(q, cos, sin)
        kv = rotate(self.kv_norm(self.kv_proj(x)), cos, sin)
        parts = [kv.float()]
        if self.compressor is not None:
            parts.append(self.compressor.project(x))
        if self.indexer is not None:
            parts.append(self.indexer.project(x))
        rows = torch.cat(parts, dim=-1)
        flat = cache.view(-1, cache.shape[-1])
        if self.kernels == "triton":  # (one launch, no host sync)
            from flotilla.kernels.mla.dsa_triton import store_rows

            store_rows(rows, cache[..., :rows.shape[-1]], meta.slot_mapping)
        else:
            keep = meta.slot_mapping >= 0
            flat[meta.slot_mapping[keep], :rows.shape[-1]] = rows[keep].to(cache.dtype)
        if self.indexer is not None:
            iq = rotate(self.indexer.q_b_proj(q_res).view(t, self.indexer.heads, self.indexer.dim),
                        *compress_rotary(positions))
            iw = self.indexer.scorer.weights_proj(x.float()) * self.indexer.heads**-0.5
        else:
            iq = iw = None
        if self.kernels == "triton":
            out = self._attend_listed(flat, cache, q, iq, iw, positions, meta, step, compress_rotary)
            return self._output(out, cos, sin)
        out = torch.empty(t, self.heads, self.head_dim, dtype=x.dtype, device=x.device)
        qsl, bs = step.qsl, step.block_size
        if step.decoding:  # sequences with one new token: all at once
            rows = step.rows
            out[rows] = self._decode(flat, q[rows], iq if iq is None else iq[rows], iw if iw is None else iw[rows],
                                     step, compress_rotary).to(x.dtype)
        for b, length in enumerate(step.lens):
            lo, hi = qsl[b], qsl[b + 1]
            if hi - lo <= 1:
                continue
            table = step.block_tables[b].long()

            def slots(p: torch.Tensor, table: torch.Tensor = table) -> torch.Tensor:
                return table[p // bs] * bs + p % bs

            p0, p1 = length - (hi - lo), length - 1  # (a step's tokens are the sequence's last ones)
            pos = positions[lo:hi]
            # the window's rows only, and the entries' rows: a step reads O(window + length / rate) rows
            visible = torch.arange(max(0, p0 - self.window + 1), length, device=x.device)
            keys = flat[slots(visible), :self.head_dim].float()
            mask = (visible[None, :] <= pos[:, None]) & (visible[None, :] > pos[:, None] - self.window)  # [n, S]
            if self.compressor is not None:
                self._store_entries(flat, slots, p0, p1, compress_rotary)
                ends = flat[slots(torch.arange(1, length // self.rate + 1, device=x.device) * self.rate - 1)]
                entries = ends[:, self.entry_at:self.entry_at + self.compressor.dim].float()
                finished = (pos[:, None] + 1) // self.rate  # entries a query may see: w < finished
                seen = torch.arange(entries.shape[0], device=x.device)[None, :] < finished
                if self.indexer is not None and entries.shape[0]:
                    ikeys = ends[:, self.ientry_at:self.ientry_at + self.indexer.dim].float()
                    scores = torch.einsum("nhd,ed->nhe", iq[lo:hi].float(), ikeys)
                    scores = (F.relu(scores) * self.indexer.dim**-0.5 * iw[lo:hi, :, None]).sum(dim=1)
                    scores = scores.masked_fill(~seen, float("-inf"))
                    top = scores.topk(min(self.indexer.topk, entries.shape[0]), dim=-1).indices
                    chosen = torch.zeros_like(seen).scatter_(-1, top, True)
                    seen = seen & chosen
                keys = torch.cat([keys, entries])
                mask = torch.cat([mask, seen], dim=-1)
            out[lo:hi] = self._attend(q[lo:hi], keys, mask).to(x.dtype)
        return self._output(out, cos, sin)

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [T, heads, D] with their rope dims turned back, through the grouped projection."""
        t = out.shape[0]
        out = rotate(out, cos, -sin)
        grouped = out.reshape(t, self.groups, -1)
        weight = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return all_reduce(self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, weight).reshape(t, -1)))
