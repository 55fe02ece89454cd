"""HFModelConfig: what the model code needs from an HF config.json, parsed without transformers.

Handles both config generations: transformers <5 (top-level rope_theta / rope_scaling with "type" or
"rope_type", torch_dtype) and transformers >=5 (rope_parameters holding rope_theta, dtype).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# config.json's dtype names -> torch's (torch is imported where a dtype is asked for: the front end reads configs too)
_DTYPES: dict[str, str] = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                           "bfloat16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Sparse-MLP hyper-parameters of a Qwen2/3-MoE or DeepSeek-V3-style config."""

    num_experts: int
    """Routed experts per MoE layer (HF: num_experts; transformers 5 writes num_local_experts)."""
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int
    """Intermediate size of one expert's SwiGLU MLP."""
    norm_topk_prob: bool
    """Renormalize the top-k routing weights to sum to 1."""
    decoder_sparse_step: int
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and it is not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...]
    """Layers that keep a dense MLP of intermediate_size."""
    first_k_dense_replace: int = 0
    """DeepSeek: layers below this one keep a dense MLP of intermediate_size."""
    num_shared_experts: int = 0
    """DeepSeek (n_shared_experts): a dense MLP of num_shared_experts * moe_intermediate_size beside the
    routed experts, seen by every token."""
    routed_scaling_factor: float = 1.0
    """DeepSeek: the routing weights are multiplied by this."""
    num_groups: int = 1
    """DeepSeek (n_group): the experts form this many groups for grouped top-k."""
    topk_groups: int = 1
    """DeepSeek (topk_group): only the experts of this many best groups are chosen from."""
    scoring_func: str | None = None
    """DeepSeek: how router logits become scores ("sigmoid" in V3); None when the config does not say."""
    topk_method: str | None = None
    """DeepSeek: the top-k rule ("noaux_tc" in V3: grouped, with e_score_correction_bias); None when unsaid."""
    shared_expert_intermediate_size: int = 0
    """Qwen-MoE: a shared expert's SwiGLU MLP of this size beside the routed ones, scaled per token by
    sigmoid(shared_expert_gate); 0 without one."""

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the MoE block (HF's rules: Qwen's and DeepSeek's)."""
        return (layer_idx >= self.first_k_dense_replace and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers of a hybrid model (Qwen3.5): which layers they are and their sizes."""

    layer_types: tuple[str, ...]
    """Per decoder layer: "linear_attention" (gated delta net) or "full_attention" (paged KV)."""
    conv_kernel: int
    """Width of the depthwise causal conv1d over the q/k/v channels (linear_conv_kernel_dim)."""
    num_key_heads: int
    """q/k heads of a linear-attention layer (linear_num_key_heads)."""
    num_value_heads: int
    """Value heads (linear_num_value_heads); each q/k head serves num_value_heads / num_key_heads of them."""
    key_head_dim: int
    """q/k dims per head (linear_key_head_dim)."""
    value_head_dim: int
    """Value dims per head (linear_value_head_dim)."""

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "linear_attention"


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention sizes (DeepSeek-V2/V3, Kimi-K2), in elements per head or per token."""

    q_lora_rank: int | None
    """Rank of the low-rank query (q_a_proj -> q_a_layernorm -> q_b_proj); None: one q_proj."""
    kv_lora_rank: int
    """Width of the compressed latent c_kv that the cache holds per token."""
    qk_nope_head_dim: int
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int
    """Per-head query dims with RoPE; the rotated key part (k_pe) of this width is shared by all heads."""
    v_head_dim: int
    """Per-head value dims."""
    rope_interleave: bool
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout) rather than halves."""


@dataclass(frozen=True, slots=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks the cached positions each query's
    MLA attends to."""

    index_n_heads: int
    """The indexer's query heads."""
    index_head_dim: int
    """Dims of its query heads and of its one key per token."""
    index_topk: int
    """Positions each query attends to (all of them while fewer are cached)."""
    rope_interleave: bool
    """The indexer's RoPE rotates interleaved pairs (GLM-5) rather than halves (DeepSeek-V3.2)."""
    shared: tuple[bool, ...]
    """Per decoder layer: True where it runs no indexer and reuses the previous layer's positions (GLM-5's
    indexer_types "shared"); an MTP layer always runs its own."""

    def runs_indexer(self, layer_idx: int) -> bool:
        return layer_idx >= len(self.shared) or not self.shared[layer_idx]


@dataclass(frozen=True, slots=True)
class FP8BlockQuantConfig:
    """config.json's `quantization_config` of an FP8 block-scaled checkpoint (DeepSeek-V3's): e4m3 weights
    with one float32 `weight_scale_inv` per weight_block_size block, activations quantized dynamically."""

    weight_block_size: tuple[int, int]
    """(block_n, block_k): rows x columns of the weight [out, in] that share one scale."""


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A vision-language checkpoint's vision tower (Qwen3-VL's vision_config) and the token ids that place its
    output in the prompt; missing keys take transformers' Qwen3VLConfig defaults."""

    depth: int
    """Transformer blocks of the vision tower."""
    hidden_size: int
    """Width of the vision blocks."""
    intermediate_size: int
    """Hidden width of each block's MLP."""
    num_heads: int
    hidden_act: str
    """The blocks' MLP activation ("gelu_pytorch_tanh": tanh-approximated GELU)."""
    in_channels: int
    patch_size: int
    """Pixels per side of one patch."""
    temporal_patch_size: int
    """Frames per patch (an image is its frame repeated)."""
    spatial_merge_size: int
    """The merger folds merge x merge neighbouring patches into one language-model token."""
    out_hidden_size: int
    """Width of the merged tokens (the language model's hidden size)."""
    num_position_embeddings: int
    """Learned absolute position embeddings: a square grid, resampled to each image's patch grid."""
    deepstack_visual_indexes: tuple[int, ...]
    """Vision blocks whose outputs (through their own mergers) are added to the first decoder layers' outputs."""
    rope_theta: float
    """Base of the blocks' 2D (row, column) rotary embedding."""
    image_token_id: int
    """The placeholder token that one merged image token replaces."""
    video_token_id: int
    vision_start_token_id: int
    """The token before each image's placeholders."""
    vision_end_token_id: int
    """The token after them."""


@dataclass(frozen=True, slots=True)
class DeepseekV4Params:
    """DeepSeek-V4's attention and residual streams (config.json of model_type deepseek_v4)."""

    q_lora_rank: int
    """Rank of the queries' low-rank projection."""
    o_groups: int
    """Head groups of the grouped output projection."""
    o_lora_rank: int
    """Each group's intermediate width in it."""
    layer_types: tuple[str, ...]
    """Per layer: sliding_attention, compressed_sparse_attention (CSA) or heavily_compressed_attention (HCA)."""
    mlp_layer_types: tuple[str, ...]
    """Per layer: hash_moe (experts looked up by token id) or moe."""
    compress_rates: tuple[int, int]
    """Tokens per compressed entry of (CSA, HCA)."""
    rope_dim: int
    """The trailing dims of each head that RoPE rotates (interleaved pairs)."""
    main_rope_theta: float
    """RoPE base of the sliding-only layers."""
    compress_rope_theta: float
    """RoPE base of the CSA / HCA layers, their compressors and the indexer."""
    compress_rope_scaling: dict[str, Any] | None
    """Their scaling (YaRN in the released checkpoints, without its attention factor); None: plain."""
    hc_mult: int
    """Residual streams (manifold-constrained hyper-connections)."""
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    """Experts' gate and up activations are clamped to it."""
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    """Compressed entries each query of a CSA layer attends to."""

    def layer_type(self, layer_idx: int) -> str:
        """Layer `layer_idx`'s attention kind; an MTP layer's (past the decoder stack) is sliding only, as vLLM's."""
        return self.layer_types[layer_idx] if layer_idx < len(self.layer_types) else "sliding_attention"

    def hashed(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s experts are looked up by token id (an MTP layer's are routed)."""
        return layer_idx < len(self.mlp_layer_types) and self.mlp_layer_types[layer_idx] == "hash_moe"

    def rate(self, layer_idx: int) -> int:
        """Tokens per compressed entry of layer `layer_idx`; 0 for a sliding-only layer."""
        return {"sliding_attention": 0, "compressed_sparse_attention": self.compress_rates[0],
                "heavily_compressed_attention": self.compress_rates[1]}[self.layer_type(layer_idx)]


@dataclass(frozen=True, slots=True)
class HFModelConfig:
    """Architecture hyper-parameters of a decoder-only checkpoint (sizes in elements, not bytes)."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """Scaling parameters with the kind under "rope_type"; None for plain RoPE."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None
    """Checkpoint dtype name ("bfloat16", ...), None when the config does not say."""
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None
    """Effective sliding-window length in tokens; None when every layer attends to the full context."""
    moe: MoEConfig | None = None
    """The sparse MLPs' parameters; None for a dense model."""
    mla: MLAConfig | None = None
    """Latent-attention sizes; None for a model with ordinary (GQA) attention."""
    quantization: FP8BlockQuantConfig | None = None
    """FP8 block-scaled weights (quant_method "fp8" with weight_block_size); None for unquantized weights."""
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction layers stored after the decoder stack (DeepSeek-V3: 1, at index num_hidden_layers)."""
    linear_attention: LinearAttentionConfig | None = None
    """Gated DeltaNet layers (a hybrid model); None when every layer is full attention."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dims that RoPE rotates (the first ones); Qwen3.5: 0.25."""
    dsa: DSAConfig | None = None
    """Sparse attention's indexer (DeepSeek-V3.2, GLM-5); None: every query attends to every cached position."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE: how many of the head's rotary frequencies follow the temporal, height and width position; None
    without M-RoPE (rope_parameters' mrope_section)."""
    mrope_interleaved: bool = False
    """M-RoPE's frequencies cycle t, h, w, t, h, w, ... (Qwen3-VL) rather than lying in three contiguous sections."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language checkpoint; None for a text-only one."""
    deepseek_v4: DeepseekV4Params | None = None
    """DeepSeek-V4's attention and residual streams; None for another model."""
    rope_positions: int = 0
    """Positions the RoPE table covers: every max_model_len the config allows (derived_max_model_len before a
    tokenizer's cap, or config.json's model_max_length), at least max_position_embeddings (0: that alone)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The checkpoint dtype as a torch.dtype (None when unspecified)."""
        if self.dtype is None:
            return None
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported checkpoint dtype {self.dtype!r}; supported: {', '.join(_DTYPES)}")
        import torch

        return getattr(torch, _DTYPES[self.dtype])


def rope_settings(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config generation."""
    params = raw.get("rope_parameters") or {}
    legacy = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", legacy.get("rope_theta", 10000.0))))
    # (partial_rotary_factor and M-RoPE's sections are fields of their own: for text, whose positions are equal in all
    # three rows, M-RoPE is plain RoPE)
    skip = ("rope_theta", "type", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
    scaling = {k: v for k, v in {**legacy, **params}.items() if k not in skip}
    kind = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if kind in (None, "default") and not set(scaling) - {"rope_type"}:
        return theta, None
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):  # transformers' standardize_rope_params: the pre-scaling window
        if raw.get("original_max_position_embeddings") is not None:  # a top-level one wins (Phi-3)
            scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        elif raw.get("max_position_embeddings") is not None:
            scaling.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    return theta, scaling


def _sliding_window(raw: Mapping[str, Any]) -> int | None:
    """The window in force, honouring Qwen's use_sliding_window switch and v5 layer_types."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _first_id(value: Any) -> int | None:
    """A token id that configs write as an int, a one-element list, or null."""
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _moe(raw: Mapping[str, Any]) -> MoEConfig | None:
    """The MoE parameters of a Qwen2/3-MoE-style config; None when it routes to no experts."""
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0)
    if num_experts == 0:
        return None
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"config.json has experts but lacks {', '.join(missing)}")
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        scoring_func=raw.get("scoring_func"),
        topk_method=raw.get("topk_method"),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def _linear_attention(raw: Mapping[str, Any]) -> LinearAttentionConfig | None:
    """The gated delta net layers of a hybrid config (layer_types with "linear_attention"); None without them."""
    layer_types = raw.get("layer_types")
    if layer_types is None and "linear_num_value_heads" in raw:  # HF's default: every full_attention_interval-th
        interval = int(raw.get("full_attention_interval") or 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(int(raw["num_hidden_layers"]))]
    if not layer_types or "linear_attention" not in layer_types:
        return None
    if len(layer_types) != int(raw["num_hidden_layers"]):
        raise ValueError(f"config.json's layer_types names {len(layer_types)} layers, num_hidden_layers is "
                         f"{raw['num_hidden_layers']}")
    unknown = set(layer_types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"config.json's layer_types has unsupported kinds {sorted(unknown)}")
    missing = [k for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                           "linear_value_head_dim") if k not in raw]
    if missing:
        raise ValueError(f"config.json has linear_attention layers but lacks {', '.join(missing)}")
    config = LinearAttentionConfig(
        layer_types=tuple(layer_types), conv_kernel=int(raw.get("linear_conv_kernel_dim") or 4),
        num_key_heads=int(raw["linear_num_key_heads"]), num_value_heads=int(raw["linear_num_value_heads"]),
        key_head_dim=int(raw["linear_key_head_dim"]), value_head_dim=int(raw["linear_value_head_dim"]))
    if config.num_value_heads % config.num_key_heads:
        raise ValueError(f"linear_num_value_heads={config.num_value_heads} is not a multiple of "
                         f"linear_num_key_heads={config.num_key_heads}")
    return config


def text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal checkpoint's config (Qwen3.5's, Qwen3-VL's ForConditionalGeneration) as its language model's:
    the text_config's keys, with the top level's architectures and anything the text_config leaves out. The top
    level's tie_word_embeddings wins: it is the one transformers ties the outer model's lm_head by."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping) or "hidden_size" in raw:
        return raw
    tie = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
    return {**{k: v for k, v in raw.items() if k != "text_config"}, **text, **tie,
            "architectures": raw.get("architectures") or text.get("architectures") or ()}


def _vision(raw: Mapping[str, Any]) -> VisionConfig | None:
    """The vision tower of a multimodal config (its vision_config, the token ids beside it); None without one."""
    vision = raw.get("vision_config")
    if not isinstance(vision, Mapping):
        return None
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta", 10000.0))
    return VisionConfig(
        depth=int(vision.get("depth", 27)), hidden_size=int(vision.get("hidden_size", 1152)),
        intermediate_size=int(vision.get("intermediate_size", 4304)), num_heads=int(vision.get("num_heads", 16)),
        hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")), in_channels=int(vision.get("in_channels", 3)),
        patch_size=int(vision.get("patch_size", 16)), temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        out_hidden_size=int(vision.get("out_hidden_size", 3584)),
        num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(theta),
        image_token_id=int(raw.get("image_token_id", 151655)), video_token_id=int(raw.get("video_token_id", 151656)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 151653)))


def _mrope(raw: Mapping[str, Any]) -> tuple[tuple[int, ...] | None, bool]:
    """(mrope_section, mrope_interleaved) from rope_parameters (or a legacy rope_scaling); (None, False) without."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    section = params.get("mrope_section")
    if section is None:
        return None, False
    return tuple(int(s) for s in section), bool(params.get("mrope_interleaved", False))


def _mla(raw: Mapping[str, Any]) -> MLAConfig | None:
    """The latent-attention sizes of a DeepSeek-V2/V3-style config; None when it has no kv_lora_rank."""
    if raw.get("kv_lora_rank") is None:
        return None
    missing = [k for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if raw.get(k) is None]
    if missing:
        raise ValueError(f"config.json has kv_lora_rank but lacks {', '.join(missing)}")
    q_lora_rank = raw.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )


def _dsa(raw: Mapping[str, Any]) -> DSAConfig | None:
    """The sparse-attention indexer of a DeepSeek-V3.2 / GLM-5 config; None without index_topk."""
    if raw.get("index_topk") is None or raw.get("kv_lora_rank") is None:
        return None
    layers = int(raw["num_hidden_layers"])
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    elif types is None and raw.get("index_topk_freq") is not None:  # (transformers' GlmMoeDsaConfig schedule)
        freq, offset = max(int(raw["index_topk_freq"]), 1), int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = list(types) if types is not None else ["full"] * layers
    if len(types) != layers or set(types) - {"full", "shared"} or (types and types[0] == "shared"):
        raise ValueError(f"config.json's indexer_types {types} must name 'full' or 'shared' for each of the "
                         f"{layers} layers, the first 'full'")
    return DSAConfig(index_n_heads=int(raw.get("index_n_heads", 64)),
                     index_head_dim=int(raw.get("index_head_dim", 128)), index_topk=int(raw["index_topk"]),
                     rope_interleave=bool(raw.get("indexer_rope_interleave", raw.get("model_type") == "glm_moe_dsa")),
                     shared=tuple(t == "shared" for t in types))


def _quantization(raw: Mapping[str, Any]) -> FP8BlockQuantConfig | None:
    """The FP8 block quantization of a config; None without quantization_config. Other methods, per-tensor
    FP8 (no weight_block_size), non-e4m3 formats and static activation scales are refused (ValueError)."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (only 'fp8' block-scaled)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config fmt {quant.get('fmt')!r} is not supported (only 'e4m3')")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config activation_scheme {quant.get('activation_scheme')!r} is not "
                         "supported (only 'dynamic')")  # fmt: skip
    if quant.get("expert_dtype", "fp8") != "fp8" and raw.get("model_type") != "deepseek_v4":
        raise ValueError(f"quantization_config expert_dtype {quant.get('expert_dtype')!r}: FP4 (MXFP4) experts are "
                         "supported for DeepSeek-V4 only (dequantized as they load)")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2 or min(int(b) for b in block) <= 0:
        raise ValueError(f"quantization_config weight_block_size {block!r}: per-tensor FP8 is not supported; "
                         "expected [block_n, block_k]")  # fmt: skip
    return FP8BlockQuantConfig(weight_block_size=(int(block[0]), int(block[1])))


def parse_hf_config(raw: Mapping[str, Any]) -> HFModelConfig:
    """Parse a config.json dict; raises ValueError naming the missing key."""
    vision = _vision(raw)
    raw = text_config(raw)
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    if "moe_intermediate_size" not in raw:  # (an all-MoE model may have no dense MLP size: Qwen3.5)
        required.insert(2, "intermediate_size")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    heads = int(raw["num_attention_heads"])
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
    theta, scaling = rope_settings(raw)
    mrope_section, mrope_interleaved = _mrope(raw)
    max_positions = int(raw.get("max_position_embeddings", 2048))
    from flotilla.models.context_length import derived_max_model_len  # (it builds on this module's rope settings)

    rope_positions = max(max_positions, derived_max_model_len(raw)[0], int(raw.get("model_max_length") or 0))
    return HFModelConfig(
        architectures=tuple(raw.get("architectures") or ()),
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw.get("intermediate_size") or raw["moe_intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=_first_id(raw.get("bos_token_id")),
        eos_token_ids=eos_ids,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        sliding_window=_sliding_window(raw),
        moe=_moe(raw),
        mla=_mla(raw),
        dsa=_dsa(raw),
        quantization=_quantization(raw),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0),
        linear_attention=_linear_attention(raw),
        partial_rotary_factor=float((raw.get("rope_parameters") or {}).get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        vision=vision,
        deepseek_v4=_deepseek_v4(raw),
        rope_positions=rope_positions,
    )


_V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_V4_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _deepseek_v4(raw: Mapping[str, Any]) -> DeepseekV4Params | None:
    """DeepSeek-V4's own parameters, with transformers' defaults and its legacy names (compress_ratios,
    num_hash_layers, qk_rope_head_dim); None for another model_type."""
    if raw.get("model_type") != "deepseek_v4":
        return None
    n = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or 512)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(raw.get("compress_rates") or {})}
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = [_V4_RATIO_TYPES[int(r)] for r in raw["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA and HCA in turn
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    if bad := [t for t in types if t not in _V4_LAYER_TYPES]:
        raise ValueError(f"unknown DeepSeek-V4 layer_types {bad}")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(raw.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    rope = raw.get("rope_parameters") or {}
    main, compress = rope.get("main"), rope.get("compress")
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        factor = (raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") is not None
                  else (main or {}).get("partial_rotary_factor", 64 / 512))
    if not isinstance(compress, dict):  # a flat rope_parameters (or rope_scaling) is the compressed layers' scaling
        flat = {k: v for k, v in {**(raw.get("rope_scaling") or {}), **rope}.items() if k not in ("main", "compress")}
        compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        main = {"rope_theta": raw.get("rope_theta", 10000.0)}
    scaling = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return DeepseekV4Params(
        q_lora_rank=int(raw.get("q_lora_rank", 1024)), o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)), layer_types=tuple(types[:n]),
        mlp_layer_types=tuple(mlp_types[:n]),
        compress_rates=(int(rates["compressed_sparse_attention"]), int(rates["heavily_compressed_attention"])),
        rope_dim=int(head_dim * float(factor)), main_rope_theta=float(main.get("rope_theta", 10000.0)),
        compress_rope_theta=float(compress.get("rope_theta", 160000.0)), compress_rope_scaling=scaling,
        hc_mult=int(raw.get("hc_mult", 4)), hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)), swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        index_n_heads=int(raw.get("index_n_heads", 64)), index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)))


def load_hf_config(model_dir: str | Path) -> HFModelConfig:
    """Read and parse <model_dir>/config.json."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        return parse_hf_config(json.load(f))
