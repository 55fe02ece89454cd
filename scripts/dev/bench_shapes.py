"""Real model shapes for benchmarks on the device: the same configs ../shared/gpu/vllm-peer/peer_bench.py gives
vLLM, built as a folder holding only config.json (weights come from load_format=dummy: random, on the device)."""

from __future__ import annotations

import json
import random
import re
import tempfile
from pathlib import Path
from typing import Any

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, max_position_embeddings=40960,
              rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {**_QWEN3, **dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=False)},
    "qwen3-0.6b": {**_QWEN3, **dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                    tie_word_embeddings=True)},
    "qwen3-30b-a3b": {**_QWEN3, **dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                       hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                       num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                       moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                       tie_word_embeddings=False)},
    # DeepSeek-V3's real layer shapes, 4 layers (1 dense + 3 MoE with 256 experts), FP8 block-scaled weights
    "deepseek-v3-4l": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=1,
        norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                        "type": "yarn"},
        tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu", num_nextn_predict_layers=0,
        bos_token_id=0, eos_token_id=1,
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "weight_block_size": [128, 128]}),
}


SHAPES["deepseek-v32-4l"] = {**SHAPES["deepseek-v3-4l"], "architectures": ["DeepseekV32ForCausalLM"],
                              "model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128,
                              "index_n_heads": 64}
"""DeepSeek-V3.2: DeepSeek-V3's 4 layers, each with the lightning indexer of sparse attention (top 2,048)."""
SHAPES["glm5-4l"] = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
    intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=64,
    num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, topk_method="noaux_tc", n_group=1,
    topk_group=1, num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
    max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=10000, tie_word_embeddings=False,
    torch_dtype="bfloat16", hidden_act="silu", num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
    index_topk=2048, index_head_dim=128, index_n_heads=32, indexer_types=["full"] * 4,
    quantization_config=SHAPES["deepseek-v3-4l"]["quantization_config"])
"""GLM-5's layer shapes (transformers' GlmMoeDsaConfig), 4 layers (1 dense + 3 MoE), FP8 block-scaled weights."""
SHAPES["deepseek-v3-4l-mtp"] = {**SHAPES["deepseek-v3-4l"], "num_nextn_predict_layers": 1}
"""deepseek-v3-4l with DeepSeek-V3's MTP layer (scripts/dev/bench_mtp.py); the peer's shape has none."""
SHAPES["qwen3-8b-yarn"] = {**SHAPES["qwen3-8b"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32768}}
"""qwen3-8b with the YaRN scaling its model card gives for 131,072 tokens (pass --max-model-len up to that)."""

SHAPES["qwen3-vl-30b-a3b"] = dict(
    architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", torch_dtype="bfloat16",
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
    text_config={**SHAPES["qwen3-30b-a3b"], "architectures": None, "model_type": "qwen3_vl_moe_text",
                 "rope_theta": 5000000.0, "max_position_embeddings": 262144,
                 "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    vision_config=dict(model_type="qwen3_vl_moe", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=2048, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                       hidden_act="gelu_pytorch_tanh"))
"""Qwen3-VL-30B-A3B: Qwen3-30B-A3B's text layers with interleaved M-RoPE, and its 27-block vision tower."""
SHAPES["deepseek-v4-flash-4l"] = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
    moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
    q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
    partial_rotary_factor=0.125, max_position_embeddings=1048576, rms_norm_eps=1e-6, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0)
"""DeepSeek-V4-Flash's layer shapes (transformers' defaults), 4 layers: one of each attention kind and a hash-MoE
first layer (bf16 weights: the reference dequantizes FP8 / MXFP4 checkpoints as they load)."""
SHAPES["qwen3.5-35b-a3b"] = dict(
    architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", tie_word_embeddings=False,
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054,
    torch_dtype="bfloat16",
    text_config=dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hidden_act="silu",
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, bos_token_id=248044,
        eos_token_id=248046, mamba_ssm_dtype="float32"),
    vision_config=dict(model_type="qwen3_5_moe_vision", depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                       intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304))
"""Qwen3.5-35B-A3B as its checkpoint's config has it (the conditional-generation layout vLLM registers): 40 layers,
three gated delta nets to each gated attention layer, 256 experts top-8 and a shared expert; flotilla reads the
text model (the vision tower is not built for it). `mamba_ssm_dtype` float32, as the released configs say: vLLM
keeps the delta nets' recurrent state in it (without it, in the model's bf16); flotilla always does."""
SHAPE_FILES: dict[str, dict[str, dict[str, Any]]] = {"qwen3-vl-30b-a3b": {"preprocessor_config.json": dict(
    image_processor_type="Qwen2VLImageProcessorFast", patch_size=16, temporal_patch_size=2, merge_size=2,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], size={"longest_edge": 16777216, "shortest_edge": 65536})}}
"""The files beside config.json a shape needs (a model that takes images: its image processor's settings)."""

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2/3's special tokens, in id order from 151,643 (the image ones at the ids Qwen3-VL's config names)."""

_DEEPSEEK_LAYERS = re.compile(r"^deepseek-v3-(\d+)l(-mtp)?$")
_QWEN3_5_LAYERS = re.compile(r"^qwen3\.5-35b-a3b-(\d+)l(-mtp)?$")


def _add_qwen_special_tokens(vocab: dict[str, int], first_special: int) -> list[dict[str, Any]]:
    """Qwen's special tokens into `vocab` from id first_special on; their tokenizer.json added_tokens entries."""
    added = []
    for i, token in enumerate(QWEN_SPECIAL_TOKENS):
        vocab[token] = first_special + i
        added.append({"id": first_special + i, "content": token, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    return added


def write_qwen_placeholder_tokenizer(folder: Path, first_special: int = 151643) -> None:
    """A tokenizer for a dummy-weight Qwen-shaped model whose engine needs one (vLLM's Qwen3-VL processor): a word
    per id ("t0", "t1", ...) below Qwen's special tokens, which sit at their real ids. No text is meant to be read
    through it: the benchmarks send token ids."""
    vocab = {f"t{i}": i for i in range(first_special)}
    added = _add_qwen_special_tokens(vocab, first_special)
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|endoftext|>"}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}))


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character byte-level BPE vocabularies write each byte as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_byte_level_placeholder_tokenizer(folder: Path, first_special: int = 151643, seed: int = 0) -> None:
    """A byte-level BPE tokenizer for a dummy-weight Qwen-shaped model whose benchmark constrains outputs (a grammar's
    token masks need real token strings): the 256 bytes, then seeded pieces of text, JSON and numbers of 2 to 8
    characters (a space-prefixed word, as BPE vocabularies hold them, or punctuation with letters and digits) up to
    Qwen's special tokens at their real ids. Nothing is encoded through it (no merges): the benchmarks send ids."""
    rng = random.Random(seed)
    chars = _byte_chars()
    pieces = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" * 4 + '{}[]:,."_-+=/\\()'
    vocab = {c: i for i, c in enumerate(chars)}
    while len(vocab) < first_special:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 7)))
        token = (" " + word) if rng.random() < 0.4 else word + rng.choice(pieces)
        vocab.setdefault("".join(chars[b] for b in token.encode()), len(vocab))
    added = _add_qwen_special_tokens(vocab, first_special)
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": True},
                 "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                                     "trim_offsets": True, "use_regex": True},
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": vocab, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>"}))


def shape_config(name: str | None) -> dict[str, Any] | None:
    """The config.json of a built-in shape (None: not one): SHAPES' names, deepseek-v3-<N>l[-mtp] for any N of
    at least 2: DeepSeek-V3's layers, 1 dense + N - 1 MoE (wide expert parallelism fills 4 or 8 GPUs with more), and
    qwen3.5-35b-a3b-<N>l[-mtp]: Qwen3.5-35B-A3B's first N layers (its 40 fill most of an 80 GB GPU in bf16)."""
    if name in SHAPES or not name:
        return SHAPES.get(name or "")
    match = _QWEN3_5_LAYERS.match(name)
    if match is not None and int(match.group(1)) >= 1:
        base = SHAPES["qwen3.5-35b-a3b"]
        text = {**base["text_config"], "num_hidden_layers": int(match.group(1)),
                "mtp_num_hidden_layers": 1 if match.group(2) else 0}
        return {**base, "text_config": text}
    match = _DEEPSEEK_LAYERS.match(name)
    if match is None or int(match.group(1)) < 2:
        return None
    return {**SHAPES["deepseek-v3-4l"], "num_hidden_layers": int(match.group(1)),
            "num_nextn_predict_layers": 1 if match.group(2) else 0}


SHAPE_NAMES = ", ".join([*SHAPES, "deepseek-v3-<N>l[-mtp]", "qwen3.5-35b-a3b-<N>l[-mtp]"])
"""The shapes, for --help texts."""


def shape_dir(name: str) -> Path:
    """A folder holding only the config.json of a built-in shape (KeyError naming the shapes: not one)."""
    config = shape_config(name)
    if config is None:
        raise KeyError(f"{name!r} is not a built-in shape ({SHAPE_NAMES})")
    d = Path(tempfile.gettempdir()) / f"flotilla-shape-{name}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    for file, content in SHAPE_FILES.get(name, {}).items():
        (d / file).write_text(json.dumps(content))
    return d
