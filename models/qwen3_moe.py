"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, GQA, paged KV) with the
dense MLP of most layers replaced by a sparse block of routed experts; no shared experts.

The sparse block is routing (a linear router + softmax top-k, kernels/moe/routing.py) followed by the
experts (kernels/moe backends). The two stay apart so that expert parallelism can put a dispatch /
combine between them; the experts' weights are stacked [E, ...] tensors, the slice a rank would keep.

Checkpoints name each expert's projections separately (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
what the Hub's Qwen3-MoE folders and transformers 5's save_pretrained both write); they are stacked at
load into gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]. Checkpoints that
already hold the stacked tensors (transformers 5's in-memory names `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj`) load as they are. `ExpertTensors` does both, for every model built on
`StackedExperts` (DeepSeek-V3 too).

Tensor parallelism splits every expert's intermediate dim: each rank keeps I / tp rows of each expert's gate
and up and the matching columns of its down projection, runs the same routing on the same tokens, and the
block's output is summed over the ranks by one all-reduce after the experts' combine.

Expert parallelism (an expert-parallel group set, models/parallel.py `ep_group`, with `expert_parallel=True`)
keeps whole experts instead, E / ep of them per rank (kernels/moe/expert_parallel.py's contiguous placement).
Over data-parallel ranks each rank routes its own tokens and `ExpertParallelExperts` sends them to the experts'
ranks and back (or, with all2all_backend allgather_reducescatter, `GatheredTokenExperts` gathers every rank's
tokens, computes its experts' share of each and reduce-scatters the sums back). Over the tensor-parallel ranks (`ep_ranks_share_tokens`: TP x EP with one data-parallel rank,
as vLLM does it) every rank routes the same tokens alike and `SharedTokenExperts` computes only its experts'
(token, expert) slots; the block's all-reduce, which plain TP runs too, adds the ranks' partial outputs. Over
all ranks of data parallelism x tensor parallelism each TP rank dispatches its 1/T share of its data-parallel
rank's tokens by all-to-all (`token_share`) and the same all-reduce fills in the others' rows. The
block counts the tokens routed to each expert (`expert_tokens`, summed over every step: what an expert-placement
load balancer reads; under TP x EP every rank counts every token, so one rank's counts are the engine's), and
`empty_step` takes part in the all-to-alls without tokens (an idle data-parallel rank's step). Other ranks'
experts are neither copied nor, through the loader, read (`ExpertTensors.remote`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from flotilla.kernels.moe import MoEBackend, get_moe_backend, select_experts
from flotilla.kernels.moe.ep_allgather import GatheredTokenExperts
from flotilla.kernels.moe.expert_parallel import ExpertParallelExperts, ExpertPlacement, SharedTokenExperts
from flotilla.models.hf_config import HFModelConfig, MoEConfig
from flotilla.models.llama import Linear, LlamaForCausalLM, LlamaMLP
from flotilla.models.parallel import (
    ParallelGroup,
    all_reduce,
    check_shape,
    divide,
    ep_gathers_tokens,
    ep_group,
    ep_ranks_share_tokens,
    tp_group,
)

PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
"""A routed expert's checkpoint tensor: `<layer>.mlp.experts.{e}.{gate,up,down}_proj.weight`."""
_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class StackedExperts(nn.Module):
    """The routed experts of one layer as stacked weights (transformers 5's Qwen3MoeExperts layout), each
    expert's intermediate dim cut to this rank's share under tensor parallelism; with `expert_parallel` and an
    expert-parallel group of several ranks, only this rank's experts (the rows of `placement.local_experts`),
    whole."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: MoEBackend,
                 expert_parallel: bool = False, weight_dtype: torch.dtype | None = None, top_k: int = 1) -> None:
        """weight_dtype: the stacked weights' dtype (default: torch's default dtype, the model's); an FP8 subclass
        passes e4m3 so no float copy of every expert is ever allocated. top_k: the routing's experts per token (the
        shape of an empty step's routing, which the all-gather of expert parallelism exchanges)."""
        super().__init__()
        self.top_k = top_k
        tp = tp_group()
        ep = ep_group() if expert_parallel else None
        self.placement: ExpertPlacement | None = None
        """Which rank holds each expert (None: this rank holds them all)."""
        self.ep_experts: ExpertParallelExperts | SharedTokenExperts | GatheredTokenExperts | None = None
        if ep is not None and ep.size > 1:
            self.placement = ExpertPlacement(num_experts, ep.size, ep.rank, device=torch.get_default_device())
            share = {"token_share": (tp.rank, tp.size)} if tp.size > 1 else {}  # DP x TP x EP: 1/T of the tokens
            if ep_ranks_share_tokens():
                self.ep_experts = SharedTokenExperts(self.placement, backend)
            elif ep_gathers_tokens():
                self.ep_experts = GatheredTokenExperts(self.placement, ep.group, backend, **share)
            else:
                self.ep_experts = ExpertParallelExperts(self.placement, ep.group, backend, **share)
            # int64 [E]: (token, expert) slots this rank routed to each expert since start
            self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        local = num_experts if self.placement is None else self.placement.num_local_experts
        self.first_expert = 0 if self.placement is None else self.placement.first_local_expert
        """The global id of the first stacked expert."""
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        split = tp if self.placement is None else ParallelGroup()  # whole experts under expert parallelism
        intermediate_size = divide(intermediate_size, split.size, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        """This rank's rows of each expert's gate (and of its up)."""
        self.first = split.rank * intermediate_size
        """The first of them in the checkpoint's intermediate dim."""
        self.backend = backend
        # Uninitialized like Linear: weights always come from a checkpoint (or load_format=dummy).
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, dtype=weight_dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, dtype=weight_dtype),
                                      requires_grad=False)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] and the routing [T, k] -> the weighted sum of each token's experts [T, H]."""
        if self.ep_experts is None:
            return self.backend.fused_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        out = self.ep_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        self.expert_tokens += self.placement.expert_load
        return out

    def held_elsewhere(self, expert: int) -> bool:
        """Whether expert `expert` (a global id) is one of the layer's experts that another expert-parallel
        rank holds (False for this rank's and for ids out of range, which loading refuses)."""
        return self.placement is not None and expert < self.num_experts and not (
            0 <= expert - self.first_expert < self.placement.num_local_experts)

    def empty_step(self) -> None:
        """Take part in the expert-parallel all-to-alls with no tokens (collective: the other ranks run a batch;
        nothing runs over the tensor-parallel ranks, which have no all-to-all)."""
        assert self.ep_experts is not None
        w = self.gate_up_proj
        self.ep_experts(w.new_empty((0, self.hidden_size)), w, self.down_proj,
                        torch.empty((0, self.top_k), dtype=torch.float32, device=w.device),
                        torch.empty((0, self.top_k), dtype=torch.int32, device=w.device))

    def local_index(self, expert: int, param: nn.Parameter, names: tuple[str, str]) -> int | None:
        """The row of global `expert` in this rank's stacked `param`; None when another rank holds it."""
        if expert >= self.num_experts:
            raise ValueError(f"checkpoint tensor {names[0]!r} names expert {expert}, but the model has "
                             f"{self.num_experts} experts")  # fmt: skip
        expert -= self.first_expert
        return expert if 0 <= expert < param.shape[0] else None

    def load_expert(self, param: nn.Parameter, expert: int, proj: str, src: torch.Tensor,
                    names: tuple[str, str]) -> bool:
        """One expert's gate_proj / up_proj [I, H] or down_proj [H, I] checkpoint tensor, this rank's part;
        False (nothing copied) for an expert another expert-parallel rank holds."""
        expert = self.local_index(expert, param, names)
        if expert is None:
            return False
        inter, first = self.intermediate_size, self.first
        if proj == "down_proj":
            check_shape(src, (self.hidden_size, self.full_intermediate_size), *names)
            dst, src = param.data[expert], src.narrow(1, first, inter)
        else:
            check_shape(src, (self.full_intermediate_size, self.hidden_size), *names)
            at = 0 if proj == "gate_proj" else inter
            dst, src = param.data[expert].narrow(0, at, inter), src.narrow(0, first, inter)
        with torch.no_grad():
            dst.copy_(src)
        return True

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        """A stacked checkpoint tensor (gate_up_proj [E, 2I, H], down_proj [E, H, I]), this rank's part."""
        e, h, full = self.num_experts, self.hidden_size, self.full_intermediate_size
        inter, first = self.intermediate_size, self.first
        if self.placement is not None:  # an [E, ...] tensor: this rank's experts of it
            src, e = self.placement.local_slice(src), self.placement.num_local_experts
        if param is self.down_proj:
            check_shape(src, (e, h, full), *names)
            parts = [(param.data, src.narrow(2, first, inter))]
        else:
            check_shape(src, (e, 2 * full, h), *names)
            parts = [(param.data.narrow(1, 0, inter), src.narrow(1, first, inter)),
                     (param.data.narrow(1, inter, inter), src.narrow(1, full + first, inter))]
        with torch.no_grad():
            for dst, part in parts:
                dst.copy_(part)


class ExpertTensors:
    """The routed experts' checkpoint tensors of a model built on StackedExperts (Qwen3-MoE, DeepSeek-V3): per
    expert ones (PER_EXPERT) stacked into the layer's gate_up_proj / down_proj, already stacked ones
    (`<layer>.mlp.experts.{gate_up,down}_proj`) sliced, this rank's experts only under expert parallelism.
    `loaded` names the stacked parameters filled: one of per-expert tensors once every expert it holds came
    whole (gate and up, or down)."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, StackedExperts)}
        self.loaded: set[str] = set()
        self._seen: dict[str, set[tuple[int, str]]] = {}

    def _layer(self, prefix: str) -> tuple[str, StackedExperts] | None:
        """The layer `<prefix>` names (headless checkpoints omit the `model.` prefix) and its module path."""
        for candidate in (prefix, f"model.{prefix}"):
            if (layer := self.layers.get(candidate)) is not None:
                return candidate, layer
        return None

    def remote(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (an expert's weight, or its FP8 block scale `..._scale_inv`) belongs
        to an expert another expert-parallel rank holds: not needed here, so neither read nor dequantized."""
        match = PER_EXPERT.match(name.removesuffix("_scale_inv"))
        found = None if match is None else self._layer(match["prefix"])
        return found is not None and found[1].held_elsewhere(int(match["expert"]))

    def keep(self, name: str) -> bool:
        """The models' `checkpoint_filter` for the loader: whether to read checkpoint tensor `name` at all."""
        return not self.remote(name)

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy checkpoint tensor `name` into its layer's stacked parameter (this rank's part) if it is a routed
        expert's (True); False for any other tensor. ValueError naming it on a bad shape or expert index or
        a layer the model does not have."""
        if (match := PER_EXPERT.match(name)) is not None:
            proj = match["proj"]
            stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        elif (match := _STACKED.match(name)) is not None:
            proj, stacked = None, match["proj"]
        else:
            return False
        if (found := self._layer(match["prefix"])) is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.model_name}")
        prefix, layer = found
        param_name, param = f"{prefix}.{stacked}", getattr(layer, stacked)
        if proj is None:  # already stacked: every expert at once
            layer.load(param, tensor, (name, param_name))
            self.loaded.add(param_name)
        elif layer.load_expert(param, int(match["expert"]), proj, tensor, (name, param_name)):
            shards = self._seen.setdefault(param_name, set())
            shards.add((int(match["expert"]), proj))
            if len(shards) == param.shape[0] * (2 if stacked == "gate_up_proj" else 1):
                self.loaded.add(param_name)
        return True


class Qwen3MoeSparseBlock(nn.Module):
    """HF's Qwen3MoeSparseMoeBlock: router (`gate`) -> softmax top-k -> experts."""

    def __init__(self, hidden_size: int, moe: MoEConfig, backend: MoEBackend) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts)
        self.experts = StackedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size, backend,
                                      expert_parallel=True, top_k=moe.num_experts_per_tok)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        # under TP each rank's partial sum (its slice of every expert, or under TP x EP its whole experts): summed
        return all_reduce(self.experts(hidden, topk_weights, topk_ids))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE causal LM; `moe_backend` picks the experts' kernels like attention_backend picks
    attention's ("auto", "torch", "triton", "deep_gemm")."""

    qk_norm: ClassVar[bool] = True

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto",
                 moe_backend: str = "auto") -> None:  # fmt: skip
        if config.moe is None:
            raise ValueError("config.json has no experts (num_experts); not a Qwen3-MoE checkpoint")
        # Set before nn.Module.__init__ runs (a plain attribute, which nn.Module allows): LlamaForCausalLM's
        # __init__ builds the layers through _make_mlp, which needs it.
        self.moe_backend = get_moe_backend(moe_backend, device=torch.get_default_device(),
                                           dtype=torch.get_default_dtype())  # fmt: skip
        super().__init__(config, attention_backend=attention_backend, fused_ops=fused_ops)
        self.moe_backend_name = self.moe_backend.name
        """The experts' kernels chosen (for the ready log line)."""

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        moe = self.config.moe
        assert moe is not None  # checked in __init__
        if moe.is_sparse(layer_idx):
            return Qwen3MoeSparseBlock(self.config.hidden_size, moe, self.moe_backend)
        return LlamaMLP(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """LlamaForCausalLM.load_weights plus the routed experts' tensors (ExpertTensors); a stacked parameter
        counts as loaded once every expert's shards arrived."""
        experts = ExpertTensors(self)
        loaded = super().load_weights((name, tensor) for name, tensor in weights if not experts.load(name, tensor))
        return loaded | experts.loaded

    def checkpoint_filter(self) -> Callable[[str], bool]:
        """For the loader: which checkpoint tensors to read (not other expert-parallel ranks' experts)."""
        return ExpertTensors(self).keep
