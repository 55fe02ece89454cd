"""Expert parallelism: the experts of a MoE layer spread over the ranks of a group, each token's hidden state
sent to the ranks owning its experts and the results sent back (wide EP's dispatch / combine).

Each rank routes its own tokens (kernels/moe/routing.py) and holds only its experts' stacked weights; the
layer (`ExpertParallelExperts`) keeps `fused_experts`' contract for the tokens of this rank:

1. dispatch: each token goes once to every rank that owns one of its experts (DeepEP's way: a token with three
   experts on one rank sends one row there, not three), with its routing masked to that rank's experts (local
   ids, -1 for the other ranks' experts, and the weights; both packed in one int32 tensor); the
   per-destination row counts go first (an all-to-all of split sizes), then the rows and their routing
   (`torch.distributed.all_to_all_single` with uneven splits; gloo and nccl both take it).
2. the receiving rank runs what it got through kernels/moe's `fused_experts` with its local weights and the
   masked routing: each received row's weighted sum over this rank's experts of its token.
3. combine: the partial sums go back along the reverse all-to-all and each token adds its ranks' partials in
   float32 (rank order), rounding once. With one rank that is the reference to the bit; across ranks each
   rank's partial is rounded to the activation dtype before the sum, and an expert's GEMM gets other rows
   beside a token's (CPU BLAS results for a row can change in the last bits with the number of rows), so
   outputs agree to rounding, not to the bit.

Every rank takes part in every collective, including one with no tokens (an idle data-parallel rank runs
an empty batch). The split sizes are read back to the host before the rows move, so a step is not
capturable in a CUDA graph; deep_ep's low-latency kernels (fixed-size buffers, no host sync) are the path
for that. Not built: deep_ep itself — "deep_ep" is a name `get_ep_backend` knows and refuses.

`ExpertPlacement` maps each expert to its rank and to its row in that rank's stacked weights (contiguous
today: rank r owns experts [r*E/ep, (r+1)*E/ep)), and keeps the last step's per-expert token counts, which
is what an expert-placement load balancer (EPLB) reads.

Data parallelism x tensor parallelism (D x T ranks, experts over all of them): each data-parallel rank's T
tensor-parallel ranks hold the same tokens, so `ExpertParallelExperts(token_share=(t, T))` has TP rank t dispatch
and combine only its 1/T share of them over the group of all D*T ranks, with zeros in the other rows; the MoE
block's tensor-parallel all-reduce then puts the whole output on every TP rank (a zero plus a value is the value:
each token's result is exactly the one the all-to-all brought back). vLLM's naive DP x EP backends gather every
DP rank's tokens on every rank instead and reduce the results back; this moves each (token, expert) slot once.

Ranks that hold the same tokens (the tensor-parallel ranks of one data-parallel rank: vLLM's TP x EP without
data parallelism) need no dispatch: `SharedTokenExperts` computes, on each rank, only the slots of its own
experts, the others masked (expert id -1 adds nothing, as vLLM's expert map with -1: kernels/moe/torch_ref.py),
into a partial output; the MoE block's tensor-parallel all-reduce then adds the ranks' partials. It runs no
collective of its own and reads nothing back to the host, so a step is capturable in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flotilla.kernels.comm import staged
from flotilla.kernels.moe import MoEBackend, get_moe_backend

__all__ = [
    "Dispatched",
    "ExpertParallelExperts",
    "ExpertPlacement",
    "SharedTokenExperts",
    "available_ep_backends",
    "combine",
    "dispatch",
    "get_ep_backend",
]


class ExpertPlacement:
    """Which rank of an expert-parallel group of `ep_size` holds each of `num_experts` experts, and the
    per-expert load of the last step.

    Contiguous: rank r owns experts [r * E / ep, (r + 1) * E / ep) as rows 0.. of its stacked weights.
    Dispatch reads only the two maps below, so a rebalanced placement is a matter of building other maps.
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, device: torch.device | None = None) -> None:
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ValueError(f"expert-parallel rank {ep_rank} is not in a group of {ep_size}")
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over an expert-parallel group of "
                             f"{ep_size} ranks (num_experts must be divisible by the EP size)")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = num_experts // ep_size
        self.first_local_expert = ep_rank * self.num_local_experts
        experts = torch.arange(num_experts, device=device)
        self.expert_to_rank = experts // self.num_local_experts
        """int64 [E]: the rank holding each expert."""
        self.expert_to_local = experts % self.num_local_experts
        """int64 [E]: each expert's row in its rank's stacked weights."""
        self.expert_load = torch.zeros(num_experts, dtype=torch.int64, device=device)
        """int64 [E]: (token, expert) slots this rank routed to each expert in the last step."""
        self.local_expert_load = torch.zeros(self.num_local_experts, dtype=torch.int64, device=device)
        """int64 [E / ep]: rows each of this rank's experts received from all ranks in the last step (its
        whole load, the sum of every rank's expert_load for it)."""

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts, in the order of its stacked weights."""
        return range(self.first_local_expert, self.first_local_expert + self.num_local_experts)

    def local_slice(self, stacked: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole stacked expert tensor ([E, ...], e.g. w13 or w2)."""
        if stacked.shape[0] != self.num_experts:
            raise ValueError(f"a stacked expert tensor of {stacked.shape[0]} experts, expected {self.num_experts}")
        return stacked.narrow(0, self.first_local_expert, self.num_local_experts)

    def record_masked(self, routed: torch.Tensor, local_ids: torch.Tensor) -> None:
        """The step's loads: routed int64 [slots] the experts of this rank's routing; local_ids int [any shape] the
        masked routing this rank's experts computed, -1 for the slots it does not compute (no host sync: those are
        counted as zeros, not filtered out)."""
        self.expert_load.zero_().scatter_add_(0, routed, torch.ones_like(routed))
        flat = local_ids.reshape(-1).long()
        self.local_expert_load.zero_().scatter_add_(0, flat.clamp(min=0), (flat >= 0).long())

    def local_id_map(self) -> torch.Tensor:
        """int32 [E + 1]: each expert id's row in this rank's stacked weights, -1 for another rank's expert; the
        last entry (what id -1 reads) is -1 too. Indexing it with a routing's ids gives masked routing
        (kernels/moe/torch_ref.py): this rank's share of the slots."""
        first, local = self.first_local_expert, self.num_local_experts
        table = torch.full((self.num_experts + 1,), -1, dtype=torch.int32, device=self.expert_to_local.device)
        table[first:first + local] = torch.arange(local, dtype=torch.int32, device=table.device)
        return table


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What a rank received in a dispatch, and what combine needs to send the results back."""

    hidden: torch.Tensor
    """[R, H]: the rows sent to this rank, grouped by source rank (rank 0's first): one per (token, this rank)."""
    local_ids: torch.Tensor
    """int32 [R, k]: each row's routing as rows of this rank's stacked weights, -1 for another rank's expert."""
    weights: torch.Tensor
    """float32 [R, k]: the routing weights of those slots (0.0 where masked)."""
    tokens: torch.Tensor
    """int64 [P]: the token of each row this rank sent, in the order sent (destination rank, then token)."""
    num_tokens: int
    """Tokens of this rank's batch (combine's rows)."""
    send_splits: list[int]
    """Rows this rank sent to each rank."""
    recv_splits: list[int]
    """Rows this rank received from each rank."""


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:  # one rank: what is sent is what is received
        out.copy_(inp)
    else:
        staged(lambda o, i: dist.all_to_all_single(o, i, out_splits, in_splits, group=group), out, inp)
    return out


def pack_routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Routing ids int [N, k] and weights [N, k] as one int32 [N, 2k] tensor (the weights' float32 bits), so that one
    collective moves both (unpack_routing undoes it)."""
    return torch.cat([ids.to(torch.int32), weights.to(torch.float32).view(torch.int32)], dim=1)


def unpack_routing(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_routing's int32 [N, 2k] -> (ids int32 [N, k], weights float32 [N, k])."""
    top_k = packed.shape[1] // 2
    return packed[:, :top_k].contiguous(), packed[:, top_k:].contiguous().view(torch.float32)


def dispatch(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, placement: ExpertPlacement,
             group: dist.ProcessGroup | None) -> Dispatched:
    """Send each token's hidden row ([T, H]; routing topk_weights / topk_ids [T, k]) once to every rank owning one
    of its experts, with its routing masked to that rank's experts; records the step's loads in `placement`.
    Collective: every rank of `group` calls it, with any T (0 included). `group` None means one rank."""
    ep = placement.ep_size
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.to(torch.int64)
    dest = placement.expert_to_rank[ids]  # [T, k]
    ranks = torch.arange(ep, device=hidden.device)
    to_rank = (dest.unsqueeze(0) == ranks.view(ep, 1, 1))  # [ep, T, k]: slot j of token t lives on rank r
    pairs = to_rank.any(dim=2)  # [ep, T]
    send_counts = pairs.sum(dim=1)
    recv_counts = _all_to_all(torch.empty_like(send_counts), send_counts, None, None, group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # the one host sync of a step
    received = sum(recv_splits)

    rank_of, tokens = torch.nonzero(pairs, as_tuple=True)  # row-major: grouped by destination rank, then token
    mine = to_rank[rank_of, tokens]  # [P, k]
    local = torch.where(mine, placement.expert_to_local[ids[tokens]], -1).to(torch.int32)
    weights = torch.where(mine, topk_weights[tokens].to(torch.float32), 0.0)
    routing = pack_routing(local, weights)  # one all-to-all for both
    recv_hidden = hidden.new_empty((received, hidden.shape[1]))
    recv_routing = routing.new_empty((received, 2 * top_k))
    _all_to_all(recv_hidden, hidden.index_select(0, tokens), recv_splits, send_splits, group)
    _all_to_all(recv_routing, routing, recv_splits, send_splits, group)
    recv_ids, recv_weights = unpack_routing(recv_routing)
    placement.record_masked(ids.reshape(-1), recv_ids)
    return Dispatched(hidden=recv_hidden, local_ids=recv_ids, weights=recv_weights, tokens=tokens,
                      num_tokens=num_tokens, send_splits=send_splits, recv_splits=recv_splits)


def combine(expert_out: torch.Tensor, dispatched: Dispatched, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send the experts' weighted partial sums for the received rows ([R, H], in dispatched.hidden's order) back
    to their ranks and add each token's partials -> [T, H] in expert_out's dtype. Collective, like dispatch."""
    width = expert_out.shape[1]
    back = expert_out.new_empty((dispatched.tokens.shape[0], width))
    _all_to_all(back, expert_out, dispatched.send_splits, dispatched.recv_splits, group)
    out = torch.zeros((dispatched.num_tokens, width), dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, dispatched.tokens, back.float())  # a token's partials in destination-rank order
    return out.to(expert_out.dtype)


def available_ep_backends() -> list[str]:
    """Dispatch / combine implementations get_ep_backend knows ("deep_ep" only where it imports)."""
    return ["all_to_all", *(["deep_ep"] if importlib.util.find_spec("deep_ep") is not None else [])]


def get_ep_backend(name: str = "auto") -> str:
    """The dispatch implementation called `name`; "auto" is all_to_all (torch.distributed's, on the group's
    backend: nccl on CUDA, gloo on CPU). deep_ep is the seam for DeepEP's kernels and is not built: asking
    for it is refused, whether or not the package is there."""
    if name in ("auto", "all_to_all"):
        return "all_to_all"
    if name == "deep_ep":
        if "deep_ep" not in available_ep_backends():
            raise ValueError("EP backend 'deep_ep' needs the deep_ep package")
        raise NotImplementedError("EP backend 'deep_ep' is not built yet; use 'all_to_all'")
    raise ValueError(f"unknown EP backend {name!r}; choices: auto, {', '.join(available_ep_backends())}")


class ExpertParallelExperts:
    """This rank's share of a MoE layer's experts: `fused_experts`' contract (hidden [T, H], routing [T, k] ->
    [T, H]) for this rank's tokens, with the weights of its experts only (w13 [E/ep, 2I, H], w2 [E/ep, H, I],
    see ExpertPlacement.local_slice)."""

    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None,
                 backend: MoEBackend | None = None, ep_backend: str = "auto",
                 token_share: tuple[int, int] = (0, 1)) -> None:
        """token_share: (this rank's index, count) among the ranks that hold the same tokens (the
        tensor-parallel ranks of one data-parallel rank under DP x TP x EP): each dispatches only its contiguous
        share of them and returns zeros elsewhere, so the caller's tensor-parallel all-reduce fills in the rest."""
        size = 1 if group is None else dist.get_world_size(group)
        if not 0 <= token_share[0] < token_share[1]:
            raise ValueError(f"token share {token_share[0]} is not one of {token_share[1]}")
        if size != placement.ep_size:
            raise ValueError(f"the placement is for {placement.ep_size} expert-parallel ranks but the process "
                             f"group has {size}")
        if group is not None and dist.get_rank(group) != placement.ep_rank:
            raise ValueError(f"the placement is for rank {placement.ep_rank} but this process is rank "
                             f"{dist.get_rank(group)} of the group")
        self.placement = placement
        self.group = group
        self.backend = backend or get_moe_backend("auto")
        self.ep_backend = get_ep_backend(ep_backend)
        self.token_share = token_share

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        _check_local_weights(self.placement, w13, w2)
        share, shares = self.token_share
        if shares == 1:
            return self._dispatched(hidden, w13, w2, topk_weights, topk_ids)
        # Rows [first, end) of the tokens every sharing rank holds: the ranks' shares cover each token once
        # (a share may be empty; its rank still takes part in the all-to-alls).
        num_tokens = hidden.shape[0]
        per_share = -(-num_tokens // shares)
        first, end = min(share * per_share, num_tokens), min((share + 1) * per_share, num_tokens)
        part = self._dispatched(hidden[first:end], w13, w2, topk_weights[first:end], topk_ids[first:end])
        # the routing of every shared token, not only this share's, so that one rank's counts count them all
        flat = topk_ids.reshape(-1).to(torch.int64)
        self.placement.expert_load.zero_().scatter_add_(0, flat, torch.ones_like(flat))
        out = hidden.new_zeros(hidden.shape)
        out[first:end] = part
        return out

    def _dispatched(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        sent = dispatch(hidden, topk_weights, topk_ids, self.placement, self.group)
        if sent.hidden.shape[0]:
            expert_out = self.backend.fused_experts(sent.hidden, w13, w2, sent.weights, sent.local_ids, masked=True)
        else:  # nothing came: the empty result still goes through combine's all-to-all
            expert_out = sent.hidden
        return combine(expert_out, sent, self.group)


def _check_local_weights(placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
    local = placement.num_local_experts
    if w13.shape[0] != local or w2.shape[0] != local:
        raise ValueError(f"expected the stacked weights of this rank's {local} experts, got {w13.shape[0]} "
                         f"(w13) and {w2.shape[0]} (w2)")


class SharedTokenExperts:
    """This rank's share of a MoE layer's experts when every rank of the expert-parallel group holds the same
    tokens and routing (the tensor-parallel ranks): `fused_experts`' contract (hidden [T, H], routing [T, k] ->
    [T, H]) with the weights of this rank's experts only, giving the part of each token's weighted sum that its
    experts here contribute (zero for a token routed only elsewhere). The sum over the ranks (the caller's
    all-reduce) is the whole layer's output. Masked routing (the other ranks' slots are id -1): no host sync, no
    gather or scatter of rows, static shapes."""

    def __init__(self, placement: ExpertPlacement, backend: MoEBackend | None = None) -> None:
        self.placement = placement
        self.backend = backend or get_moe_backend("auto")
        self.to_local = placement.local_id_map()

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        p = self.placement
        _check_local_weights(p, w13, w2)
        local_ids = self.to_local[topk_ids.long()]
        p.record_masked(topk_ids.reshape(-1).long(), local_ids)  # every rank counts every token (report one rank's)
        if hidden.shape[0] == 0:
            return hidden.new_empty(hidden.shape)
        return self.backend.fused_experts(hidden, w13, w2, topk_weights, local_ids, masked=True)
