"""Benchmarks' building blocks on CPU: dummy weights at any shape, token-id-only engines, bench_offline."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flotilla import LLM, SamplingParams
from flotilla.scripts.dev import bench_offline
from flotilla.scripts.dev import bench_workload as wl
from flotilla.server.engine_client import RequestFailed

from helpers_engine import set_max_positions, write_tiny_engine_model


def test_a_config_only_folder_runs_with_dummy_weights_and_no_tokenizer(tmp_path):
    src = write_tiny_engine_model(tmp_path / "src", "qwen3")
    only = tmp_path / "only-config"
    only.mkdir()
    (only / "config.json").write_text((src / "config.json").read_text())  # no weights, no tokenizer
    with LLM(str(only), load_format="dummy", skip_tokenizer_init=True, kv_cache_blocks=64, block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6 and out.text == "" and out.finish_reason == "length"
        with pytest.raises(RequestFailed, match="without a tokenizer"):
            llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=2), use_tqdm=False)
        model = llm.client.runtime.actors["worker/0"].runner.model
        values = [p.abs().max().item() for p in model.parameters()]
        assert 0 < max(values) <= 1e-3  # every parameter was filled, small


def test_the_nano_workload_is_the_peers_recipe():
    prompts, outputs = bench_offline.nano_workload(3, seed=0)
    again = bench_offline.nano_workload(3, seed=0)
    assert (prompts, outputs) == again
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= m <= 1024 for m in outputs)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_bench_offline_runs_at_toy_size_and_writes_json(tmp_path):
    model = write_tiny_engine_model(tmp_path / "tiny")
    out = tmp_path / "result.json"
    assert bench_offline.main(["--model", str(model), "--workload", "both", "--num-requests", "6", "--min-len", "4",
                               "--max-len", "20", "--vocab", "300", "--decode-in", "16", "--decode-out", "24",
                               "--kv-cache-blocks", "128", "--block-size", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the rates are the requests' own tokens over the time they took: every output at its full length (ignore_eos),
    # the nano workload's prompts and outputs as the generator makes them, nothing of the warm-up counted
    prompts, outputs = bench_offline.nano_workload(6, 4, 20, seed=0, vocab=300)
    assert result["nano_workload_seqs"] == 6 and result["nano_output_tokens"] == sum(outputs)
    assert result["nano_prompt_tokens"] == sum(map(len, prompts))
    seconds, rate = result["nano_workload_s"], result["nano_workload_out_tok_per_s"]  # rounded to 10 ms, 0.1 tok/s
    assert sum(outputs) / (seconds + 0.006) - 0.06 <= rate <= sum(outputs) / max(seconds - 0.006, 1e-3) + 0.06
    assert result["b1_decode_ms_per_token"] == pytest.approx(1000 / result["b1_decode_tok_per_s"], rel=0.01)
    assert result["device"] == "cpu"
    assert result["parallel"] == {"tp": 1, "dp": 1, "ep": 1} and result["cuda_graphs"] == "off"


def test_bench_offline_repeats_report_the_median_run_and_every_run(tmp_path):
    model = write_tiny_engine_model(tmp_path / "tiny")
    out = tmp_path / "result.json"
    assert bench_offline.main(["--model", str(model), "--workload", "decode1", "--decode-in", "8", "--decode-out",
                               "8", "--vocab", "300", "--repeat", "3", "--kv-cache-blocks", "64", "--block-size", "4",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["b1_decode_tok_per_s_runs"]
    assert len(runs) == 3 and result["b1_decode_tok_per_s"] == sorted(runs)[1]


def test_the_fixed_workload_under_expert_parallelism_reports_per_gpu_rates_and_imbalance(tmp_path):
    """--workload fixed (the wide-EP run's: equal prompts and outputs, the decode's own rate, per GPU) on a tiny
    MoE at DP2 x EP2 (gloo): two GPUs' worth of ranks, and the experts' and ranks' load imbalance (at least 1)."""
    from flotilla.scripts.dev.bench_shapes import shape_config
    from helpers_tiny_models import write_tiny_moe_model

    model = write_tiny_moe_model(tmp_path / "moe")
    out = tmp_path / "fixed.json"
    assert bench_offline.main(["--model", str(model), "--workload", "fixed", "--num-requests", "6", "--fixed-in", "20",
                               "--fixed-out", "16", "--vocab", "200", "--skip-tokenizer-init", "--dtype", "float32",
                               "--data-parallel-size", "2", "--enable-expert-parallel", "--kv-cache-blocks", "200",
                               "--placement", "process", "--json", str(out)]) == 0  # fmt: skip
    r = json.loads(out.read_text())
    assert (r["fixed_seqs"], r["fixed_in"], r["fixed_out"], r["gpus"]) == (6, 20, 16, 2)
    assert r["fixed_decode_tok_per_s_per_gpu"] == pytest.approx(r["fixed_decode_tok_per_s"] / 2, rel=0.01)
    assert 0 < r["fixed_prefill_s"] < r["fixed_s"]  # after a warm-up batch, one step against sixteen
    assert r["expert_imbalance_max"] >= r["expert_imbalance_mean"] >= 1
    assert r["rank_imbalance_max"] >= r["rank_imbalance_mean"] >= 1
    assert r["parallel"] == {"tp": 1, "dp": 2, "ep": 2, "all2all": "all_to_all"}
    # the wide-EP shapes: DeepSeek-V3's layers, any number of them
    assert shape_config("deepseek-v3-16l")["num_hidden_layers"] == 16
    assert shape_config("deepseek-v3-16l-mtp")["num_nextn_predict_layers"] == 1
    assert shape_config("deepseek-v3-1l") is None and shape_config("deepseek-v3-x") is None


def test_the_qwen3_5_shape_keeps_its_first_n_layers():
    """qwen3.5-35b-a3b-<N>l[-mtp]: the checkpoint's config with N text layers (and an MTP layer), which fits one GPU
    beside its KV cache and delta-net state while each layer keeps its real size."""
    from flotilla.scripts.dev.bench_shapes import shape_config

    text = shape_config("qwen3.5-35b-a3b-20l-mtp")["text_config"]
    assert (text["num_hidden_layers"], text["mtp_num_hidden_layers"], text["num_experts"]) == (20, 1, 256)
    assert text["mamba_ssm_dtype"] == "float32"  # (as released: vLLM's delta-net state is then float32 like ours)
    assert shape_config("qwen3.5-35b-a3b-8l")["text_config"]["mtp_num_hidden_layers"] == 0
    assert shape_config("qwen3.5-35b-a3b-0l") is None
    assert shape_config("qwen3.5-35b-a3b")["text_config"]["num_hidden_layers"] == 40


def test_the_long_context_workloads_are_long_ctx_pys():
    """long_ctx.py's generators call for call (its toks(): n // DIV ids, at least 1, in [0, 100000]), so flotilla's
    figures compare with what that script measures for vLLM; at divisor 100 the prompts are its LONG_TINY ones."""
    def toks(rng: random.Random, n: int, div: int) -> list[int]:
        return [rng.randint(0, 100000) for _ in range(max(1, n // div))]

    rng = random.Random(1)
    assert wl.long16_workload(100) == wl.Workload([toks(rng, 32000, 100) for _ in range(16)], [2] * 16)
    assert wl.long16_workload().output_lens == [256] * 16 and len(wl.long16_workload(8).prompts[0]) == 4000
    rng = random.Random(2)
    assert wl.long1_workload(100).prompts == [toks(rng, 32000, 100) for _ in range(3)]
    assert wl.long1_workload().output_lens == [1, 1, 257] and wl.long1_workload(100).output_lens == [1, 1, 3]
    rng = random.Random(3)
    prompts = [toks(rng, 16000, 1) for _ in range(32)] + [toks(rng, 200, 1) for _ in range(256)]
    outs = [128] * 32 + [256] * 256
    order = list(range(len(prompts)))
    random.Random(4).shuffle(order)
    assert wl.long_mixed_workload() == wl.Workload([prompts[i] for i in order], [outs[i] for i in order])
    rng = random.Random(5)
    prefix = toks(rng, 6000, 10)
    warm, w = wl.prefix_workload(10)
    assert warm == prefix + toks(rng, 10, 10)
    assert w == wl.Workload([prefix + toks(rng, 100, 10) for _ in range(128)], [6] * 128)
    assert max(max(p) for p in wl.long16_workload(1000, top_id=299).prompts) <= 299
    rng = random.Random(5)
    assert wl.long128_workload(100) == wl.Workload([toks(rng, 128000, 100) for _ in range(3)], [1, 1, 3])
    assert wl.long128_workload().output_lens == [1, 1, 257]


def test_the_long_context_workloads_run_at_toy_size(tmp_path):
    """--workload long: long16, long1 and mixed on an engine without prefix caching, prefix on one with it (its
    requests find the shared prefix's full blocks cached), lengths divided by 100."""
    model = set_max_positions(write_tiny_engine_model(tmp_path / "tiny"), 1024)  # 320-token prompts
    out = tmp_path / "long.json"
    assert bench_offline.main(["--model", str(model), "--workload", "long", "--length-divisor", "100", "--vocab", "300",
                               "--kv-cache-blocks", "2048", "--block-size", "16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for name, w in (("long16", wl.long16_workload(100, 300)), ("mixed", wl.long_mixed_workload(100, 300)),
                    ("prefix", wl.prefix_workload(100, 300)[1])):
        seconds, rate = r[f"{name}_s"], r[f"{name}_out_tok_per_s"]  # rounded to 10 ms, 0.1 tok/s
        assert w.output_tokens / (seconds + 0.006) - 0.06 <= rate <= w.output_tokens / max(seconds - 0.006, 1e-3) + 0.06
        ratio = (w.input_tokens + w.output_tokens) / w.output_tokens  # total against output tokens
        assert r[f"{name}_total_tok_per_s"] == pytest.approx(rate * ratio, rel=0.01, abs=0.06 * ratio + 0.06)
    assert r["long1_prompt_tokens"] == 320 and r["long1_prefill_s"] > 0
    assert isinstance(r["long1_decode_ms_per_token"], float)
    assert r["prefix_cached_tokens"] == 128 * 48  # the 60-token prefix's three full blocks of 16, every request
    assert (r["length_divisor"], r["max_model_len"]) == (100, 1024)
    assert r["device"] == "cpu" and r["kv_tokens"] == 2048 * 16


def test_long_context_engines_on_a_shape_get_long_ctx_pys_settings():
    """On a built-in shape the long-context workloads get long_ctx.py's max_model_len 40,960 (the others the peer's
    4,096); prefix runs on an engine of its own with prefix caching, the others without."""
    assert bench_offline.engine_groups("long") == [("long16", "long1", "mixed"), ("prefix",)]
    assert bench_offline.engine_groups("both") == [("nano", "decode1")]
    assert bench_offline.engine_groups("prefix") == [("prefix",)]
    args = bench_offline.build_parser().parse_args(["--model", "qwen3-8b", "--workload", "long"])
    config = bench_offline.engine_config(args, ("long16", "long1", "mixed"))
    assert config.model.max_model_len == 40960 and not config.cache.enable_prefix_caching
    assert config.model.load_format == "dummy" and config.model.dtype == "bfloat16"
    assert bench_offline.engine_config(args, ("prefix",)).cache.enable_prefix_caching
    nano = bench_offline.build_parser().parse_args(["--model", "qwen3-8b"])
    assert bench_offline.engine_config(nano, ("nano",)).model.max_model_len == 4096
    folder = bench_offline.build_parser().parse_args(["--model", "/some/folder", "--enable-prefix-caching"])
    assert not bench_offline.engine_config(folder, ("long16",)).cache.enable_prefix_caching


def test_the_128k_prompt_runs_on_the_yarn_shape_at_its_full_length_and_at_toy_size(tmp_path):
    """long128 gets max_model_len 131,072 on a shape, which qwen3-8b-yarn's YaRN x 4 allows and plain qwen3-8b's
    40,960 positions refuse; at toy size (lengths / 100) it reports the 1,280-token prompt's prefill and decode."""
    from flotilla.models.context_length import load_max_model_len
    from flotilla.scripts.dev.bench_shapes import shape_dir

    args = bench_offline.build_parser().parse_args(["--model", "qwen3-8b-yarn", "--workload", "long128"])
    config = bench_offline.engine_config(args, ("long128",))
    assert config.model.max_model_len == 131072 and not config.cache.enable_prefix_caching
    assert load_max_model_len(131072, shape_dir("qwen3-8b-yarn")) == 131072
    with pytest.raises(ValueError, match="131072"):
        load_max_model_len(131072, shape_dir("qwen3-8b"))
    model = set_max_positions(write_tiny_engine_model(tmp_path / "tiny"), 2048)
    out = tmp_path / "long128.json"
    assert bench_offline.main(["--model", str(model), "--workload", "long128", "--length-divisor", "100", "--vocab",
                               "300", "--kv-cache-blocks", "256", "--block-size", "16", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["long128_prompt_tokens"] == 1280 and r["long128_prefill_s"] > 0
    assert isinstance(r["long128_decode_ms_per_token"], float) and r["length_divisor"] == 100
    assert (r["max_num_seqs"], r["max_num_batched_tokens"]) == (256, 8192)  # (the engine's, on CPU)


def test_the_images_workload_runs_at_toy_size_on_a_model_that_takes_images(tmp_path):
    """Each request one random image of its own and random text; every output full length; the shape of
    Qwen3-VL-30B-A3B parses as that model (its tower, M-RoPE, the processor's settings beside it)."""
    from helpers_vl import write_tiny_qwen3_vl_model

    from flotilla.models.hf_config import load_hf_config
    from flotilla.scripts.dev.bench_shapes import shape_dir

    folder = write_tiny_qwen3_vl_model(tmp_path / "vl", moe=False)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"longest_edge": 64 * 64, "shortest_edge": 32 * 32}}))
    out = tmp_path / "images.json"
    assert bench_offline.main(["--model", str(folder), "--workload", "images", "--image-requests", "3", "--image-size", "64",
                    "--image-text", "5", "--image-out", "4", "--vocab", "250", "--kv-cache-blocks", "64",
                    "--block-size", "4", "--skip-tokenizer-init", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["images_requests"] == 3 and result["images_prompt_tokens"] == 3 * (2 + 5 + 4)  # (4 image tokens)
    assert result["images_out_tok_per_s"] > 0 and result["image_encoder"] == "step"
    shape = load_hf_config(shape_dir("qwen3-vl-30b-a3b"))
    assert shape.vision.depth == 27 and shape.moe.num_experts == 128 and shape.mrope_interleaved
    assert (shape_dir("qwen3-vl-30b-a3b") / "preprocessor_config.json").is_file()


def test_the_structured_workload_runs_at_toy_size_with_a_byte_level_placeholder_tokenizer(tmp_path):
    """Every other request under the JSON schema, every output its full length (the schema cannot complete in it),
    both runs timed; the placeholder tokenizer is byte-level, so xgrammar's masks spell JSON from its bytes."""
    import transformers
    import xgrammar as xgr

    from flotilla.scripts.dev.bench_shapes import write_byte_level_placeholder_tokenizer

    model = write_tiny_engine_model(tmp_path / "tiny")
    write_byte_level_placeholder_tokenizer(model, first_special=300)  # (256 bytes + 44 pieces, then the specials)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert len(tok) == 314 and tok.convert_tokens_to_ids("<|im_end|>") == 302 and tok.decode([123, 34]) == '{"'
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=320)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    out = tmp_path / "structured.json"
    assert bench_offline.main(["--model", str(model), "--workload", "structured", "--structured-requests", "3",
                               "--structured-in", "6", "--structured-out", "20", "--vocab", "250",
                               "--kv-cache-blocks", "128", "--block-size", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["structured_requests"] == 3 and result["structured_constrained"] == 2
    assert result["structured_plain_s"] > 0 and result["structured_masked_s"] > 0
    want = (result["structured_masked_s"] - result["structured_plain_s"]) / 20 * 1000
    assert result["structured_mask_ms_per_step"] == pytest.approx(want, abs=0.01)


def test_the_deepseek_v4_shape_parses_as_the_model_builds_it():
    from flotilla.models.hf_config import load_hf_config
    from flotilla.scripts.dev.bench_shapes import shape_dir

    c = load_hf_config(shape_dir("deepseek-v4-flash-4l"))
    v4 = c.deepseek_v4
    assert c.head_dim == 512 and v4.rope_dim == 64 and [v4.rate(i) for i in range(4)] == [0, 4, 128, 4]
    assert v4.compress_rope_scaling["rope_type"] == "yarn" and c.moe.num_experts == 256 and c.sliding_window == 128


def test_the_sparse_attention_shapes_parse_as_the_models_build_them():
    from flotilla.models.hf_config import load_hf_config
    from flotilla.scripts.dev.bench_shapes import shape_dir

    v32, glm = load_hf_config(shape_dir("deepseek-v32-4l")), load_hf_config(shape_dir("glm5-4l"))
    assert (v32.dsa.index_topk, v32.dsa.index_n_heads, v32.dsa.rope_interleave) == (2048, 64, False)
    assert (glm.dsa.index_topk, glm.dsa.index_n_heads, glm.dsa.rope_interleave) == (2048, 32, True)
    assert glm.mla.qk_nope_head_dim == 192 and glm.mla.v_head_dim == 256 and not any(glm.dsa.shared)
    assert v32.quantization is not None and glm.quantization is not None and glm.moe.num_experts == 256


def test_the_images_workload_is_one_seeded_generator_and_vllm_gets_a_tokenizer_of_qwens_ids(tmp_path):
    """Both engines (bench_offline --engine) draw the same requests; the placeholder tokenizer that vLLM's Qwen3-VL
    processor needs puts Qwen's special tokens at the ids the shape's config names."""
    import transformers

    from flotilla.scripts.dev import bench_workload as wl
    from flotilla.scripts.dev.bench_shapes import shape_config, write_qwen_placeholder_tokenizer

    a, b = (wl.image_workload(3, 32, 5, 250, 7, 8, 9, seed=3) for _ in range(2))
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b] and all(
        (x.pixels == y.pixels).all() for x, y in zip(a, b, strict=True))
    assert a[0].prompt_token_ids[:3] == [7, 8, 9] and len(a[0].prompt_token_ids) == 8 and a[0].pixels.shape == (32, 32, 3)
    assert a[0].prompt_token_ids != a[1].prompt_token_ids
    write_qwen_placeholder_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    config = shape_config("qwen3-vl-30b-a3b")
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ids == [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    assert len(tok) <= config["text_config"]["vocab_size"] and tok.decode([5, ids[1]]) == "t5 <|image_pad|>"


def test_the_vllm_engine_runs_the_same_workload_code_with_vllms_own_objects(tmp_path, monkeypatch):
    """--engine vllm: vLLM's LLM built from the same engine config (a stand-in module records what it is given),
    flotilla's SamplingParams turned into vLLM's, the nano and images workloads run through the very same code, and
    a model that takes images gets a folder with a tokenizer beside its config."""
    import sys
    import types

    made: list[dict] = []

    class FakeLLM:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def generate(self, prompts, params, use_tqdm=False):
            params = params if isinstance(params, list) else [params] * len(prompts)
            assert all(isinstance(p, FakeParams) for p in params)
            return [types.SimpleNamespace(
                outputs=[types.SimpleNamespace(token_ids=[0] * p.kwargs["max_tokens"])], num_cached_tokens=0,
                prompt_token_ids=list(r["prompt_token_ids"]) + ([9] * 4 if "multi_modal_data" in r else []))
                for r, p in zip(prompts, params, strict=True)]

    class FakeParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeParams,
                                                                   __version__="0.26.0"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(StructuredOutputsParams=dict))
    out = tmp_path / "v.json"
    assert bench_offline.main(["--engine", "vllm", "--model", "qwen3-8b", "--workload", "nano", "--num-requests", "3",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["engine"] == "vllm 0.26.0" and result["nano_workload_seqs"] == 3
    assert made[0]["load_format"] == "dummy" and made[0]["dtype"] == "bfloat16" and made[0]["max_model_len"] == 4096
    assert made[0]["skip_tokenizer_init"] and not made[0]["enable_prefix_caching"]
    assert bench_offline.main(["--engine", "vllm", "--model", "qwen3-vl-30b-a3b", "--workload", "images",
                               "--image-requests", "2", "--image-size", "32", "--image-text", "5",
                               "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["images_requests"] == 2 and result["images_prompt_tokens"] == 2 * (3 + 5 + 4)
    folder = Path(made[1]["model"])
    assert made[1]["limit_mm_per_prompt"] == {"image": 1} and not made[1]["skip_tokenizer_init"]
    assert (folder / "tokenizer.json").is_file() and (folder / "preprocessor_config.json").is_file()
    # the structured workload: a shape's folder with the byte-level tokenizer; the schema as vLLM's own params
    seen: list = []
    real_generate = FakeLLM.generate
    monkeypatch.setattr(FakeLLM, "generate", lambda self, prompts, params, use_tqdm=False: (
        seen.extend(params if isinstance(params, list) else [params]), real_generate(self, prompts, params))[1])
    assert bench_offline.main(["--engine", "vllm", "--model", "qwen3-8b", "--workload", "structured",
                               "--structured-requests", "4", "--structured-out", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["structured_constrained"] == 2
    assert not made[2]["skip_tokenizer_init"] and (Path(made[2]["model"]) / "tokenizer.json").is_file()
    schemas = [p.kwargs["structured_outputs"]["json"] for p in seen if "structured_outputs" in p.kwargs]
    assert len(schemas) == 4 and schemas[0] == bench_offline.STRUCTURED_SCHEMA  # (warm-up and timed run: 2 each)
    # a model that takes images, on text workloads: its language model alone (flotilla builds no vision tower for it)
    assert bench_offline.main(["--engine", "vllm", "--model", "qwen3.5-35b-a3b-2l", "--workload", "decode1",
                               "--decode-out", "4", "--vllm-options", '{"gdn_prefill_backend": "triton"}',
                               "--json", str(out)]) == 0
    assert made[3]["language_model_only"] and "limit_mm_per_prompt" not in made[3] and made[3]["skip_tokenizer_init"]
    assert made[3]["gdn_prefill_backend"] == "triton"  # --vllm-options, recorded with the result
    assert json.loads(out.read_text())["vllm_options"] == {"gdn_prefill_backend": "triton"}
    # asked for images, the placeholder tokenizer puts Qwen's special tokens at the ids its config names
    bench_offline.VllmEngine(bench_offline.engine_config(bench_offline.build_parser().parse_args(
        ["--engine", "vllm", "--model", "qwen3.5-35b-a3b-2l"]), ("images",)), images=True)
    vocab = json.loads((Path(made[4]["model"]) / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"]: t["id"] for t in vocab}["<|image_pad|>"] == 248056


def test_an_output_short_of_max_tokens_fails_the_run_with_how_it_ended():
    """ignore_eos runs must give every output its max_tokens; one that does not fails the run with its finish reason
    (a grammar that ended it, an error), not just the count."""
    from types import SimpleNamespace

    class Short:
        def generate(self, prompts, params, use_tqdm=False):
            out = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * p.max_tokens, finish_reason="length")],
                                   num_cached_tokens=0) for p in params]
            out[1].outputs[0] = SimpleNamespace(token_ids=[1, 2], finish_reason="stop")
            return out

    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 3
    with pytest.raises(AssertionError, match=r"the short ones ended with \{'stop': 1\}"):
        bench_offline.timed_generate(Short(), [[1], [2], [3]], params)
