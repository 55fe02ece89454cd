"""Llama-family decoder (Llama 2/3/3.1 incl. llama3 RoPE scaling, SmolLM2, Mistral without sliding
window) over flotilla's kernels; Qwen3 reuses it with per-head q/k RMSNorm switched on.

Runs a flattened mixed batch: input_ids/positions [T] of prefill chunks and decodes in any order, with
each layer writing its new K/V into a paged cache and attending through AttentionMetadata. q/k/v and
gate/up are fused into one GEMM each; load_weights maps HF's separate tensors into those slices.

Under tensor parallelism (models/parallel.py) the same classes hold one rank's share: its attention heads
(and KV cache heads), its slice of the MLP's intermediate dim and of the vocabulary; o_proj and down_proj
all-reduce. With one rank they are the plain layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from flotilla.kernels.attention import AttentionBackend, AttentionMetadata, get_attention_backend, kv_cache_shape
from flotilla.kernels.linear import linear
from flotilla.kernels.ops import current_ops, get_ops, use_ops
from flotilla.kernels.rope import rope_cos_sin_cache
from flotilla.models.hf_config import HFModelConfig
from flotilla.models.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)

# Checkpoint tensors that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# A calibrated FP8 KV cache's scales under the names FP8 checkpoints use (vLLM reads the same) -> which of the
# attention's k_scale / v_scale they set.
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": "k", ".self_attn.k_proj.k_scale": "k", ".self_attn.k_proj.output_scale": "k",
    ".self_attn.v_scale": "v", ".self_attn.v_proj.v_scale": "v", ".self_attn.v_proj.output_scale": "v",
    ".self_attn.kv_scale": "kv",
}


class Linear(nn.Module):
    """y = x W^T (+ b) with uninitialized parameters: weights always come from a checkpoint, so random
    init (seconds for an 8B model) is skipped; honours the default device/dtype context."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; forward(x, residual) fuses the residual add (returns both)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops = current_ops()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the float32 cos/sin table [max_position, rotary_dim] shared by all layers (rotary_dim: the head
    dim by default; MLA rotates only its qk_rope_head_dim part)."""

    def __init__(self, config: HFModelConfig, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = rotary_dim or config.head_dim
        self.max_position = config.rope_positions or config.max_position_embeddings
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        self.register_buffer("cos_sin_cache", self._build(None), persistent=False)

    def _build(self, device: torch.device | None) -> torch.Tensor:
        return rope_cos_sin_cache(self.head_dim, self.max_position, self.theta, self.scaling, device=device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Rebuild the table after .to()/.half()/to_empty(): a bf16 table would round large angles, and
        meta construction + to_empty leaves garbage; only the device is taken from the conversion."""
        super()._apply(fn, recurse)
        if self.cos_sin_cache.device.type != "meta":
            self.cos_sin_cache = self._build(self.cos_sin_cache.device)
        return self


class LlamaAttention(nn.Module):
    """qkv GEMM -> (q/k RMSNorm) -> RoPE -> store K/V in the paged cache -> paged attention -> o_proj.
    Heads are this rank's (all of them with one rank)."""

    def __init__(self, config: HFModelConfig, backend: AttentionBackend, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.k_scale = 1.0
        """An FP8 KV cache holds K / k_scale (kernels/attention/fp8_kv.py); 1.0 without calibrated scales, as vLLM."""
        self.v_scale = 1.0
        """Likewise for V."""
        self.backend = backend
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.ops = current_ops()

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.attend(self.qkv_proj(hidden), positions, cos_sin_cache, kv_cache, meta)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """Everything after the q/k/v product: qkv [T, (Hq + 2 Hkv) * D] -> o_proj's output [T, hidden]."""
        num_tokens = qkv.shape[0]
        if self.q_norm is not None and self.k_norm is not None and self.ops.qk_norm_rope_and_store_kv is not None:
            # Qwen3: q/k norm, RoPE and the K/V store in one launch straight from the qkv output
            q = self.ops.qk_norm_rope_and_store_kv(
                qkv, positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos_sin_cache, kv_cache,
                meta.slot_mapping, self.num_heads, self.num_kv_heads, self.k_scale, self.v_scale)
            out = self.backend.forward(q, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ops.rope_and_store_kv is not None:  # one launch: rotated K goes straight to its cache slot
            q = self.ops.rope_and_store_kv(positions, q, k, v, cos_sin_cache, kv_cache, meta.slot_mapping,
                                           self.k_scale, self.v_scale)
        else:
            q, k = self.ops.apply_rope(positions, q, k, cos_sin_cache)
            self.backend.store_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.forward(q, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one GEMM."""

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, config.intermediate_size, ("gate", "up"),
                                                       bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.ops = current_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class PreNormDecoderLayer(nn.Module):
    """Pre-norm block around any attention and MLP; the residual travels beside the hidden state so each
    norm fuses its add. Model families differ only in the attention and MLP they hand in."""

    def __init__(self, config: HFModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Llama's block: GQA attention (with q/k RMSNorm for Qwen3)."""

    def __init__(self, config: HFModelConfig, backend: AttentionBackend, qk_norm: bool, mlp: nn.Module) -> None:
        super().__init__(config, LlamaAttention(config, backend, qk_norm), mlp)


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's `model.` prefix)."""

    def __init__(
        self, config: HFModelConfig, backend: AttentionBackend, qk_norm: bool, make_mlp: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, qk_norm, make_mlp(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged KV cache; the interface every flotilla model class implements."""

    qk_norm: ClassVar[bool] = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    # (fused param, HF tensor it replaces, shard id): vLLM's stacked_params_mapping.
    stacked_params: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", "gate"),
        ("gate_up_proj", "up_proj", "up"),
    )

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto") -> None:
        super().__init__()
        window = config.sliding_window
        if window is not None and window < config.max_position_embeddings:
            raise NotImplementedError(
                f"{type(self).__name__}: sliding-window attention (window {window} < "
                f"max_position_embeddings {config.max_position_embeddings}) is not supported"
            )
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.head_dim = config.head_dim
        backend = get_attention_backend(attention_backend, device=torch.get_default_device(),
                                        head_dim=config.head_dim, dtype=torch.get_default_dtype())
        self.attention_backend_name = backend.name
        """The attention kernels chosen (for the ready log line)."""
        ops = get_ops(fused_ops, device=torch.get_default_device())
        self.fused_ops_name = ops.name
        """The elementwise kernels chosen (kernels/ops.py)."""
        with use_ops(ops):
            self.model = LlamaModel(config, backend, self.qk_norm, self._make_mlp)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        """KV heads of this rank's cache."""
        # Tied models have no lm_head module at all, so meta construction + to_empty cannot untie it.
        self.lm_head = (None if config.tie_word_embeddings
                        else VocabParallelEmbedding(config.vocab_size, config.hidden_size))

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer `layer_idx` (MoE models override this; called during __init__)."""
        return LlamaMLP(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> final hidden states [T, hidden]; writes K/V into kv_caches."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] (the rows to sample from) -> float32 logits [N, vocab] (on every rank), into `out` if
        given."""
        return vocab_parallel_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head, out)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (allocate one per layer)."""
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the (fused) parameters; returns the names of the
        parameters fully loaded (a fused one only once all its shards came) so the caller can report
        missing ones. Raises ValueError naming the tensor on an unknown name or a shape mismatch."""
        params = dict(self.named_parameters())
        # the layer that slices a parameter's checkpoint tensor to this rank's part (tensor parallelism)
        owners = {f"{prefix}.{p}" if prefix else p: m for prefix, m in self.named_modules() if hasattr(m, "load")
                  for p, _ in m.named_parameters(recurse=False)}
        shards_of: dict[str, set[str]] = {}
        for fused, _, shard in self.stacked_params:
            shards_of.setdefault(fused, set()).add(shard)
        shards_seen: dict[str, set[str]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if self._load_kv_scale(name, tensor):
                continue
            for fused, part, shard in self.stacked_params:
                if f".{part}." not in name:
                    continue
                param_name = self._param_name(params, name.replace(f".{part}.", f".{fused}."), name)
                owner = owners.get(param_name)
                if not isinstance(owner, ColumnParallelLinear):
                    raise ValueError(f"checkpoint tensor {name!r}: parameter {param_name!r} is not a fused one")
                owner.load(params[param_name], tensor, (name, param_name), shard)
                seen = shards_seen.setdefault(param_name, set())
                seen.add(shard)
                if seen == shards_of[fused]:
                    loaded.add(param_name)
                break
            else:
                param_name = self._param_name(params, name, name)
                owner = owners.get(param_name)
                if owner is None or isinstance(owner, ColumnParallelLinear):  # (an already fused tensor: whole)
                    _copy_checked(params[param_name].data, tensor, name, param_name)
                else:
                    owner.load(params[param_name], tensor, (name, param_name))
                loaded.add(param_name)
        return loaded

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Set a layer's k_scale / v_scale from a checkpoint's calibrated KV-cache scale (used by an FP8 cache,
        ignored by any other); per-head scales collapse to their largest (no value then overflows e4m3)."""
        for suffix, which in _KV_SCALE_SUFFIXES.items():
            if name.endswith(suffix):
                layer = int(name.removesuffix(suffix).rsplit(".", 1)[-1])
                attn = self.model.layers[layer].self_attn
                value = float(tensor.float().max())
                if "k" in which:
                    attn.k_scale = value
                if "v" in which:
                    attn.v_scale = value
                return True
        return False

    def _param_name(self, params: dict[str, nn.Parameter], candidate: str, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor maps to; headless checkpoints omit the `model.` prefix."""
        for name in (candidate, f"model.{candidate}"):
            if name in params:
                return name
        raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of {type(self).__name__}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, checkpoint_name: str, param_name: str) -> None:
    """dst.copy_(src) (casting dtype/device) after checking shapes, naming both tensors on mismatch."""
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor {checkpoint_name!r} has shape {tuple(src.shape)} but parameter "
            f"{param_name!r} expects {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
