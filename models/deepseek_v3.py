"""DeepSeek-V3 (and Kimi-K2, the same architecture with its own config values): multi-head latent
attention (MLA) over a paged compressed KV cache, and MoE layers with shared experts and grouped top-k
routing, over flotilla's kernels.

MLA (multi-head latent attention over a paged compressed KV cache, weight absorption for decode):
models/deepseek_v3_mla.py.

MoE. Layers from first_k_dense_replace on: sigmoid router scores, grouped top-k with the score-correction
bias (kernels/moe/routing.select_experts_grouped), the routed experts through kernels/moe's fused_experts
on stacked [E, 2I, H] / [E, H, I] weights, plus the shared experts as one dense MLP. Earlier layers have a
dense MLP.

Tensor parallelism (models/parallel.py `tp_group`, as vLLM and SGLang split MLA models): attention by heads
(models/deepseek_v3_mla.py; the latent cache's shape does not depend on tp). The dense MLPs and the shared experts
split their intermediate dim (gate/up column-, down row-parallel); the routed experts split each expert's
intermediate dim
(StackedExperts) under a replicated router, and a MoE layer sums the routed and shared experts' partial outputs
with one all-reduce. Embedding and LM head are vocab-parallel.
FP8 linears slice their weights and block scales together (Fp8ColumnParallelLinear, Fp8RowParallelLinear);
a split that does not fall on the weight blocks is refused when the model is built. Under speculative
decoding (MTP) every rank runs the MTP layer on its heads and experts too; rank 0 samples the verify step's
tokens for the group (actors/spec_decode.py), and the drafts are the argmax of the gathered logits, the same on
every rank.

Expert parallelism (under enable_expert_parallel: the engine's data-parallel ranks with all-to-all dispatch, its
tensor-parallel ranks with every token on each and the TP all-reduce, or all D x T ranks with each TP rank
dispatching its share of its DP rank's tokens; models/parallel.py `ep_group`): as
Qwen3-MoE's (models/qwen3_moe.py, whose StackedExperts and ExpertTensors serve both), each
rank keeps E / ep routed experts and loads only their tensors (an FP8 checkpoint's other experts are not
even read), routes its own tokens (the grouped top-k, routed_scaling_factor included in the weights),
and the experts' ExpertParallelExperts sends the (token, expert) slots to their owners and combines the
weighted results (SharedTokenExperts computes its own slots of the shared tokens instead); the shared experts, the dense layers (first_k_dense_replace) and attention stay whole on
every rank. An idle rank's empty step runs each MoE layer's all-to-alls, in layer order.

Checkpoints: HF names; per-expert tensors (Hub, transformers 5's save_pretrained) are stacked at load and
already stacked ones load as they are; gate/up pairs are fused into one GEMM, and so are q_a_proj and
kv_a_proj_with_mqa (fused_qkv_a_proj, rows [q_a | kv_a]: both read the same hidden, so one activation
quantization and one GEMM fewer per layer), unless an FP8 block would hold rows of both (q_lora_rank not a
multiple of the weight block's rows): then they stay two layers. The MTP layers (indices >= num_hidden_layers)
are skipped unless the model is built with `mtp=True` (speculative decoding).

MTP (multi-token prediction, DeepSeek-V3 section 2.2). Checkpoint layer num_hidden_layers holds one more
decoder block (MLA + MoE) behind enorm / hnorm RMSNorms and eh_proj: for position i it reads the main model's
final hidden state h_i and the embedding of token i+1, eh_proj(concat(enorm(embed), hnorm(h_i))) goes through
the block, and shared_head.norm plus the LM head give a guess of token i+2. It has its own latent KV cache
layer (the model's last cache layer, so `num_layers` counts it) and shares the main model's embedding and
LM head (the checkpoint's copies of them in that layer are identical and skipped, as SGLang does).
actors/spec_decode.py drives it.

FP8 checkpoints (config.json quantization_config {"quant_method": "fp8", "weight_block_size": [bn, bk]}):
the q / kv_a projections, o_proj, the dense MLPs and the shared experts are Fp8BlockLinear (e4m3 `weight`
+ float32 `weight_scale_inv` per block, kernels/quant's backends; their tensor-parallel subclasses when split);
the routed experts stay e4m3 with their block scales too (models/deepseek_v3_moe.py Fp8StackedExperts, run by
the MoE backend's FP8 grouped GEMMs; each rank's share of an expert's intermediate dim must be whole blocks);
kv_b_proj (read as W_UK / W_UV by the absorbed attention) is dequantized once at load into the model dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from flotilla.config import DEFAULT_BLOCK_SIZE
from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.mla import MLABackend, best_mla_backend, get_mla_backend, mla_cache_shape
from flotilla.kernels.mla.dsa_ref import index_part_width
from flotilla.kernels.mla.flash_mla_backend import BLOCK_SIZE as FLASH_MLA_BLOCK
from flotilla.kernels.moe import MoEBackend, get_moe_backend
from flotilla.kernels.ops import current_ops, get_ops, use_ops
from flotilla.kernels.quant import FP8_DTYPE, block_dequantize, get_fp8_backend
from flotilla.models.deepseek_v3_mla import (ROPE_ROWS, WHOLE, DeepseekV3Attention, deinterleaved_rope_rows,
                                              rope_rows_in_blocks)
from flotilla.models.deepseek_v3_moe import SCALE_SUFFIX, DeepseekV3Router, Fp8ExpertScales, Fp8StackedExperts
from flotilla.models.hf_config import HFModelConfig, MLAConfig, MoEConfig
from flotilla.models.linears import Linears
from flotilla.models.llama import Linear, PreNormDecoderLayer, RMSNorm, RotaryEmbedding, _copy_checked
from flotilla.models.parallel import VocabParallelEmbedding, all_reduce, vocab_parallel_logits
from flotilla.models.qwen3_moe import PER_EXPERT, ExpertTensors, StackedExperts

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_FUSED_PART = re.compile(r"\.(gate_proj|up_proj|q_a_proj|kv_a_proj_with_mqa)\.(weight|weight_scale_inv|bias)$")
_FUSED_INTO = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
               "q_a_proj": ("fused_qkv_a_proj", "q_a"), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", "kv_a")}
"""Checkpoint projection -> (the fused layer it is a part of, its shard id there), where the model built that layer:
gate/up always, the latent projections when DeepseekV3Attention fused them."""

def _present(params: dict[str, nn.Parameter], candidate: str) -> str | None:
    """The parameter named `candidate`, or `model.` + it (headless checkpoints omit the prefix); None if neither."""
    return next((name for name in (candidate, f"model.{candidate}") if name in params), None)


class DeepseekV3MLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one GEMM (the dense layers' MLP and the shared experts), this
    rank's slice of the intermediate dim; down_proj all-reduces unless `reduce_results=False` (the shared
    experts: the MoE block sums them with the routed experts' partial output before its one all-reduce).
    An FP8 one needs each rank's share of gate (and of up) to be whole weight blocks."""

    def __init__(self, hidden_size: int, intermediate_size: int, linears: Linears, reduce_results: bool = True,
                 what: str = "an MLP") -> None:  # fmt: skip
        super().__init__()
        self.gate_up_proj = linears.column(hidden_size, {"gate": intermediate_size, "up": intermediate_size},
                                           f"{what} of intermediate size {intermediate_size} (gate and up fused)")
        self.down_proj = linears.row(intermediate_size, hidden_size, f"the down_proj of {what}",
                                     reduce_results=reduce_results)  # fmt: skip
        self.ops = current_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DeepseekV3MoE(nn.Module):
    """Router -> routed experts (kernels/moe) + shared experts (a dense MLP every token passes)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, backend: MoEBackend, linears: Linears,
                 fp8_experts: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.gate = DeepseekV3Router(hidden_size, moe)  # replicated: every TP rank routes the same tokens alike
        if not fp8_experts or linears.block_size is None:
            self.experts = StackedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size, backend,
                                          expert_parallel=True, top_k=moe.num_experts_per_tok)  # fmt: skip
        else:  # an FP8 checkpoint's experts stay e4m3 (models/deepseek_v3_moe.py)
            self.experts = Fp8StackedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size, backend,
                                             linears.block_size, top_k=moe.num_experts_per_tok)  # fmt: skip
        self.shared_experts = (DeepseekV3MLP(hidden_size, moe.moe_intermediate_size * moe.num_shared_experts, linears,
                                             reduce_results=False, what="the shared experts")
                               if moe.num_shared_experts else None)  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)  # this rank's tokens; scaled by routed_scaling_factor
        out = self.experts(hidden, topk_weights, topk_ids)  # dispatched to the experts' ranks under EP
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        # under TP both are this rank's partial sums (its slice of every expert's intermediate dim): one all-reduce
        return all_reduce(out)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    """DeepSeek's block: MLA attention, then a dense MLP or the MoE."""

    def __init__(self, config: HFModelConfig, mla: MLAConfig, backend: MLABackend, mlp: nn.Module,
                 linears: Linears, layer_idx: int = 0) -> None:  # fmt: skip
        super().__init__(config, DeepseekV3Attention(config, mla, backend, linears, layer_idx), mlp)


class DeepseekV3SharedHead(nn.Module):
    """The MTP layer's `shared_head`: its final norm (the head itself is the main model's LM head)."""

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction module: enorm(embedding of the next token) and hnorm(main hidden state)
    through eh_proj, then an ordinary DeepSeek block (MLA over its own cache layer, MoE or dense MLP)."""

    def __init__(self, config: HFModelConfig, mla: MLAConfig, backend: MLABackend, mlp: nn.Module,
                 linears: Linears, layer_idx: int) -> None:  # fmt: skip
        super().__init__(config, mla, backend, mlp, linears, layer_idx)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size)  # not FP8 in DeepSeek's checkpoint
        self.shared_head = DeepseekV3SharedHead(config)

    def propose(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """embeds [T, H] of tokens i+1, prev_hidden [T, H] at positions i -> the block's output [T, H] (before
        shared_head.norm; fed back as prev_hidden when it drafts a further token)."""
        embeds = torch.where((positions == 0).unsqueeze(-1), 0.0, embeds)  # as vLLM: no embedding at position 0
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden)), dim=-1))
        hidden, residual = self(x, None, positions, cos_sin_cache, kv_cache, meta)
        return hidden + residual


class DeepseekV3Model(nn.Module):
    """Embedding, decoder stack and final norm (HF's `model.` prefix); the MTP layer when built with one."""

    def __init__(self, config: HFModelConfig, mla: MLAConfig, backend: MLABackend,
                 make_mlp: Callable[[int], nn.Module], linears: Linears,
                 num_mtp_layers: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, mla, backend, make_mlp(i), linears, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, mla.qk_rope_head_dim)
        n = config.num_hidden_layers
        self.mtp_layers = nn.ModuleList(
            DeepseekV3MTPLayer(config, mla, backend, make_mlp(n + i), linears, n + i) for i in range(num_mtp_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches[: len(self.layers)], strict=True):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 / Kimi-K2 causal LM over the paged compressed cache (the interface every flotilla model
    class implements). `mla_backend` picks the MLA kernels ("auto", "torch"; defaults to the worker's
    attention_backend when that is forced), `moe_backend` the experts' ("auto", "torch", "triton", ...),
    `fp8_backend` the FP8 linears' under an fp8 quantization_config ("auto", "torch", "triton", "deep_gemm").
    `mtp`: also build and load the checkpoint's (first) MTP layer, for speculative decoding. `fp8_experts`: keep
    an FP8 checkpoint's routed experts in e4m3 with their block scales (None: when the MoE backend has FP8 experts,
    as all but deep_gemm do; False: dequantize them once at load into the model dtype, twice the memory)."""

    reads_fp8_checkpoints = True
    """load_weights takes an FP8 checkpoint's e4m3 weights and block scales itself (the loader leaves them as read)."""

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto",
                 moe_backend: str = "auto", mla_backend: str = "auto", fp8_backend: str = "auto",
                 mtp: bool = False, fp8_experts: bool | None = None) -> None:  # fmt: skip
        super().__init__()
        if mtp and config.num_nextn_predict_layers < 1:
            raise ValueError("speculative method 'mtp' needs the checkpoint's multi-token-prediction layer, but "
                             "config.json has no num_nextn_predict_layers")
        mla, moe = config.mla, config.moe
        if mla is None:
            raise ValueError("config.json has no kv_lora_rank: not a DeepSeek-V2/V3-style (MLA) checkpoint")
        if moe is not None and (moe.scoring_func or "sigmoid") != "sigmoid":
            raise NotImplementedError(f"MoE scoring_func {moe.scoring_func!r}: only 'sigmoid' (DeepSeek-V3) is built")
        if moe is not None and (moe.topk_method or "noaux_tc") != "noaux_tc":
            raise NotImplementedError(f"MoE topk_method {moe.topk_method!r}: only 'noaux_tc' (DeepSeek-V3) is built")
        if moe is not None and moe.num_experts % moe.num_groups:
            raise ValueError(f"n_routed_experts={moe.num_experts} is not a multiple of n_group={moe.num_groups}")
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.config = config
        self.mla = mla
        self.num_hidden_layers = config.num_hidden_layers
        self.num_mtp_layers = 1 if mtp else 0  # DeepSeek-V3 ships one; a second would be drafted the same way
        self.num_layers = config.num_hidden_layers + self.num_mtp_layers
        """KV cache layers: the decoder stack's, then the MTP layer's."""
        device = torch.get_default_device()
        requested = mla_backend if mla_backend != "auto" else attention_backend
        if config.dsa is not None:  # sparse attention over the indexer's choice: triton's sparse kernel or torch's
            if requested not in ("auto", "torch", "triton"):
                raise NotImplementedError(f"sparse attention (index_topk in config.json) runs on the triton or torch "
                                          f"MLA backends, not {requested!r}")
            if requested == "auto":
                requested = best_mla_backend(device)  # (triton on a GPU: FlashMLA's dense decode reads every row)
        self._mla_auto = requested == "auto"
        """Whether the MLA kernels were picked here (settle_kv_layout may then trade FlashMLA for triton)."""
        backend = get_mla_backend(requested, device=device, kv_lora_rank=mla.kv_lora_rank,
                                  rope_dim=mla.qk_rope_head_dim, dtype=torch.get_default_dtype())
        self.mla_backend_name = backend.name
        self.attention_backend_name = f"mla_{backend.name}"
        """The attention kernels chosen (for the ready log line, and for the worker's decode graphs: mla_triton
        and mla_flash_mla are captured over static tables, actors/cuda_graphs.py)."""
        keep_fp8 = config.quantization is not None and fp8_experts is not False
        self.moe_backend = get_moe_backend(moe_backend, device=device, dtype=torch.get_default_dtype(),
                                           fp8_weights=keep_fp8 and (fp8_experts is True or moe_backend == "auto"))
        self.moe_backend_name = self.moe_backend.name
        self.fp8_experts = keep_fp8 and self.moe_backend.fused_experts_fp8 is not None
        """Whether the routed experts are e4m3 (an FP8 checkpoint's, on a backend with FP8 experts)."""
        if keep_fp8 and not self.fp8_experts:
            logger.info("MoE backend %s has no FP8 experts: the routed experts are dequantized at load",
                        self.moe_backend_name)
        ops = get_ops(fused_ops, device=device)
        self.fused_ops_name = ops.name
        self.quant = config.quantization
        self.linears = Linears()
        self.fp8_backend_name: str | None = None
        if self.quant is not None:
            fp8 = get_fp8_backend(fp8_backend, device=device)
            self.fp8_backend_name = fp8.name
            self.linears = Linears(self.quant.weight_block_size, fp8)
        with use_ops(ops):
            self.model = DeepseekV3Model(config, mla, backend, self._make_mlp, self.linears, self.num_mtp_layers)
        self.lm_head = (None if config.tie_word_embeddings
                        else VocabParallelEmbedding(config.vocab_size, config.hidden_size))  # fmt: skip
        self.rope_halves_at_load = mla.rope_interleave and (
            self.quant is None or rope_rows_in_blocks(config, mla, self.quant.weight_block_size[0]))
        """Whether load_weights reorders the rotary rows into halves (deinterleaved_rope_rows), so attention need
        not de-interleave its rotary parts at every step; else (FP8 blocks that a head's rope rows would straddle:
        no DeepSeek or Kimi checkpoint) the attention layers do, as transformers does."""
        for module in self.modules():
            if isinstance(module, DeepseekV3Attention):
                module.deinterleave = mla.rope_interleave and not self.rope_halves_at_load

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        moe = self.config.moe
        if moe is not None and moe.is_sparse(layer_idx):
            return DeepseekV3MoE(self.config.hidden_size, moe, self.moe_backend, self.linears, self.fp8_experts)
        return DeepseekV3MLP(self.config.hidden_size, self.config.intermediate_size, self.linears,
                             what=f"the dense MLP of layer {layer_idx}")  # fmt: skip

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """input_ids/positions int64 [T] -> final hidden states [T, hidden]; writes latents into kv_caches."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] (the rows to sample from) -> float32 logits [N, vocab] (on every rank), into `out` if
        given."""
        return vocab_parallel_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head, out)

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                    kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """The MTP layer at `positions`: input_ids int64 [T] are the tokens one position ahead, prev_hidden [T, H]
        the main model's final hidden states there (or this layer's own output when drafting further);
        writes its latents into its cache layer (the last of kv_caches); returns its output [T, H]."""
        layer = self.model.mtp_layers[0]
        return layer.propose(self.model.embed_tokens(input_ids), prev_hidden, positions,
                             self.model.rotary_emb.cos_sin_cache, kv_caches[self.num_hidden_layers], meta)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output rows [N, H] -> float32 logits [N, vocab] of the token two positions ahead."""
        return self.compute_logits(self.model.mtp_layers[0].shared_head.norm(hidden))

    def settle_kv_layout(self, block_size: int | None, kv_cache_dtype: str) -> int:
        """The KV block size for the engine's cache options (block_size None: the engine's default). FlashMLA
        reads only bfloat16 pages of 64 tokens: chosen by "auto" it gives way to triton when the options rule
        that out (an FP8 cache, another block size); forced by name it refuses them."""
        if self.mla_backend_name != "flash_mla":
            return block_size or DEFAULT_BLOCK_SIZE
        if block_size in (None, FLASH_MLA_BLOCK) and kv_cache_dtype == "auto":
            return FLASH_MLA_BLOCK
        why = (f"kv_cache_dtype {kv_cache_dtype}" if kv_cache_dtype != "auto" else f"block_size {block_size}")
        if not self._mla_auto:
            raise ValueError(f"the flash_mla MLA backend reads bfloat16 pages of {FLASH_MLA_BLOCK} tokens, not {why}: "
                             f"leave block_size unset (or {FLASH_MLA_BLOCK}) and kv_cache_dtype auto, or use the "
                             "triton MLA backend")  # fmt: skip
        backend = get_mla_backend("triton")
        for module in self.modules():
            if isinstance(module, DeepseekV3Attention):
                module.backend = backend
        self.mla_backend_name, self.attention_backend_name = backend.name, f"mla_{backend.name}"
        logger.info("MLA backend: triton, not FlashMLA (which cannot page a cache with %s)", why)
        return block_size or DEFAULT_BLOCK_SIZE

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's compressed cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (kernels/mla), and
        under sparse attention the indexer's key and its scale after each row's latent (dsa_ref.index_part_width)."""
        shape = mla_cache_shape(num_blocks, block_size, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)
        dsa = self.config.dsa
        return shape if dsa is None else (*shape[:-1], shape[-1] + index_part_width(shape[-1], dsa.index_head_dim))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the parameters: gate/up pairs into gate_up_proj, q_a_proj and
        kv_a_proj_with_mqa into fused_qkv_a_proj (when built), per-expert tensors into the stacked experts. Returns
        the parameters fully loaded (a fused or stacked one once every part came). Raises ValueError naming the
        tensor on an unknown name, a bad shape or expert index, an FP8 tensor without its scale (or a scale without
        an fp8 quantization_config)."""
        params = dict(self.named_parameters())
        # the layer that slices a parameter's checkpoint tensor to this rank's part (tensor parallelism)
        owners = {f"{prefix}.{p}" if prefix else p: m for prefix, m in self.named_modules() if hasattr(m, "load")
                  for p, _ in m.named_parameters(recurse=False)}
        experts = ExpertTensors(self)  # the routed experts' tensors, this rank's only under expert parallelism
        expert_scales = Fp8ExpertScales(self)  # and their block scales, when they stay FP8
        fused_seen: dict[str, set[str]] = {}
        loaded: set[str] = set()
        skipped_mtp = 0
        for name, tensor in self._fp8_paired(map(self._mtp_renamed, weights), params, experts, expert_scales):
            if name.endswith(_IGNORED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            layer = _LAYER.match(name)
            if layer is not None and int(layer[1]) >= self.num_hidden_layers:
                skipped_mtp += 1  # the multi-token-prediction layers that follow the decoder stack
                continue
            if experts.load(name, tensor) or expert_scales.load(name, tensor):
                continue
            if self.rope_halves_at_load and (rope_rows := ROPE_ROWS.search(name)):  # the halves, once, here
                tensor = deinterleaved_rope_rows(tensor, rope_rows[1], self.mla.qk_nope_head_dim,
                                                 self.mla.qk_rope_head_dim)  # fmt: skip
            if fused := self._fused_part(params, name):  # gate/up, q_a/kv_a (weights, FP8 block scales, biases)
                param_name, shard = fused
                owner = owners[param_name]
                owner.load(params[param_name], tensor, (name, param_name), shard)
                seen = fused_seen.setdefault(param_name, set())
                seen.add(shard)
                if len(seen) == len(owner.parts):
                    loaded.add(param_name)
            else:
                param_name = self._param_name(params, name, name)
                owner = owners.get(param_name)
                if owner is None:  # replicated
                    _copy_checked(params[param_name].data, tensor, name, param_name)
                else:
                    owner.load(params[param_name], tensor, (name, param_name), WHOLE)
                loaded.add(param_name)
        if skipped_mtp:
            logger.info("skipped %d tensors of multi-token-prediction layers (%s)", skipped_mtp,
                        "shared embedding / head copies, or layers past the first" if self.num_mtp_layers
                        else "MTP is off: no speculative_config")  # fmt: skip
        return loaded | experts.loaded | expert_scales.loaded

    def _mtp_renamed(self, item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        """Checkpoint layer num_hidden_layers + i -> `model.mtp_layers.i` when the MTP layer is built; its copies
        of the embedding and LM head keep their layer name (and are skipped: the main model's are shared)."""
        name, tensor = item
        layer = _LAYER.match(name)
        if layer is None or not self.num_mtp_layers:
            return item
        i = int(layer[1]) - self.num_hidden_layers
        rest = name[layer.end():]
        if not 0 <= i < self.num_mtp_layers or rest.startswith(("embed_tokens.", "shared_head.head.")):
            return item
        return f"model.mtp_layers.{i}.{rest}", tensor

    def checkpoint_filter(self) -> Callable[[str], bool]:
        """For the loader: which checkpoint tensors to read (not other expert-parallel ranks' experts)."""
        keep = ExpertTensors(self).keep
        return lambda name: keep(self._mtp_renamed((name, None))[0])  # type: ignore[arg-type]

    def _fp8_param(self, params: dict[str, nn.Parameter], name: str, expert_scales: Fp8ExpertScales) -> bool:
        """Whether checkpoint weight `name` loads into an e4m3 parameter as it is (an Fp8BlockLinear's, or FP8
        routed experts')."""
        if self.quant is None:
            return False
        if PER_EXPERT.match(name):
            return expert_scales.is_fp8(name)
        fused = self._fused_part(params, name)
        param_name = fused[0] if fused else _present(params, name)
        return param_name is not None and params[param_name].dtype == FP8_DTYPE

    def _fp8_paired(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, nn.Parameter],
                    experts: ExpertTensors, expert_scales: Fp8ExpertScales) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """The checkpoint's tensors with FP8 handled: weights and scales of Fp8BlockLinears and FP8 routed experts
        pass as they are; an FP8 weight whose parameter is not FP8 (kv_b_proj; the routed experts when not kept in
        FP8) waits for its scale (or the scale for it) and passes dequantized to float32; other expert-parallel
        ranks' experts (weights and scales) are dropped unread. At the end, an FP8 weight without its scale (or a
        scale without its weight) is a ValueError naming the tensor missing."""
        waiting_weights: dict[str, torch.Tensor] = {}
        waiting_scales: dict[str, torch.Tensor] = {}
        direct_weights: set[str] = set()
        direct_scales: set[str] = set()
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer is not None and int(layer[1]) >= self.num_hidden_layers:
                yield name, tensor  # an MTP layer's that is not built, skipped by the caller
                continue
            if experts.remote(name):
                continue
            is_scale = name.endswith(".weight" + SCALE_SUFFIX)
            if self.quant is None:
                if is_scale or tensor.dtype == FP8_DTYPE:
                    raise ValueError(f"checkpoint tensor {name!r}: FP8 block-scaled weights, but config.json has no "
                                     "quantization_config with quant_method 'fp8' and a weight_block_size")  # fmt: skip
                yield name, tensor
                continue
            base = name.removesuffix(SCALE_SUFFIX) if is_scale else name
            if self._fp8_param(params, base, expert_scales):
                if not is_scale and tensor.dtype != FP8_DTYPE:
                    raise ValueError(f"checkpoint tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, but "
                                     "the fp8 quantization_config makes it an FP8 (e4m3) block-scaled weight")  # fmt: skip
                (direct_scales if is_scale else direct_weights).add(base)
                yield name, tensor
            elif is_scale:
                if base in waiting_weights:
                    yield base, block_dequantize(waiting_weights.pop(base), tensor, self.quant.weight_block_size)
                else:
                    waiting_scales[base] = tensor
            elif tensor.dtype == FP8_DTYPE:
                if base in waiting_scales:
                    yield base, block_dequantize(tensor, waiting_scales.pop(base), self.quant.weight_block_size)
                else:
                    waiting_weights[base] = tensor
            else:
                yield name, tensor
        if unscaled := sorted(set(waiting_weights) | (direct_weights - direct_scales)):
            raise ValueError(f"checkpoint tensor {unscaled[0] + SCALE_SUFFIX!r} is missing: the FP8 weight "
                             f"{unscaled[0]!r} has no block scales ({len(unscaled)} FP8 weights without them)")  # fmt: skip
        if orphans := sorted(set(waiting_scales) | (direct_scales - direct_weights)):
            raise ValueError(f"checkpoint tensor {orphans[0] + SCALE_SUFFIX!r} has no FP8 weight {orphans[0]!r}")

    def _fused_part(self, params: dict[str, nn.Parameter], name: str) -> tuple[str, str] | None:
        """(fused parameter, shard id) that checkpoint tensor `name` loads into (_FUSED_INTO), or None when the
        model has no such fused parameter (then the tensor loads under its own name, or is refused naming it)."""
        part = _FUSED_PART.search(name)
        if part is None:
            return None
        fused, shard = _FUSED_INTO[part[1]]
        param_name = _present(params, f"{name[: part.start()]}.{fused}.{part[2]}")
        return None if param_name is None else (param_name, shard)

    def _param_name(self, params: dict[str, nn.Parameter], candidate: str, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor maps to (_present), or ValueError naming the tensor."""
        if (name := _present(params, candidate)) is not None:
            return name
        raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of {type(self).__name__}")
