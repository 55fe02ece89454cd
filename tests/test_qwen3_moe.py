"""Qwen3-MoE against transformers on tiny random checkpoints with identical weights (fp32): prefill and
paged decode logits, greedy tokens, mixed batches; loading both expert layouts; load_format=dummy; and
the engine end to end (LLM greedy output equals transformers' generate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_engine import write_tiny_tokenizer
from helpers_tiny_models import (
    TINY_MOE_CONFIGS,
    PagedRunner,
    check_greedy_matches_generate,
    check_mixed_batch_equals_each_alone,
    check_prefill_then_paged_decode,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
    write_tiny_moe_model,
)
from safetensors.torch import load_file, save_file
from torch import nn

from flotilla import LLM, SamplingParams
from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.llama import LlamaMLP
from flotilla.models.loader import ModelLoadError, load_model
from flotilla.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock
from flotilla.models.registry import get_model_class


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {name: write_tiny_moe_model(root / name, name) for name in TINY_MOE_CONFIGS}


@pytest.fixture(scope="module")
def models(model_dirs: dict[str, Path]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """name -> (flotilla model, transformers model) over the same checkpoint."""
    return {name: (load_flotilla_model(d), load_hf_model(d)) for name, d in model_dirs.items()}


def test_sparse_and_dense_layers_follow_the_config(models: dict) -> None:
    kinds = {name: [type(layer.mlp) for layer in models[name][0].model.layers] for name in TINY_MOE_CONFIGS}
    assert kinds["qwen3_moe"] == [Qwen3MoeSparseBlock, LlamaMLP, Qwen3MoeSparseBlock]  # mlp_only_layers=[1]
    assert kinds["qwen3_moe_step2"] == [LlamaMLP, Qwen3MoeSparseBlock]  # decoder_sparse_step=2
    model = models["qwen3_moe"][0]
    assert model.moe_backend_name == "torch"
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)  # [E, 2I, H]
    assert model.model.layers[0].mlp.experts.down_proj.shape == (8, 64, 32)  # [E, H, I]


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_prefill_then_paged_decode_match_transformers(name: str, models: dict) -> None:
    check_prefill_then_paged_decode(*models[name])


@pytest.mark.parametrize("name", list(TINY_MOE_CONFIGS))
def test_greedy_tokens_match_transformers_generate(name: str, models: dict) -> None:
    check_greedy_matches_generate(*models[name])


def test_mixed_batch_equals_each_sequence_alone(models: dict) -> None:
    """Tokens of different sequences share the experts' GEMMs; none may leak into another's output."""
    schedule = [
        [(0, slice(0, 5)), (1, slice(0, 6))],
        [(1, slice(6, 13)), (0, slice(5, 6)), (2, slice(0, 9))],
        [(2, slice(9, 12)), (0, slice(6, 8)), (1, slice(13, 16))],
    ]
    check_mixed_batch_equals_each_alone(*models["qwen3_moe"], schedule)


def _stacked_layout(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The same checkpoint with each layer's experts stacked the way transformers 5 holds them in memory."""
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    prefixes = {k.split(".mlp.experts.")[0] for k in weights if ".mlp.experts." in k}
    for p in prefixes:
        e = f"{p}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{e}.{i}.gate_proj.weight"], weights[f"{e}.{i}.up_proj.weight"]]) for i in
             range(num_experts)])  # fmt: skip
        out[f"{e}.down_proj"] = torch.stack([weights[f"{e}.{i}.down_proj.weight"] for i in range(num_experts)])
    return out


def test_per_expert_and_stacked_checkpoints_load_the_same_parameters(model_dirs: dict[str, Path],
                                                                     models: dict) -> None:  # fmt: skip
    config = load_hf_config(model_dirs["qwen3_moe"])
    weights = load_file(str(model_dirs["qwen3_moe"] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in weights  # what save_pretrained writes
    stacked = Qwen3MoeForCausalLM(config, attention_backend="torch", fused_ops="torch", moe_backend="torch")
    assert (stacked.fused_ops_name, stacked.moe_backend_name) == ("torch", "torch")
    assert stacked.load_weights(_stacked_layout(weights, 8).items()) == set(dict(stacked.named_parameters()))
    for (name, want), (_, got) in zip(models["qwen3_moe"][0].named_parameters(), stacked.named_parameters(),
                                      strict=True):  # fmt: skip
        assert torch.equal(got, want), name


def test_missing_expert_shards_are_reported_and_bad_ones_named(model_dirs: dict[str, Path]) -> None:
    config = load_hf_config(model_dirs["qwen3_moe"])
    weights = load_file(str(model_dirs["qwen3_moe"] / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    del weights["model.layers.0.mlp.experts.3.down_proj.weight"]
    model = Qwen3MoeForCausalLM(config, attention_backend="torch")
    missing = set(dict(model.named_parameters())) - model.load_weights(weights.items())
    assert missing == {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight' names expert 8"):
        model.load_weights([("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight' has shape"):
        model.load_weights([("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight' matches no param"):
        model.load_weights([("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(32, 64))])  # dense layer


def test_loader_reads_a_sharded_checkpoint_and_builds_dummy_weights(model_dirs: dict[str, Path], tmp_path: Path,
                                                                    models: dict) -> None:  # fmt: skip
    src = model_dirs["qwen3_moe"]
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {%s}}' % ", ".join(f'"{n}": "{f}"' for f, part in shards.items() for n in part))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    loaded = load_model(tmp_path, progress=False, model_kwargs={"attention_backend": "torch", "moe_backend": "torch"})
    tokens = random_tokens(10, seed=5)
    want = PagedRunner(models["qwen3_moe"][0]).step([(0, tokens)])[0]
    torch.testing.assert_close(PagedRunner(loaded.module).step([(0, tokens)])[0], want, atol=0, rtol=0)

    dummy = load_model(src, dtype="bfloat16", load_format="dummy", progress=False)
    assert isinstance(dummy.module, Qwen3MoeForCausalLM) and dummy.dtype == torch.bfloat16
    logits = PagedRunner(dummy.module).step([(0, tokens)])[0]
    assert torch.isfinite(logits).all()
    with pytest.raises(ModelLoadError, match="unknown MoE backend 'nope'"):
        load_model(src, progress=False, model_kwargs={"moe_backend": "nope"})


def test_moe_config_parses_hub_and_transformers5_names() -> None:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_experts_per_tok=8, moe_intermediate_size=32)  # fmt: skip
    hub = parse_hf_config({**base, "num_experts": 128, "norm_topk_prob": True, "decoder_sparse_step": 1,
                           "mlp_only_layers": []})  # fmt: skip
    assert hub.moe is not None and (hub.moe.num_experts, hub.moe.norm_topk_prob) == (128, True)
    v5 = parse_hf_config({**base, "num_local_experts": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert v5.moe is not None and (v5.moe.num_experts, v5.moe.norm_topk_prob) == (16, False)
    assert [v5.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ValueError, match="has experts but lacks moe_intermediate_size"):
        parse_hf_config({**{k: v for k, v in base.items() if k != "moe_intermediate_size"}, "num_experts": 4})
    dense = parse_hf_config(base)  # no num_experts: a dense model, which the MoE class refuses
    assert dense.moe is None
    with pytest.raises(ValueError, match="no experts"):
        get_model_class(dense.architectures)(dense)


def test_engine_greedy_output_equals_transformers_generate(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = write_tiny_moe_model(tmp_path / "engine_moe", "qwen3_moe")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    hf = load_hf_model(model_dir)
    prompts = [random_tokens(n, seed=20 + n) for n in (5, 17, 9)]
    with LLM(str(model_dir), kv_cache_blocks=128, block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))[0, len(p):].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == ref
