"""DeepSeek-V3's MoE parts apart from the block itself (models/deepseek_v3.py): the router, and the routed
experts of an FP8 checkpoint kept in FP8.

FP8 routed experts (`Fp8StackedExperts`): DeepSeek-V3's and Kimi-K2's checkpoints store each expert's gate,
up and down projections as e4m3 with float32 128x128 block scales (`weight_scale_inv`); the experts are most
of the model, so they stay that way in memory (half of bf16) and run through the MoE backend's
fused_experts_fp8 (kernels/moe: the triton W8A8 grouped GEMMs on CUDA, the per-call dequantizing torch path
on CPU). The stacked parameters are StackedExperts' (models/qwen3_moe.py: gate_up_proj [E, 2I, H], down_proj
[E, H, I], this rank's experts and intermediate slice) in e4m3, plus gate_up_proj_scale_inv [E, 2 ceil(I/bn),
ceil(H/bk)] (gate's block rows, then up's) and down_proj_scale_inv [E, ceil(H/bn), ceil(I/bk)].

Loading: the experts' e4m3 weights go through ExpertTensors as float ones do (StackedExperts.load_expert
copies this rank's rows, e4m3 to e4m3); their scales through `Fp8ExpertScales`, this rank's block rows
(gate / up) or block columns (down). Under tensor parallelism each rank's share of every expert's
intermediate dim must start on a weight block and be whole blocks (a partial last block only where the share
ends the tensor), as for the dense FP8 linears; other splits are refused when the model is built. Under
expert parallelism a rank keeps whole experts, E / ep of them, and other ranks' weights and scales are not
read. The dispatch layer (kernels/moe/expert_parallel.py) calls a MoEBackend's fused_experts with this
rank's stacked weights: the layer gives it a backend whose fused_experts reads the scales from the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.kernels.linear import linear_float32
from flotilla.kernels.moe import MoEBackend, select_experts_grouped
from flotilla.kernels.moe.torch_ref import fp8_expert_scale_shapes, w13_block_quantize
from flotilla.kernels.quant import FP8_DTYPE, block_quantize
from flotilla.kernels.quant.fp8_ref import num_blocks
from flotilla.models.hf_config import MoEConfig
from flotilla.models.parallel import check_shape, tp_group
from flotilla.models.qwen3_moe import PER_EXPERT, StackedExperts

SCALE_SUFFIX = "_scale_inv"


class DeepseekV3Router(nn.Module):
    """The MoE gate: float32 router weight [E, H] and score-correction bias [E] (kept in float32 whatever the
    model's dtype, as transformers keeps them: near-equal scores must not be reordered by rounding)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32),
                                                    requires_grad=False)  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (weights float32 [T, k], expert ids int32 [T, k])."""
        moe = self.moe
        logits = linear_float32(hidden, self.weight)
        return select_experts_grouped(logits, moe.num_experts_per_tok, moe.num_groups, moe.topk_groups,
                                      self.e_score_correction_bias, moe.norm_topk_prob,
                                      moe.routed_scaling_factor)  # fmt: skip


class Fp8StackedExperts(StackedExperts):
    """StackedExperts with e4m3 weights and their float32 block scales (the module docstring has the shapes),
    run by `backend.fused_experts_fp8`. Activations keep the model dtype (torch's default when built)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: MoEBackend,
                 block_size: tuple[int, int], top_k: int = 1) -> None:  # fmt: skip
        if backend.fused_experts_fp8 is None:
            raise ValueError(f"MoE backend {backend.name!r} has no FP8 experts")
        # The layer's own backend (and the dispatch layer's, under expert parallelism) reads the scales from here.
        super().__init__(num_experts, hidden_size, intermediate_size,
                         MoEBackend(name=backend.name, fused_experts=self._fused_experts), expert_parallel=True,
                         weight_dtype=FP8_DTYPE, top_k=top_k)
        self.fp8_backend = backend
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.dtype = torch.get_default_dtype()
        """The activations' dtype (the model's)."""
        bn, bk = self.block_size
        inter, first, full = self.intermediate_size, self.first, self.full_intermediate_size
        for block, unit in ((bn, "gate / up rows"), (bk, "down_proj input columns")):
            if first % block or (inter % block and first + inter != full):
                tp = tp_group()
                raise ValueError(f"the routed experts: tensor-parallel rank {tp.rank} of {tp.size} would keep {inter} "
                                 f"of each expert's {full} {unit} from {first} on, which do not fall on the FP8 "
                                 f"weight blocks of {block}: each rank's share must be a multiple of the weight "
                                 "block (use a tensor-parallel size that splits it into whole blocks, or expert "
                                 "parallelism)")  # fmt: skip
        local = self.gate_up_proj.shape[0]
        w13_scale, w2_scale = fp8_expert_scale_shapes(local, hidden_size, inter, self.block_size)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(w13_scale, dtype=torch.float32), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(w2_scale, dtype=torch.float32), requires_grad=False)

    def _fused_experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, masked: bool = False) -> torch.Tensor:  # fmt: skip
        """fused_experts' contract on this layer's stacked e4m3 weights (w13, w2: gate_up_proj, down_proj)."""
        assert self.fp8_backend.fused_experts_fp8 is not None
        return self.fp8_backend.fused_experts_fp8(hidden, w13, self.gate_up_proj_scale_inv, w2, self.down_proj_scale_inv,
                                                  topk_weights, topk_ids, self.block_size, masked)  # fmt: skip

    def empty_step(self) -> None:
        """StackedExperts.empty_step with activations of the model dtype (not the weights' e4m3)."""
        assert self.ep_experts is not None
        device = self.gate_up_proj.device
        self.ep_experts(torch.empty((0, self.hidden_size), dtype=self.dtype, device=device), self.gate_up_proj,
                        self.down_proj, torch.empty((0, self.top_k), dtype=torch.float32, device=device),
                        torch.empty((0, self.top_k), dtype=torch.int32, device=device))  # fmt: skip

    def load_expert_scale(self, param: nn.Parameter, expert: int, proj: str, src: torch.Tensor,
                          names: tuple[str, str]) -> bool:  # fmt: skip
        """One expert's gate_proj / up_proj scales [ceil(I/bn), ceil(H/bk)] or down_proj's [ceil(H/bn), ceil(I/bk)],
        this rank's block rows / columns; False (nothing copied) for an expert another rank holds."""
        expert = self.local_index(expert, param, names)
        if expert is None:
            return False
        (bn, bk), h, full = self.block_size, self.hidden_size, self.full_intermediate_size
        if proj == "down_proj":
            check_shape(src, (num_blocks(h, bn), num_blocks(full, bk)), *names)
            first, count = self.first // bk, num_blocks(self.intermediate_size, bk)
            dst, src = param.data[expert], src.narrow(1, first, count)
        else:
            check_shape(src, (num_blocks(full, bn), num_blocks(h, bk)), *names)
            first, count = self.first // bn, num_blocks(self.intermediate_size, bn)
            dst = param.data[expert].narrow(0, 0 if proj == "gate_proj" else count, count)
            src = src.narrow(0, first, count)
        with torch.no_grad():
            dst.copy_(src)
        return True

    @torch.no_grad()
    def dummy_init_(self, generator: torch.Generator, bound: float = 1e-3) -> None:
        """Random weights for load_format=dummy: uniform(-bound, bound) quantized into weights and scales."""
        for e in range(self.gate_up_proj.shape[0]):
            for param, scales, quantize in ((self.gate_up_proj, self.gate_up_proj_scale_inv, w13_block_quantize),
                                            (self.down_proj, self.down_proj_scale_inv, block_quantize)):  # fmt: skip
                w = torch.empty(param.shape[1:], dtype=torch.float32, device=param.device)
                w.uniform_(-bound, bound, generator=generator)
                param[e], scales[e] = quantize(w, self.block_size)

    def extra_repr(self) -> str:
        return (f"experts={self.gate_up_proj.shape[0]}/{self.num_experts}, intermediate={self.intermediate_size}, "
                f"block_size={self.block_size}, backend={self.fp8_backend.name}")  # fmt: skip


class Fp8ExpertScales:
    """The block scales of a model's FP8 routed experts (`<layer>.mlp.experts.{e}.{gate,up,down}_proj.
    weight_scale_inv`), copied into their layer's stacked scales (this rank's part) like ExpertTensors does the
    weights. `loaded` names the stacked scale parameters filled (every expert the rank holds, whole)."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8StackedExperts)}
        self.loaded: set[str] = set()
        self._seen: dict[str, set[tuple[int, str]]] = {}

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy checkpoint tensor `name` if it is an FP8 routed expert's scale (True); False for any other."""
        if not name.endswith(SCALE_SUFFIX) or (match := PER_EXPERT.match(name.removesuffix(SCALE_SUFFIX))) is None:
            return False
        found = [(p, self.layers[p]) for p in (match["prefix"], f"model.{match['prefix']}") if p in self.layers]
        if not found:
            return False  # not an FP8 experts layer: the caller decides (a float model's experts take no scales)
        prefix, layer = found[0]
        proj, expert = match["proj"], int(match["expert"])
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        param_name = f"{prefix}.{stacked}{SCALE_SUFFIX}"
        param = getattr(layer, f"{stacked}{SCALE_SUFFIX}")
        if layer.load_expert_scale(param, expert, proj, tensor, (name, param_name)):
            shards = self._seen.setdefault(param_name, set())
            shards.add((expert, proj))
            if len(shards) == param.shape[0] * (2 if stacked == "gate_up_proj" else 1):
                self.loaded.add(param_name)
        return True

    def is_fp8(self, name: str) -> bool:
        """Whether checkpoint weight `name` is a routed expert's of an FP8 experts layer (loaded as it is)."""
        match = PER_EXPERT.match(name)
        return match is not None and any(p in self.layers for p in (match["prefix"], f"model.{match['prefix']}"))
