"""Expert parallelism by all-gather and reduce-scatter (vLLM's "allgather_reducescatter" all2all backend): every
shape is fixed before the step starts and nothing is read back to the host, so a step can be captured in a CUDA
graph, which dispatch / combine by all-to-all (expert_parallel.py) cannot be (it reads the split sizes back).

Every rank of the expert-parallel group runs each MoE layer with the same number of rows, the step's `padded`
count (`ep_tokens`: agreed by the ranks before the step, the largest batch of any rank, or the CUDA graph's size
when every rank replays one): its own tokens, then zero rows with no experts.

1. all-gather: every rank's rows [P, H] and routing (the int32 expert ids and the float32 weights packed as one
   int32 [P, 2k]) -> [ep * P, ...] on every rank, rank 0's first;
2. this rank's experts on every gathered token, the slots of other ranks' experts masked (id -1: they add
   nothing; kernels/moe/torch_ref.py), so each token gets the part of its weighted sum this rank's experts hold;
3. reduce-scatter (sum over the ranks): each rank gets its own P rows back, every expert's part added.

What moves: each rank receives (ep - 1) * P rows in the all-gather and sends as many in the reduce-scatter; the
all-to-all sends about k * T * (ep - 1) / ep rows each way for T tokens of top-k routing, so this moves ep / k
times as much at equal batches: less at EP2 with top-8 (Qwen3-30B-A3B, DeepSeek-V3), the same at EP8, more when
one rank's batch pads the others'. Compute: each rank's expert kernels walk every gathered row's slots (ep x the
rows, the masked ones skipped by the grouping but still given a zeroed output row), in chunks of CHUNK_ROWS rows,
so this suits decode batches better than long prefills. Rounding: each rank rounds its part of a token's sum to
the activation dtype and the reduce-scatter adds the parts in it, so outputs agree with one rank's to the dtype's
rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from flotilla.kernels.comm import staged
from flotilla.kernels.moe import MoEBackend, get_moe_backend
from flotilla.kernels.moe.expert_parallel import ExpertPlacement, pack_routing, unpack_routing

__all__ = ["CHUNK_ROWS", "GatheredTokenExperts", "current_ep_tokens", "ep_tokens"]

CHUNK_ROWS = 8192
"""Gathered rows the experts take at a time. The expert kernels keep a [rows x top-k, hidden] buffer, and a rank
gathers every rank's rows (most of their slots masked): without chunks a prefill step at EP8 would hold eight
ranks' buffers at once (vLLM chunks its fused MoE the same way)."""

_EP_TOKENS: list[int] = []
"""The stack of ep_tokens's counts; the innermost is the current step's."""


@contextlib.contextmanager
def ep_tokens(padded: int) -> Iterator[None]:
    """Within: every GatheredTokenExperts layer exchanges `padded` rows per rank (the same on every rank of the
    group; at least each rank's batch). The runner enters it around a forward, a graph capture or an empty step."""
    if padded < 0:
        raise ValueError(f"a step of {padded} rows")
    _EP_TOKENS.append(padded)
    try:
        yield
    finally:
        _EP_TOKENS.pop()


def current_ep_tokens() -> int | None:
    """The rows per rank of the step being run (None: outside ep_tokens)."""
    return _EP_TOKENS[-1] if _EP_TOKENS else None


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GatheredTokenExperts:
    """This rank's share of a MoE layer's experts: `fused_experts`' contract (hidden [T, H], routing [T, k] ->
    [T, H]) for this rank's tokens, with the weights of its experts only (w13 [E/ep, 2I, H], w2 [E/ep, H, I]), by
    all-gather and reduce-scatter of ep_tokens' rows per rank. Collective: every rank of `group` calls it, with
    any T up to the agreed rows (0 included).

    token_share (t, T): the T tensor-parallel ranks of a data-parallel rank hold the same tokens (DP x TP x EP); TP
    rank t exchanges only its contiguous 1/T of them (ceil(rows / T) rows per rank) and returns zeros elsewhere,
    which the MoE block's tensor-parallel all-reduce fills in (as ExpertParallelExperts' token_share)."""

    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None,
                 backend: MoEBackend | None = None, token_share: tuple[int, int] = (0, 1)) -> None:  # fmt: skip
        if not 0 <= token_share[0] < token_share[1]:
            raise ValueError(f"token share {token_share[0]} is not one of {token_share[1]}")
        self.token_share = token_share
        size = 1 if group is None else dist.get_world_size(group)
        if size != placement.ep_size:
            raise ValueError(f"the placement is for {placement.ep_size} expert-parallel ranks but the process "
                             f"group has {size}")
        self.placement = placement
        self.group = group
        self.backend = backend or get_moe_backend("auto")
        if self.backend.name == "deep_gemm":
            raise ValueError("the allgather_reducescatter expert-parallel backend computes masked routing, which "
                             "the deep_gemm experts do not take; use the triton or torch MoE backend")
        self.to_local = placement.local_id_map()
        """int32 [E + 1]: expert id -> this rank's row of its weights, or -1 (another rank's expert, padding)."""

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        share, shares = self.token_share
        if shares == 1:
            return self._share(hidden, w13, w2, topk_weights, topk_ids, current_ep_tokens())
        padded = current_ep_tokens()
        num_tokens = hidden.shape[0]
        per_share = -(-num_tokens // shares)
        first, end = min(share * per_share, num_tokens), min((share + 1) * per_share, num_tokens)
        part = self._share(hidden[first:end], w13, w2, topk_weights[first:end], topk_ids[first:end],
                           None if padded is None else -(-padded // shares))
        flat = topk_ids.reshape(-1).long()  # every shared token's routing: one rank's counts count them all
        self.placement.expert_load.zero_().scatter_add_(0, flat, torch.ones_like(flat))
        out = hidden.new_zeros(hidden.shape)
        out[first:end] = part
        return out

    def _share(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, padded: int | None) -> torch.Tensor:
        num_tokens, hidden_size = hidden.shape
        gathered = self.gather(hidden, topk_weights, topk_ids, padded)
        if gathered is None:  # every rank agreed on an empty step: nothing to exchange
            return hidden.new_empty((0, hidden_size))
        rows, weights, local_ids = gathered
        if rows.shape[0] <= CHUNK_ROWS:
            part = self.backend.fused_experts(rows, w13, w2, weights, local_ids, masked=True)
        else:
            part = torch.empty_like(rows)
            for start in range(0, rows.shape[0], CHUNK_ROWS):
                end = start + CHUNK_ROWS
                part[start:end] = self.backend.fused_experts(rows[start:end], w13, w2, weights[start:end],
                                                             local_ids[start:end], masked=True)
        return self.reduce(part, num_tokens)

    def gather(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """Every rank's rows [ep * P, H], routing weights float32 [ep * P, k] and this rank's local expert ids int32
        [ep * P, k] (-1: another rank's expert, or a padding row); None when the agreed rows are 0. P: `padded`, by
        default the current ep_tokens. Collective."""
        num_tokens, hidden_size = hidden.shape
        padded = current_ep_tokens() if padded is None else padded
        if padded is None:
            raise RuntimeError("GatheredTokenExperts runs inside ep_tokens(rows): the ranks must agree on the "
                               "step's rows before it starts")
        if num_tokens > padded:
            raise ValueError(f"{num_tokens} tokens in a step agreed at {padded} rows per rank")
        if padded == 0:
            self.placement.record_masked(topk_ids.reshape(-1).long(), topk_ids.new_empty((0,)))
            return None
        top_k = topk_ids.shape[1]
        ep = self.placement.ep_size
        rows = hidden.new_zeros((padded, hidden_size))
        rows[:num_tokens] = hidden
        routing = torch.zeros((padded, 2 * top_k), dtype=torch.int32, device=hidden.device)  # weights 0.0
        routing[:, :top_k] = -1  # padding rows route nowhere
        routing[:num_tokens] = pack_routing(topk_ids, topk_weights)
        if self.group is None:
            all_rows, all_routing = rows, routing
        else:
            all_rows = rows.new_empty((ep * padded, hidden_size))
            all_routing = routing.new_empty((ep * padded, 2 * top_k))
            staged(lambda o, i: _all_gather(o, i, group=self.group), all_rows, rows)
            staged(lambda o, i: _all_gather(o, i, group=self.group), all_routing, routing)
        ids, weights = unpack_routing(all_routing)
        local_ids = self.to_local[ids.long()]  # -1 (the last entry) for padding rows
        self.placement.record_masked(topk_ids.reshape(-1).long(), local_ids)
        return all_rows, weights, local_ids

    def reduce(self, part: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This rank's experts' part of every gathered row ([ep * P, H]) summed over the ranks -> this rank's
        [num_tokens, H]. Collective."""
        if self.group is None:
            return part[:num_tokens]
        out = part.new_empty((part.shape[0] // self.placement.ep_size, part.shape[1]))
        staged(lambda o, i: _reduce_scatter(o, i, group=self.group), out, part)
        return out[:num_tokens]
