"""DeepSeek-V4 (V4-Flash, V4-Pro): attention over a sliding window plus compressed entries, residual streams mixed by
hyper-connections, hash-routed first MoE layers.

The architecture (transformers' models/deepseek_v4):
- mHC: the residual is `hc_mult` streams. Before attention and before the MLP a hyper-connection (fp32) reads the
  streams (an RMSNorm over them all, one linear map) into sigmoid `pre` weights that collapse them into the block's
  input, sigmoid `post` weights that spread its output back, and a Sinkhorn-normalised `comb` mixing of the streams
  themselves; `hc_head` collapses them before the final norm.
- Attention, every layer: a low-rank query (q_a_proj, RMSNorm, q_b_proj, then an RMSNorm per head without weight),
  ONE key-value head (K = V, head_dim wide) whose trailing rope_dim dims take interleaved RoPE, learned per-head sink
  logits in the softmax's denominator, a window of the last `sliding_window` tokens, the inverse rotation of the
  output's rope dims, and a grouped output projection (o_groups x o_lora_rank, then o_b_proj).
- CSA layers (compressed sparse attention) add compressed entries: a compressor pools each window of `rate` tokens
  (two overlapping series: entry w takes window w's second half and window w-1's first half of the projections,
  softmax-gated with a learned position bias), RMSNorms and ropes the entry at position w * rate, and a lightning
  indexer with its own smaller compressor scores the entries (sum over heads of w_h * ReLU(q_h . k)) and keeps the
  top `index_topk` a query may see (entry w only from position (w + 1) * rate - 1 on). HCA layers (heavily
  compressed) pool non-overlapping windows of `rate` tokens and let a query see every finished entry.
- MoE on every layer: sqrt(softplus) router scores, top-k on scores + a bias (the first layers instead look the
  experts up by token id: hash MoE), weights renormalised x routed_scaling_factor, a shared expert; gate and up
  activations clamped at swiglu_limit.

The paged cache holds one row per token per layer: the token's key-value head, then (CSA / HCA) its compressor
projections and (CSA) its indexer's, then the entry (and indexer entry) of the window the token ends, if it ends one:
the step whose tokens finish a window pools it from the window's rows and writes it there. So a prefix hit, a chunked
prefill, a preemption or a KV migration needs nothing beyond the rows, and a step reads the window's rows and the
entries' rows, O(sliding_window + length / rate) per sequence, not the whole context.

Two paths share the projections, the cache rows and the pooling of finished windows: the torch reference (a loop
over the step's prompt chunks, decodes batched), and the kernels ("triton", auto on a GPU): each token's keys as a
list of cache offsets (its window, then the entries it sees: all of them under HCA, the indexer's top-k under CSA,
scored by kernels/mla/dsa_triton.py over the entries' rows), read by kernels/triton/sink_attention.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.moe import MoEBackend, get_moe_backend
from flotilla.kernels.quant.fp8_ref import block_dequantize
from flotilla.kernels.rope import rope_inv_freq
from flotilla.models.deepseek_v4_checkpoint import fp4_dequantize, param_name, rank_share
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


class StepRows:
    """What every layer's attention needs of a step's batch, taken from its metadata once per step (not per layer):
    the query rows and lengths on the host, and the decoding sequences (one new token each) gathered for the batched
    path: their rows, block tables and positions on the device."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        self.qsl: list[int] = meta.query_start_loc.tolist()
        self.lens: list[int] = meta.seq_lens.tolist()
        self.block_size = meta.block_size
        self.block_tables = meta.block_tables
        self.decoding = [b for b in range(len(self.lens)) if self.qsl[b + 1] - self.qsl[b] == 1]
        if self.decoding:
            index = torch.tensor(self.decoding, device=device)
            self.rows = torch.tensor([self.qsl[b] for b in self.decoding], device=device)
            self.tables = meta.block_tables[index].long()
            self.positions = meta.seq_lens[index].long() - 1  # each new token's
            self._ending: dict[int, torch.Tensor | None] = {}

    def ending(self, rate: int) -> torch.Tensor | None:
        """Indices (into `decoding`) of the sequences whose new token ends a window of `rate` tokens; None: none."""
        if rate not in self._ending:
            ending = [i for i, b in enumerate(self.decoding) if self.lens[b] % rate == 0]
            self._ending[rate] = torch.tensor(ending, device=self.rows.device) if ending else None
        return self._ending[rate]


class DeepseekV4Attention(nn.Module):
    """One layer's attention, with its compressor (CSA, HCA) and indexer (CSA); see the module docstring."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, kernels: str = "torch") -> None:
        """kernels: "triton" attends through the kernels, "torch" through the reference (module docstring)."""
        super().__init__()
        self.kernels = kernels
        self.kind = v4.layer_types[layer_idx]
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

    def _pool_decoding(self, flat: torch.Tensor, step: StepRows, rotary: Rotary) -> None:
        """The windows that the step's decoding tokens finish, pooled (batched) into those tokens' rows."""
        sel = step.ending(self.rate)
        if sel is None:
            return
        bs, rate, tables, p = step.block_size, self.rate, step.tables[sel], step.positions[sel]

        def slots(pos: torch.Tensor) -> torch.Tensor:
            pos = pos.clamp(min=0)
            return tables.gather(1, pos // bs) * bs + pos % bs

        w = (p + 1) // rate - 1  # their token ends window w = length / rate - 1: pool it into that token's row
        r = torch.arange(rate, device=flat.device)[None, :]
        cur, prev = flat[slots(w[:, None] * rate + r)], flat[slots((w[:, None] - 1) * rate + r)]
        at = slots(p[:, None])[:, 0]
        comp = self.compressor
        cols = slice(self.proj_at, self.proj_at + 2 * comp.width)
        flat[at, self.entry_at:self.entry_at + comp.dim] = comp.pool(
            cur[..., cols].float(), prev[..., cols].float(), w, rotary).to(flat.dtype)
        if self.indexer is not None:
            idx, icols = self.indexer, slice(self.iproj_at, self.iproj_at + 2 * self.indexer.width)
            flat[at, self.ientry_at:self.ientry_at + idx.dim] = idx.pool(
                cur[..., icols].float(), prev[..., icols].float(), w, rotary).to(flat.dtype)

    def _attend_listed(self, flat: torch.Tensor, cache: torch.Tensor, q: torch.Tensor, iq: torch.Tensor | None,
                       iw: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata, step: StepRows,
                       rotary: Rotary) -> torch.Tensor:
        """The kernels' path for every token of the step: the windows its tokens finish pooled first, then each
        token's keys as cache offsets (window rows, then the entries it sees) read by the sink-attention kernel."""
        from flotilla.kernels.mla.dsa_triton import select_topk, token_sequences
        from flotilla.kernels.triton.sink_attention import sink_attention

        bs, width = step.block_size, flat.shape[1]
        if self.compressor is not None:
            if step.decoding:
                self._pool_decoding(flat, step, rotary)
            for b, length in enumerate(step.lens):  # prompt chunks: the windows each finishes
                lo, hi = step.qsl[b], step.qsl[b + 1]
                if hi - lo > 1:
                    table = step.block_tables[b].long()
                    self._store_entries(flat, lambda p, table=table: table[p // bs] * bs + p % bs, length - (hi - lo),
                                        length - 1, rotary)
        tables = meta.block_tables.long()[token_sequences(meta, q.shape[0]).long()]
        pos = positions.long()

        def offsets(at: torch.Tensor, column: int) -> torch.Tensor:
            """Where the vectors of the rows at positions `at` [T, K] (-1: none) start in the flat cache."""
            p = at.clamp(min=0)
            slot = tables.gather(1, p // bs) * bs + p % bs
            return torch.where(at >= 0, slot * width + column, -1)

        window = pos[:, None] - self.window + 1 + torch.arange(self.window, device=pos.device)[None, :]
        lists = [offsets(window.clamp(min=-1), 0)]
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
            lists.append(offsets(torch.where(ids >= 0, (ids + 1) * rate - 1, -1), self.entry_at))
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


class HyperConnection(nn.Module):
    """mHC: the block input collapsed from the streams, and the weights that spread its output back and mix them."""

    def __init__(self, hidden: int, v4: DeepseekV4Params, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the block's input [T, hidden])."""
        n = self.n
        mix = F.linear(rms(streams.flatten(1), self.eps), self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: its output spread by `post`, plus the streams mixed by comb (transposed)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HashGate(nn.Module):
    """A hash-MoE layer's router: its learned scores' weight, and the token id -> experts table that picks."""

    def __init__(self, vocab_size: int, top_k: int, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))

    def dummy_init_(self, generator: torch.Generator) -> None:
        """load_format dummy: small random scores, and k distinct random experts per token (an all-zero table would
        send every token to expert 0, which no benchmark should measure)."""
        with torch.no_grad():
            self.weight.uniform_(-1e-3, 1e-3, generator=generator)
            draws = torch.rand(self.tid2eid.shape[0], self.weight.shape[0], generator=generator,
                               device=self.weight.device)
            self.tid2eid.copy_(draws.argsort(dim=-1)[:, :self.tid2eid.shape[1]])


class DeepseekV4MoE(nn.Module):
    """Routed experts (top-k, or looked up by token id) and a shared expert, activations clamped."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, backend: MoEBackend) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.backend = backend
        tp = tp_group().size
        e, h = moe.num_experts, config.hidden_size
        i = divide(moe.moe_intermediate_size, tp, "moe_intermediate_size")  # (this rank's share of each expert)
        self.top_k, self.scale, self.limit = moe.num_experts_per_tok, moe.routed_scaling_factor, v4.swiglu_limit
        self.hashed = v4.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = HashGate(config.vocab_size, self.top_k, e, h) if self.hashed else nn.Module()
        if not self.hashed:
            self.gate.weight = nn.Parameter(torch.zeros(e, h))
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.shared_experts = nn.Module()
        shared = i * max(moe.num_shared_experts, 1)  # (likewise)
        self.shared_experts.gate_proj = nn.Linear(h, shared, bias=False)
        self.shared_experts.up_proj = nn.Linear(h, shared, bias=False)
        self.shared_experts.down_proj = nn.Linear(shared, h, bias=False)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = F.softplus(F.linear(x, self.gate.weight)).sqrt()
        if self.hashed:
            idx = self.gate.tid2eid[input_ids]
        else:
            idx = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        out = self.backend.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights.float(),
                                         idx.to(torch.int32), swiglu_limit=self.limit)
        s = self.shared_experts
        return all_reduce(out + s.down_proj(self._act(s.gate_proj(x), s.up_proj(x))))


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, backend: MoEBackend,
                 kernels: str = "torch") -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DeepseekV4Attention(config, v4, layer_idx, kernels)
        self.mlp = DeepseekV4MoE(config, v4, layer_idx, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(config.hidden_size, v4, eps)
        self.ffn_hc = HyperConnection(config.hidden_size, v4, eps)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4's decoder (the step interface of LlamaForCausalLM) over the paged rows of the module docstring."""

    fused_ops_name = "torch"

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", moe_backend: str = "auto") -> None:
        super().__init__()
        v4 = config.deepseek_v4
        if v4 is None:
            raise ValueError("config.json is not a DeepSeek-V4 config (model_type deepseek_v4)")
        if config.num_key_value_heads != 1:
            raise ValueError(f"DeepSeek-V4 has one key-value head, config.json says {config.num_key_value_heads}")
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"DeepSeek-V4's attention runs on the triton kernels or the torch reference, not "
                             f"{attention_backend!r}")
        from flotilla.kernels.attention import triton_usable

        if attention_backend == "auto":
            attention_backend = "triton" if torch.cuda.is_available() and triton_usable() else "torch"
        elif attention_backend == "triton" and not triton_usable():
            raise ValueError("DeepSeek-V4's triton attention needs triton (and a GPU, or TRITON_INTERPRET=1)")
        self.attention_backend_name = "v4_triton" if attention_backend == "triton" else "torch"
        """The attention path (the ready log line; not a static-table backend: the step still reads its rows on the
        host, so decode steps run eager)."""
        self.config, self.v4 = config, v4
        self.moe_backend = get_moe_backend(moe_backend, device=torch.get_default_device(),
                                           dtype=torch.get_default_dtype())
        self.moe_backend_name = self.moe_backend.name
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, v4, i, self.moe_backend, attention_backend)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model.hc_head = nn.Module()
        n = v4.hc_mult
        self.model.hc_head.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.model.hc_head.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.model.hc_head.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(v4.rope_dim, v4.main_rope_theta, None)
        self.compress_rotary = Rotary(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling)
        self.num_layers = config.num_hidden_layers
        self.row_width = max(layer.self_attn.row_width for layer in self.model.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Every layer's cache: [num_blocks, block_size, row] (one row per token; the widest layer's width)."""
        return (num_blocks, block_size, self.row_width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        step = StepRows(meta, x.device)  # (once for every layer)
        streams = x.unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            attn = layer.self_attn
            rotary = self.rotary if attn.rate == 0 else self.compress_rotary
            post, comb, collapsed = layer.attn_hc(streams)
            out = attn(layer.input_layernorm(collapsed), positions, rotary, self.compress_rotary, cache, meta, step)
            streams = merge(streams, out, post, comb)
            post, comb, collapsed = layer.ffn_hc(streams)
            streams = merge(streams, layer.mlp(layer.post_attention_layernorm(collapsed), input_ids), post, comb)
        head = self.model.hc_head
        pre = torch.sigmoid(F.linear(rms(streams.flatten(1), self.config.rms_norm_eps), head.hc_fn) * head.hc_scale
                            + head.hc_base) + self.v4.hc_eps
        return self.model.norm((pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if out is not None:
            out.copy_(logits)
            return out
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """DeepSeek's checkpoint layout (layers.N.attn.wq_a, ffn.experts.E.w1, ...; with or without `model.`) or
        transformers' names; each routed expert's w1 / w3 / w2 goes into its row of the stacked experts. An FP8
        block-scaled checkpoint (V4-Flash-Base) and MXFP4 experts (V4-Flash) are dequantized as they load (`X.weight`
        with `X.weight_scale_inv`).
        The MTP layers are not loaded yet."""
        params = dict(self.named_parameters())
        targets = {**dict(self.named_buffers()), **params}
        loaded: set[str] = set()
        for name, tensor in self._dequantized(weights):
            target_name, row, part = param_name(name)
            target = targets.get(target_name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of DeepSeek-V4")
            tensor = rank_share(target_name, tensor, row is not None)
            if row is not None:  # one routed expert's matrix: its slice of the stacked tensor
                half = target.shape[1] // 2
                target = target[row] if part is None else target[row, part * half:(part + 1) * half]
            if tensor.shape != target.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            if target_name in params:
                loaded.add(target_name)
        return loaded

    def _dequantized(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized weight (FP8, or FP4 packed in int8) and its block scales
        turned into one float weight (in whichever order the two come); others as they are."""
        quant = self.config.quantization
        if quant is None:
            yield from weights
            return
        pending: dict[str, torch.Tensor] = {}  # weight name -> the first of (weight, scales) seen
        dtype = self.lm_head.weight.dtype
        for name, tensor in weights:
            is_scale = name.endswith("_scale_inv")
            if not is_scale and tensor.dtype not in (torch.float8_e4m3fn, torch.int8):
                yield name, tensor
                continue
            weight = name.removesuffix("_scale_inv")
            other = pending.pop(weight, None)
            if other is None:
                pending[weight] = tensor
                continue
            q, scales = (other, tensor) if is_scale else (tensor, other)
            if q.dtype == torch.int8:
                yield weight, fp4_dequantize(q, scales).to(dtype)
            else:
                yield weight, block_dequantize(q, scales, quant.weight_block_size).to(dtype)
        if pending:
            shown = ", ".join(sorted(pending)[:4])
            raise ValueError(f"FP8 weights without their block scales (or scales without weights): {shown}")

    def checkpoint_filter(self) -> Callable[[str], bool]:
        return lambda name: not name.startswith("mtp.")
