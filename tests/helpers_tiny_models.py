"""Tiny random HF checkpoints and a paged-KV driver for model tests.

write_tiny_model() saves a real HF folder (config.json + model.safetensors, fp32, fixed seed) through
transformers' own classes, so flotilla is checked against the reference implementation with identical
weights. PagedRunner drives a flotilla model over a paged cache the way the worker does: any mix of
prefill chunks and decodes per step, blocks handed out in shuffled (non-contiguous) order.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from flotilla.kernels.attention import AttentionMetadata, positions_from_lists
from flotilla.kernels.quant import block_dequantize, block_quantize
from flotilla.models.hf_config import load_hf_config
from flotilla.models.registry import get_model_class

_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # Wider than HF's 0.02 so greedy choices are not near-ties that float noise could flip.
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (transformers config class, model class, config overrides)
TINY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, num_hidden_layers=3)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(tie_word_embeddings=False, head_dim=32, num_hidden_layers=3, eos_token_id=[2, 3]),
    ),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
    # a head size the GPU kernels (flashinfer: 64/128/256) take, for GPU engine tests
    "qwen3_hd64": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=64)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


def write_tiny_model(model_dir: str | Path, name: str, seed: int = 0) -> Path:
    """Save the tiny random HF model `name` (a TINY_CONFIGS key) as a checkpoint folder; returns it."""
    config_cls, model_cls, overrides = TINY_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def load_hf_model(model_dir: str | Path) -> nn.Module:
    """The transformers reference model of a checkpoint folder, fp32, eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_flotilla_model(model_dir: str | Path, attention_backend: str = "torch") -> nn.Module:
    """A flotilla model built from config.json and loaded from model.safetensors; asserts nothing missing."""
    config = load_hf_config(model_dir)
    model = get_model_class(config.architectures)(config, attention_backend=attention_backend)
    loaded = model.load_weights(load_file(str(Path(model_dir) / "model.safetensors")).items())
    missing = set(dict(model.named_parameters())) - loaded
    assert not missing, f"parameters not loaded: {sorted(missing)}"
    return model.eval()


@torch.inference_mode()
def hf_logits(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 [len, vocab]: the reference logits of every position of one sequence (on the model's device)."""
    return hf_model(torch.tensor([token_ids], device=next(hf_model.parameters()).device)).logits[0].float()


class PagedRunner:
    """Drives a flotilla model over a paged KV cache with per-sequence block tables, like the worker."""

    def __init__(self, model: nn.Module, num_blocks: int = 128, block_size: int = 4, seed: int = 0,
                 kv_dtype: torch.dtype | None = None, device: str = "cpu") -> None:
        """kv_dtype: the cache's (default: the model's), e.g. torch.float8_e4m3fn for an FP8 KV cache; device: the
        model's (the logits come back on the CPU)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = kv_dtype or next(model.parameters()).dtype
        # NaN-filled so reading any slot that was never written poisons the result and fails the test.
        self.kv_caches = [
            torch.full(model.kv_cache_shape(num_blocks, block_size), float("nan"), dtype=dtype, device=device)
            for _ in range(model.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}
        self.state_slots: dict[int, int] = {}
        """A hybrid model's (allocate_state): seq id -> its recurrent-state slot, handed out in shuffled order."""
        self.free_slots: list[int] = []
        if hasattr(model, "allocate_state"):
            model.allocate_state(16, dtype, torch.device(device))
            self.free_slots = list(range(16))
            random.Random(seed).shuffle(self.free_slots)

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int]]], positions: torch.Tensor | None = None,
             **model_kwargs: Any) -> list[torch.Tensor]:
        """Run one step over (seq_id, new token ids) pairs; returns float32 logits [n_new, vocab] per
        pair, in order. New sequence ids start from an empty cache. positions: the tokens' RoPE positions
        (default: each token's index in its sequence); model_kwargs go to the model's forward as they are."""
        cached, new, tables = [], [], []
        for seq_id, token_ids in batch:
            blocks = self.blocks.setdefault(seq_id, [])
            num_cached = self.num_cached.setdefault(seq_id, 0)
            needed = -(-(num_cached + len(token_ids)) // self.block_size)
            while len(blocks) < needed:
                blocks.append(self.free_blocks.pop())
            cached.append(num_cached)
            new.append(len(token_ids))
            tables.append(blocks)
        device = self.device
        meta = AttentionMetadata.from_lists(cached, new, tables, self.block_size, device=device)
        if hasattr(self.model, "allocate_state"):
            for seq_id, _ in batch:
                if seq_id not in self.state_slots:
                    self.state_slots[seq_id] = slot = self.free_slots.pop()
                    self.model.reset_state(torch.tensor([slot], device=device))
            meta.state_slots = torch.tensor([self.state_slots[seq_id] for seq_id, _ in batch], device=device)
        input_ids = torch.tensor([t for _, ids in batch for t in ids], dtype=torch.int64, device=device)
        if positions is None:
            positions = positions_from_lists(cached, new, device=device)
        hidden = self.model(input_ids, positions.to(device), self.kv_caches, meta, **model_kwargs)
        logits = self.model.compute_logits(hidden).cpu()
        for seq_id, token_ids in batch:
            self.num_cached[seq_id] += len(token_ids)
        return list(logits.split(new))

    def free(self, seq_id: int) -> None:
        """Return a finished sequence's blocks to the pool."""
        self.free_blocks.extend(self.blocks.pop(seq_id))
        del self.num_cached[seq_id]
        if seq_id in self.state_slots:
            self.free_slots.append(self.state_slots.pop(seq_id))


# Qwen3-MoE: name -> config overrides of transformers' Qwen3MoeConfig (kept apart from TINY_CONFIGS so
# the dense models' parametrized tests do not grow; tests/test_qwen3_moe.py runs these).
TINY_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    # every layer sparse except layer 1 (a dense MLP of intermediate_size), renormalized top-2 of 8
    "qwen3_moe": dict(
        tie_word_embeddings=False,
        head_dim=32,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        eos_token_id=[2, 3],
    ),
    # every second layer sparse, raw softmax weights (norm_topk_prob off), top-3 of 6, tied embeddings
    "qwen3_moe_step2": dict(
        tie_word_embeddings=True,
        head_dim=32,
        num_hidden_layers=2,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
}

TINY_MOE_CONFIGS["qwen3_moe_hd64"] = {**TINY_MOE_CONFIGS["qwen3_moe"], "head_dim": 64}
"""qwen3_moe with head_dim 64, which every GPU attention backend takes (CUDA-graph tests)."""


def write_tiny_moe_model(model_dir: str | Path, name: str = "qwen3_moe", seed: int = 0) -> Path:
    """Save the tiny random Qwen3-MoE model `name` (a TINY_MOE_CONFIGS key) as a checkpoint folder."""
    config = transformers.Qwen3MoeConfig(**{**_COMMON, **TINY_MOE_CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


# Qwen3.5-MoE: name -> config overrides of transformers' Qwen3_5MoeTextConfig (tests/test_qwen3_5_moe.py runs these)
TINY_QWEN35_CONFIGS: dict[str, dict[str, Any]] = {
    # 3 gated delta net layers + 1 gated attention layer, 8 experts top-2 and a shared expert, grouped value heads
    "qwen3_5_moe": dict(
        tie_word_embeddings=False,
        num_hidden_layers=4,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        eos_token_id=None,  # (generate's min_new_tokens would mask the EOS ids the engine's ignore_eos keeps)
    ),
}
TINY_QWEN35_CONFIGS["qwen3_5_moe_hd64"] = {**TINY_QWEN35_CONFIGS["qwen3_5_moe"], "head_dim": 64}  # (FlashInfer's)


def write_tiny_qwen35_model(model_dir: str | Path, name: str = "qwen3_5_moe", seed: int = 0) -> Path:
    """Save the tiny random Qwen3.5-MoE text model `name` (a TINY_QWEN35_CONFIGS key) as a checkpoint folder; the
    zero-centred norms' weights (zeros at init) and the delta nets' dt_bias are drawn at random so they matter."""
    overrides = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
    config = transformers.Qwen3_5MoeTextConfig(**{**overrides, **TINY_QWEN35_CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "dt_bias")):
                p.normal_(0.0, 0.2)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


# DeepSeek-V3: name -> config overrides of transformers' DeepseekV3Config (tests/test_deepseek_v3.py runs these).
# num_key_value_heads must equal num_attention_heads: transformers' MLA repeats K/V by heads // kv_heads.
TINY_DEEPSEEK_CONFIGS: dict[str, dict[str, Any]] = {
    # low-rank q, YaRN (its cos/sin factor != 1 and the softmax mscale), interleaved rope, 8 experts in 4
    # groups (top-2 groups, top-3 experts), one shared expert, a dense first layer
    "deepseek_v3": dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=1.0, mscale_all_dim=0.7, beta_fast=32, beta_slow=1),
        tie_word_embeddings=False,
    ),
    # one q_proj (q_lora_rank None), plain rope in halves, Kimi-K2's single group, raw weights (no
    # renormalization), two shared experts, tied embeddings
    "deepseek_v3_no_q_lora": dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        rope_interleave=False,
        tie_word_embeddings=True,
    ),
}


def write_tiny_deepseek_model(model_dir: str | Path, name: str = "deepseek_v3", seed: int = 0) -> Path:
    """Save the tiny random DeepSeek-V3 model `name` (a TINY_DEEPSEEK_CONFIGS key) as a checkpoint folder;
    the routers' score-correction biases (zeros at init) are drawn at random so that they change choices."""
    config = transformers.DeepseekV3Config(**{**_COMMON, **TINY_DEEPSEEK_CONFIGS[name]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


# DeepSeek-V3.2 and GLM-5 (sparse attention): tiny DeepSeek-V3s with an indexer whose top-k is smaller than the
# prompts (attention is really sparse); GLM's "shared" layers reuse the previous layer's choice. Indexer heads are
# many enough that a position whose every head's ReLU is 0 (an exact tie at 0, which either engine may break its
# own way) is rare; no EOS (generate's min_new_tokens would mask it where the engine picks it).
TINY_DSA_CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "deepseek_v32": (transformers.DeepseekV32Config, dict(
        TINY_DEEPSEEK_CONFIGS["deepseek_v3"], index_topk=6, index_n_heads=16, index_head_dim=24, eos_token_id=None)),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, dict(
        TINY_DEEPSEEK_CONFIGS["deepseek_v3"], num_hidden_layers=4, index_topk=5, index_n_heads=16, index_head_dim=32,
        indexer_types=["full", "shared", "full", "shared"], n_group=1, topk_group=1, eos_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def write_tiny_dsa_model(model_dir: str | Path, name: str = "deepseek_v32", seed: int = 0) -> Path:
    """Save the tiny random sparse-attention model `name` (a TINY_DSA_CONFIGS key); the routers' biases and the
    indexers' key norms (ones and zeros at init) are drawn at random so that they matter."""
    config_class, overrides = TINY_DSA_CONFIGS[name]
    config = config_class(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.3)
            elif ".indexer.k_norm." in name_:
                p.normal_(1.0 if name_.endswith("weight") else 0.0, 0.3)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


FP8_BLOCK = (32, 32)
"""write_tiny_deepseek_fp8_pair's weight blocks: small, so the tiny model's linears span several blocks,
partial ones included (q_b_proj's K 48, kv_a_proj_with_mqa's N 48)."""
_FP8_QUANTIZED = re.compile(r"\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj"
                            r"|down_proj|indexer\.wq_b|indexer\.wk)\.weight$")  # fmt: skip


def write_tiny_deepseek_fp8_pair(root: str | Path, name: str = "deepseek_v3",
                                 block: tuple[int, int] = FP8_BLOCK) -> tuple[Path, Path]:  # fmt: skip
    """(fp8 folder, float folder) under `root`: the tiny DeepSeek-V3 model `name` (or sparse-attention one, a
    TINY_DSA_CONFIGS key) with its linears (routed experts and the indexer's wq_b and wk included) quantized in
    `block` blocks (DeepSeek's quantization_config), and the same model with those weights dequantized back
    (float32, no quantization)."""
    root = Path(root)
    src = (write_tiny_dsa_model if name in TINY_DSA_CONFIGS else write_tiny_deepseek_model)(root / "float_src", name)
    return write_fp8_pair(src, root, block, others=False)


QWEN_FP8_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z"
                                r"|out_proj)\.weight$|\.experts\.(gate_up_proj|down_proj)$")
"""The linears Qwen's FP8 releases quantize (attention, the delta nets' big projections, every expert and shared
expert; not embeddings, LM head, routers, norms or the delta nets' conv and small a / b projections)."""


def write_fp8_pair(src: str | Path, root: str | Path, block: tuple[int, int] = FP8_BLOCK,
                   quantized: re.Pattern = _FP8_QUANTIZED, others: bool = True) -> tuple[Path, Path]:  # fmt: skip
    """(fp8 folder, float folder) under `root` from the float checkpoint folder `src`: the tensors `quantized` names
    as e4m3 weights in `block` blocks with their `_scale_inv` (stacked [E, N, K] experts expert by expert) and an
    fp8 quantization_config, and the same model with those weights dequantized back (float32, none); `others`: the
    other files of `src` (tokenizer, generation_config.json, ...) in both."""
    root = Path(root)
    weights = load_file(str(Path(src) / "model.safetensors"))
    fp8, dequantized = {}, {}
    for key, w in weights.items():
        if quantized.search(key) and w.dim() in (2, 3):
            pairs = [block_quantize(m, block) for m in (w if w.dim() == 3 else [w])]
            q, s = (torch.stack(t) for t in zip(*pairs)) if w.dim() == 3 else pairs[0]
            fp8[key], fp8[f"{key}_scale_inv"] = q, s
            dequantized[key] = torch.stack([block_dequantize(*p, block) for p in pairs]) if w.dim() == 3 \
                else block_dequantize(q, s, block)
        else:
            fp8[key] = dequantized[key] = w
    config = json.loads((Path(src) / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                    "activation_scheme": "dynamic"}
    dirs = []
    for sub, tensors, extra in (("fp8", fp8, {"quantization_config": quantization}), ("dequantized", dequantized, {})):
        d = root / sub
        d.mkdir()
        for f in Path(src).iterdir() if others else ():
            if f.is_file() and f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
                shutil.copy(f, d / f.name)
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        dirs.append(d)
    return dirs[0], dirs[1]


# ---- checks every model class runs against transformers (tests/test_models.py, test_qwen3_moe.py, ...) ----

ATOL = 2e-4
"""Logits tolerance against transformers (fp32 tiny models)."""

MIXED_SCHEDULE = [
    [(0, slice(0, 5)), (1, slice(0, 6))],
    [(1, slice(6, 13)), (0, slice(5, 6)), (2, slice(0, 9))],
    [(2, slice(9, 10)), (0, slice(6, 7)), (1, slice(13, 14))],
    [(0, slice(7, 8)), (2, slice(10, 12)), (1, slice(14, 16))],
]
"""Steps over three sequences of 8, 16 and 12 tokens that mix full prefills, prefill chunks over a cached
prefix, and decodes."""


def random_tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prefill_then_paged_decode(model: nn.Module, hf_model: nn.Module) -> None:
    """An 11-token prefill, then 16 greedy paged decode steps: logits equal transformers' over the whole run."""
    runner = PagedRunner(model, block_size=4)
    tokens = random_tokens(11, seed=1)
    prefill = runner.step([(0, tokens)])[0]
    decode = []
    for _ in range(16):
        tokens.append(int(decode[-1].argmax() if decode else prefill[-1].argmax()))
        decode.append(runner.step([(0, [tokens[-1]])])[0][0])
    reference = hf_logits(hf_model, tokens)
    torch.testing.assert_close(prefill, reference[:11], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(decode), reference[11:], atol=ATOL, rtol=0)


def check_greedy_matches_generate(model: nn.Module, hf_model: nn.Module, num_tokens: int = 32) -> None:
    """The paged model's greedy tokens equal transformers' generate for a 9-token prompt."""
    prompt = random_tokens(9, seed=2)
    with torch.inference_mode():
        hf_out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                   max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)  # fmt: skip
    runner = PagedRunner(model, block_size=16)
    generated = [int(runner.step([(0, prompt)])[0][-1].argmax())]
    while len(generated) < num_tokens:
        generated.append(int(runner.step([(0, [generated[-1]])])[0][-1].argmax()))
    assert generated == hf_out[0, len(prompt) :].tolist()


def check_mixed_batch_equals_each_alone(model: nn.Module, hf_model: nn.Module, schedule: list = MIXED_SCHEDULE,
                                        alone_atol: float = 1e-5) -> None:
    """Sequences batched by `schedule` get the logits each gets alone (within alone_atol), and transformers'."""
    seqs = {0: random_tokens(8, seed=10), 1: random_tokens(16, seed=11), 2: random_tokens(12, seed=12)}
    together = PagedRunner(model, block_size=4, seed=3)
    batched: dict[int, list[torch.Tensor]] = {i: [] for i in seqs}
    for step in schedule:
        for (i, _), logits in zip(step, together.step([(i, seqs[i][s]) for i, s in step]), strict=True):
            batched[i].append(logits)
    for i, tokens in seqs.items():
        alone = PagedRunner(model, block_size=4, seed=100 + i).step([(0, tokens)])[0]
        got = torch.cat(batched[i])
        torch.testing.assert_close(got, alone, atol=alone_atol, rtol=0)
        torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def write_flash_mla_shaped_deepseek(model_dir: str | Path) -> Path:
    """A small DeepSeek-V3 with FlashMLA's shapes (kv_lora_rank 512, rope 64, 16 heads), random weights."""
    config = transformers.DeepseekV3Config(**{**_COMMON, **dict(
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=1024, tie_word_embeddings=False)})  # fmt: skip
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).float().eval().save_pretrained(model_dir, safe_serialization=True)
    return Path(model_dir)
