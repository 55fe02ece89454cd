"""flotilla models against transformers on tiny random checkpoints with identical weights (fp32):
prefill and paged decode logits, greedy tokens, mixed batches, chunked prefill, loading and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_tiny_models import (
    TINY_CONFIGS,
    PagedRunner,
    check_greedy_matches_generate,
    check_mixed_batch_equals_each_alone,
    check_prefill_then_paged_decode,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
    write_tiny_model,
)
from safetensors.torch import load_file
from torch import nn

from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.llama import LlamaForCausalLM
from flotilla.models.qwen3 import Qwen3ForCausalLM
from flotilla.models.registry import MODEL_REGISTRY, get_model_class


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: write_tiny_model(root / name, name) for name in TINY_CONFIGS}


@pytest.fixture(scope="module")
def models(model_dirs: dict[str, Path]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """name -> (flotilla model, transformers model) over the same checkpoint."""
    return {name: (load_flotilla_model(d), load_hf_model(d)) for name, d in model_dirs.items()}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefill_then_paged_decode_match_transformers(name: str, models: dict) -> None:
    check_prefill_then_paged_decode(*models[name])


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_tokens_match_transformers_generate(name: str, models: dict) -> None:
    check_greedy_matches_generate(*models[name])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_batch_equals_each_sequence_alone(name: str, models: dict) -> None:
    check_mixed_batch_equals_each_alone(*models[name])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_equals_one_shot(block_size: int, models: dict) -> None:
    model, _ = models["qwen3"]
    tokens = random_tokens(21, seed=4)
    one_shot = PagedRunner(model, block_size=block_size).step([(0, tokens)])[0]
    runner = PagedRunner(model, block_size=block_size, seed=9)
    first = runner.step([(0, tokens[:7])])[0]
    second = runner.step([(0, tokens[7:])])[0]
    torch.testing.assert_close(torch.cat([first, second]), one_shot, atol=1e-5, rtol=0)


def test_meta_construction_then_load_matches(model_dirs: dict[str, Path], models: dict) -> None:
    """The loader's path: build on meta, materialize, load; the RoPE table must be rebuilt, not garbage."""
    config = load_hf_config(model_dirs["llama3_rope"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    loaded = model.load_weights(load_file(str(model_dirs["llama3_rope"] / "model.safetensors")).items())
    assert loaded == set(dict(model.named_parameters()))
    tokens = random_tokens(10, seed=5)
    expected = PagedRunner(models["llama3_rope"][0]).step([(0, tokens)])[0]
    torch.testing.assert_close(PagedRunner(model).step([(0, tokens)])[0], expected, atol=0, rtol=0)


def test_default_dtype_construction_keeps_rope_in_float32(model_dirs: dict[str, Path]) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3ForCausalLM(load_hf_config(model_dirs["qwen3"]))
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    # Casting a built model must not round the angle table to bf16 either.
    table = model.model.rotary_emb.cos_sin_cache.clone()
    model.to(torch.float16)
    assert torch.equal(model.model.rotary_emb.cos_sin_cache, table)
    assert model.kv_cache_shape(10, 16) == (10, 2, 16, 2, 32)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (3, 2, 32)


def test_tied_checkpoint_has_no_lm_head_and_untied_loads_it(model_dirs: dict[str, Path], models: dict) -> None:
    assert "lm_head.weight" not in load_file(str(model_dirs["llama_tied"] / "model.safetensors"))
    tied, _ = models["llama_tied"]
    assert tied.lm_head is None
    untied, _ = models["llama"]
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_load_weights_reports_partially_loaded_fused_params(model_dirs: dict[str, Path]) -> None:
    config = load_hf_config(model_dirs["qwen3"])
    weights = load_file(str(model_dirs["qwen3"] / "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]
    del weights["model.layers.0.mlp.up_proj.weight"]
    model = Qwen3ForCausalLM(config)
    missing = set(dict(model.named_parameters())) - model.load_weights(weights.items())
    assert missing == {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}


def test_load_weights_errors_name_the_tensor(model_dirs: dict[str, Path]) -> None:
    model = LlamaForCausalLM(load_hf_config(model_dirs["llama"]))
    bad_shape = [("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64))]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 64\)"):
        model.load_weights(bad_shape)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape"):
        model.load_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match=r"'model\.layers\.9\.mlp\.down_proj\.weight' matches no parameter"):
        model.load_weights([("model.layers.9.mlp.down_proj.weight", torch.zeros(64, 128))])
    # Derived buffers some checkpoints carry are skipped, not errors.
    assert model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]) == set()


def test_unknown_architecture_error_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"unsupported model architecture\(s\) \['GPT2LMHeadModel'\]; supported: "):
        get_model_class(["GPT2LMHeadModel"])
    assert get_model_class(["Foo", "Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert set(MODEL_REGISTRY) >= {"LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def test_hf_config_parses_legacy_and_v5_layouts() -> None:
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    legacy = parse_hf_config(
        {
            **base,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "torch_dtype": "bfloat16",
            "eos_token_id": [128001, 128009],
        }
    )
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling == {"factor": 2.0, "rope_type": "linear"}
    assert legacy.torch_dtype == torch.bfloat16 and legacy.eos_token_ids == (128001, 128009)
    assert (legacy.num_key_value_heads, legacy.head_dim, legacy.tie_word_embeddings) == (4, 16, False)
    v5 = parse_hf_config(
        {**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "dtype": "float32", "eos_token_id": 2}
    )
    assert (v5.rope_theta, v5.rope_scaling, v5.dtype, v5.eos_token_ids) == (1e6, None, "float32", (2,))
    qwen_no_window = parse_hf_config({**base, "sliding_window": 4096, "use_sliding_window": False})
    assert qwen_no_window.sliding_window is None
    with pytest.raises(ValueError, match="lacks required keys: vocab_size"):
        parse_hf_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        parse_hf_config({**base, "num_key_value_heads": 3})
    mistral_v01 = parse_hf_config(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096, "max_position_embeddings": 32768}
    )
    with pytest.raises(NotImplementedError, match="sliding-window attention"):
        get_model_class(mistral_v01.architectures)(mistral_v01)
