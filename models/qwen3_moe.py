"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, GQA, paged KV) with the
dense MLP of most layers replaced by a sparse block of routed experts; no shared experts.

The sparse block is routing (a linear router + softmax top-k, kernels/moe/routing.py) followed by the
experts (kernels/moe backends). The two stay apart so that expert parallelism can put a dispatch /
combine between them; the experts' weights are stacked [E, ...] tensors, the slice a rank would keep.

Checkpoints name each expert's projections separately (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
what the Hub's Qwen3-MoE folders and transformers 5's save_pretrained both write); they are stacked at
load into gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]. Checkpoints that
already hold the stacked tensors (transformers 5's in-memory names `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj`) load as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from flotilla.kernels.moe import MoEBackend, get_moe_backend, select_experts
from flotilla.models.hf_config import HFModelConfig, MoEConfig
from flotilla.models.llama import Linear, LlamaForCausalLM, LlamaMLP, _copy_checked

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class StackedExperts(nn.Module):
    """The routed experts of one layer as stacked weights (transformers 5's Qwen3MoeExperts layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: MoEBackend) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.backend = backend
        # Uninitialized like Linear: weights always come from a checkpoint (or load_format=dummy).
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] and the routing [T, k] -> the weighted sum of each token's experts [T, H]."""
        return self.backend.fused_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class Qwen3MoeSparseBlock(nn.Module):
    """HF's Qwen3MoeSparseMoeBlock: router (`gate`) -> softmax top-k -> experts."""

    def __init__(self, hidden_size: int, moe: MoEConfig, backend: MoEBackend) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts)
        self.experts = StackedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size, backend)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        return self.experts(hidden, topk_weights, topk_ids)


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
        """LlamaForCausalLM.load_weights plus per-expert tensors stacked into the experts' parameters; a
        stacked parameter counts as loaded once every expert's shards arrived."""
        params = dict(self.named_parameters())
        seen: dict[str, set[tuple[int, str]]] = {}
        loaded: set[str] = set()

        def dense_and_stacked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _PER_EXPERT.match(name)
                if match is None:
                    yield name, tensor
                    continue
                proj = match["proj"]
                fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
                param_name = self._param_name(params, f"{match['prefix']}.{fused}", name)
                param = params[param_name]
                expert = int(match["expert"])
                if expert >= param.shape[0]:
                    raise ValueError(f"checkpoint tensor {name!r} names expert {expert}, but the model has "
                                     f"{param.shape[0]} experts")  # fmt: skip
                dst = param.data[expert]
                if fused == "gate_up_proj":
                    inter = param.shape[1] // 2
                    dst = dst.narrow(0, 0 if proj == "gate_proj" else inter, inter)
                _copy_checked(dst, tensor, name, param_name)
                shards = seen.setdefault(param_name, set())
                shards.add((expert, proj))
                if len(shards) == param.shape[0] * (2 if fused == "gate_up_proj" else 1):
                    loaded.add(param_name)

        loaded |= super().load_weights(dense_and_stacked())
        return loaded
