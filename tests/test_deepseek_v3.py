"""DeepSeek-V3 against transformers on tiny random checkpoints with identical weights (fp32): prefill and
paged decode logits through the compressed latent cache, 32 greedy tokens, mixed batches, chunked prefill;
the grouped top-k router and YaRN against transformers' own; loading (per-expert and stacked experts, MTP
layers skipped, FP8 refused, dummy weights); config parsing; the engine end to end (tensor parallelism:
tests/test_deepseek_tp.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from helpers_engine import write_tiny_tokenizer
from helpers_tiny_models import (
    TINY_DEEPSEEK_CONFIGS,
    PagedRunner,
    check_greedy_matches_generate,
    check_mixed_batch_equals_each_alone,
    check_prefill_then_paged_decode,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
    write_tiny_deepseek_model,
)
from safetensors.torch import load_file
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from flotilla import LLM, SamplingParams
from flotilla.kernels.moe import select_experts_grouped
from flotilla.kernels.rope import rope_attention_factor, rope_inv_freq
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MLP, DeepseekV3MoE
from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.loader import ModelLoadError, load_model
from flotilla.models.registry import get_model_class


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_deepseek")
    return {name: write_tiny_deepseek_model(root / name, name) for name in TINY_DEEPSEEK_CONFIGS}


@pytest.fixture(scope="module")
def models(model_dirs: dict[str, Path]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """name -> (flotilla model, transformers model) over the same checkpoint."""
    return {name: (load_flotilla_model(d), load_hf_model(d)) for name, d in model_dirs.items()}


def test_layers_and_cache_follow_the_config(models: dict) -> None:
    model, hf_model = models["deepseek_v3"]
    assert [type(layer.mlp) for layer in model.model.layers] == [DeepseekV3MLP, DeepseekV3MoE, DeepseekV3MoE]
    assert model.kv_cache_shape(10, 16) == (10, 16, 32 + 16)  # one latent "head": kv_lora_rank + rope dims
    assert (model.attention_backend_name, model.moe_backend_name) == ("mla_torch", "torch")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj is None and attn.q_b_proj is not None
    assert attn.fused_qkv_a_proj is not None and attn.q_a_proj is None  # float weights: q_a and kv_a in one GEMM
    assert attn.scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling)  # YaRN's mscale included
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    no_q_lora = models["deepseek_v3_no_q_lora"][0]
    no_q_lora_attn = no_q_lora.model.layers[0].self_attn
    assert no_q_lora_attn.q_a_proj is None and no_q_lora_attn.fused_qkv_a_proj is None and no_q_lora.lm_head is None


@pytest.mark.parametrize("name", list(TINY_DEEPSEEK_CONFIGS))
def test_prefill_then_paged_decode_match_transformers(name: str, models: dict) -> None:
    check_prefill_then_paged_decode(*models[name])


@pytest.mark.parametrize("name", list(TINY_DEEPSEEK_CONFIGS))
def test_greedy_tokens_match_transformers_generate(name: str, models: dict) -> None:
    check_greedy_matches_generate(*models[name])


def test_mixed_batch_equals_each_sequence_alone(models: dict) -> None:
    """Prefill chunks over cached prefixes and decodes share one step's MQA and experts; none may leak."""
    check_mixed_batch_equals_each_alone(*models["deepseek_v3"])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_equals_one_shot(block_size: int, models: dict) -> None:
    model, _ = models["deepseek_v3"]
    tokens = random_tokens(21, seed=4)
    one_shot = PagedRunner(model, block_size=block_size).step([(0, tokens)])[0]
    runner = PagedRunner(model, block_size=block_size, seed=9)
    chunks = [runner.step([(0, tokens[a:b])])[0] for a, b in ((0, 7), (7, 10), (10, 21))]
    torch.testing.assert_close(torch.cat(chunks), one_shot, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("num_groups", "topk_groups", "top_k", "renormalize", "scaling"),
                         [(4, 2, 3, True, 2.5), (8, 3, 4, False, 1.0), (1, 1, 6, True, 2.827)])  # fmt: skip
def test_grouped_routing_matches_transformers_router(num_groups: int, topk_groups: int, top_k: int,
                                                     renormalize: bool, scaling: float) -> None:  # fmt: skip
    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=top_k,
                                           n_group=num_groups, topk_group=topk_groups, norm_topk_prob=renormalize,
                                           routed_scaling_factor=scaling)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(num_groups)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.5, generator=gen)  # large enough to change choices
    hidden = torch.randn(64, 32, generator=gen)
    logits, want_weights, want_ids = router(hidden)
    weights, ids = select_experts_grouped(logits, top_k, num_groups, topk_groups, router.e_score_correction_bias,
                                          renormalize, scaling)  # fmt: skip
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order).long(), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-6, rtol=1e-6)
    # the bias chose differently than the raw scores would have (so the test sees it)
    _, unbiased = select_experts_grouped(logits, top_k, num_groups, topk_groups, None, renormalize, scaling)
    assert not torch.equal(unbiased.sort(dim=-1)[0], ids.sort(dim=-1)[0])


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3's
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.7},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False},
])  # fmt: skip
def test_yarn_matches_transformers(scaling: dict) -> None:
    config = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                           rope_parameters={**scaling, "rope_theta": 10000.0})  # fmt: skip
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(rope_inv_freq(64, 10000.0, scaling), want_inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


def _stacked_layout(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The checkpoint with each layer's experts stacked the way transformers 5 holds them in memory."""
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for p in {k.split(".mlp.experts.")[0] for k in weights if ".mlp.experts." in k}:
        e = f"{p}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack([torch.cat([weights[f"{e}.{i}.gate_proj.weight"],
                                                           weights[f"{e}.{i}.up_proj.weight"]])
                                                for i in range(num_experts)])  # fmt: skip
        out[f"{e}.down_proj"] = torch.stack([weights[f"{e}.{i}.down_proj.weight"] for i in range(num_experts)])
    return out


def test_checkpoint_layouts_mtp_layers_and_errors(model_dirs: dict[str, Path], models: dict) -> None:
    config = load_hf_config(model_dirs["deepseek_v3"])
    weights = load_file(str(model_dirs["deepseek_v3"] / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in weights  # what save_pretrained writes
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in weights
    stacked = _stacked_layout(weights, 8)
    # a Hub checkpoint's MTP layer (index num_hidden_layers) is skipped, not an error
    stacked["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    stacked["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    model = DeepseekV3ForCausalLM(config, attention_backend="torch", moe_backend="torch")
    assert model.load_weights(stacked.items()) == set(dict(model.named_parameters()))
    for (name, want), (_, got) in zip(models["deepseek_v3"][0].named_parameters(), model.named_parameters(),
                                      strict=True):  # fmt: skip
        assert torch.equal(got, want), name

    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    del weights["model.layers.0.mlp.gate_proj.weight"]
    fresh = DeepseekV3ForCausalLM(config)
    missing = set(dict(fresh.named_parameters())) - fresh.load_weights(weights.items())
    assert missing == {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate_up_proj.weight"}
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight' names expert 8"):
        fresh.load_weights([("model.layers.1.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.kv_b_proj\.weight' has shape"):
        fresh.load_weights([("model.layers.1.self_attn.kv_b_proj.weight", torch.zeros(32, 32))])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate\.weight' matches no param"):
        fresh.load_weights([("model.layers.0.mlp.gate.weight", torch.zeros(8, 64))])  # a dense layer
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv': FP8"):
        fresh.load_weights([("model.layers.0.self_attn.q_a_proj.weight_scale_inv", torch.zeros(1, 1))])


def test_loader_and_dummy_weights(model_dirs: dict[str, Path], models: dict) -> None:
    src = model_dirs["deepseek_v3"]
    loaded = load_model(src, progress=False, model_kwargs={"attention_backend": "auto", "mla_backend": "torch"})
    tokens = random_tokens(10, seed=5)
    want = PagedRunner(models["deepseek_v3"][0]).step([(0, tokens)])[0]
    torch.testing.assert_close(PagedRunner(loaded.module).step([(0, tokens)])[0], want, atol=0, rtol=0)
    dummy = load_model(src, dtype="bfloat16", load_format="dummy", progress=False)
    assert isinstance(dummy.module, DeepseekV3ForCausalLM) and dummy.dtype == torch.bfloat16
    assert dummy.module.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays float32
    assert torch.isfinite(PagedRunner(dummy.module).step([(0, tokens)])[0]).all()
    with pytest.raises(ModelLoadError, match="unknown MLA backend 'flashinfer'"):
        load_model(src, progress=False, model_kwargs={"attention_backend": "flashinfer"})


HUB_V3 = dict(  # DeepSeek-V3's config.json (transformers 4 era), shrunk where sizes do not matter
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=163840,
    rope_theta=10000, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    num_nextn_predict_layers=1, torch_dtype="bfloat16",
)  # fmt: skip


def test_hub_config_parses_and_unsupported_variants_are_refused() -> None:
    config = parse_hf_config(HUB_V3)
    assert config.mla is not None and config.moe is not None
    assert (config.mla.q_lora_rank, config.mla.kv_lora_rank, config.mla.rope_interleave) == (1536, 512, True)
    moe = config.moe
    assert (moe.num_experts, moe.num_shared_experts, moe.num_groups, moe.topk_groups) == (256, 1, 8, 4)
    assert (moe.routed_scaling_factor, moe.scoring_func, moe.topk_method) == (2.5, "sigmoid", "noaux_tc")
    assert [moe.is_sparse(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert get_model_class(config.architectures) is DeepseekV3ForCausalLM
    with torch.device("meta"):  # DeepSeek-V3's real shapes, without the memory
        model = DeepseekV3ForCausalLM(config)
    assert model.kv_cache_shape(1, 64) == (1, 64, 576)
    mscale = 0.1 * math.log(40.0) + 1  # YaRN's mscale for factor 40, mscale_all_dim 1
    assert model.model.layers[0].self_attn.scale == pytest.approx(192**-0.5 * mscale**2)
    with pytest.raises(NotImplementedError, match="scoring_func 'softmax'"):
        DeepseekV3ForCausalLM(parse_hf_config({**HUB_V3, "num_hidden_layers": 1, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="no kv_lora_rank"):
        DeepseekV3ForCausalLM(parse_hf_config({k: v for k, v in HUB_V3.items() if k != "kv_lora_rank"}))


def test_engine_greedy_output_equals_transformers_generate(tmp_path: Path) -> None:
    model_dir = write_tiny_deepseek_model(tmp_path / "engine_deepseek", "deepseek_v3")
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


def test_mla_auto_picks_flash_mla_only_for_its_shapes_on_a_hopper_gpu(monkeypatch) -> None:
    from flotilla.kernels import attention
    from flotilla.kernels.mla import best_mla_backend, flash_mla_backend

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(attention, "triton_usable", lambda: True)
    monkeypatch.setattr(flash_mla_backend, "flash_mla_usable", lambda: True)
    assert best_mla_backend(cuda, 512, 64, bf16) == "flash_mla"  # DeepSeek-V3 / Kimi-K2's latent
    assert best_mla_backend(cuda, 512, 64, torch.float16) == "triton"
    assert best_mla_backend(cuda, 256, 64, bf16) == "triton"
    assert best_mla_backend(torch.device("cpu"), 512, 64, bf16) == "torch"
    monkeypatch.setattr(flash_mla_backend, "flash_mla_usable", lambda: False)  # not a Hopper, or no flash_mla
    assert best_mla_backend(cuda, 512, 64, bf16) == "triton"


def test_flash_mla_pages_64_tokens_and_an_auto_choice_gives_way_to_triton(model_dirs: dict[str, Path],
                                                                          monkeypatch) -> None:  # fmt: skip
    """settle_kv_layout, which the worker asks for the block size before allocating the cache: FlashMLA reads bf16
    pages of 64 tokens. Picked by "auto" (stood in for here: no Hopper GPU) it yields to triton, in every layer,
    for another block size or an FP8 cache; forced by name it refuses them."""
    pytest.importorskip("triton")
    from flotilla.kernels import mla

    config = load_hf_config(model_dirs["deepseek_v3"])
    assert DeepseekV3ForCausalLM(config).settle_kv_layout(None, "auto") == 16  # torch on CPU: the default size
    assert DeepseekV3ForCausalLM(config).settle_kv_layout(4, "fp8") == 4
    monkeypatch.setattr(mla, "available_mla_backends", lambda: ["auto", "torch", "triton", "flash_mla"])
    monkeypatch.setattr(mla, "best_mla_backend", lambda *args: "flash_mla")

    def attention_backends(model: DeepseekV3ForCausalLM) -> set[str]:
        return {layer.self_attn.backend.name for layer in model.model.layers}

    model = DeepseekV3ForCausalLM(config)
    assert (model.attention_backend_name, model.settle_kv_layout(None, "auto")) == ("mla_flash_mla", 64)
    assert model.settle_kv_layout(64, "auto") == 64 and attention_backends(model) == {"flash_mla"}
    for block_size, kv_dtype, want in ((16, "auto", 16), (None, "fp8", 16), (64, "fp8_e4m3", 64)):
        model = DeepseekV3ForCausalLM(config)
        assert model.settle_kv_layout(block_size, kv_dtype) == want
        assert model.attention_backend_name == "mla_triton" and attention_backends(model) == {"triton"}
    forced = DeepseekV3ForCausalLM(config, attention_backend="flash_mla")
    assert forced.settle_kv_layout(None, "auto") == 64
    with pytest.raises(ValueError, match="reads bfloat16 pages of 64 tokens, not block_size 16"):
        forced.settle_kv_layout(16, "auto")
    with pytest.raises(ValueError, match="not kv_cache_dtype fp8"):
        forced.settle_kv_layout(None, "fp8")
