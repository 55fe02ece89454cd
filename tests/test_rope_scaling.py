"""Qwen3 past its native window: YaRN rope scaling against transformers (both config spellings), the engine running
past max_position_embeddings, and max_model_len derived, allowed and refused as vLLM does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers_tiny_models import (
    _COMMON,
    ATOL,
    TINY_CONFIGS,
    PagedRunner,
    hf_logits,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
)

from flotilla import LLM, SamplingParams
from flotilla.models.context_length import derived_max_model_len, resolve_max_model_len
from flotilla.models.hf_config import load_hf_config
from flotilla.scripts.dev.bench_shapes import SHAPES, shape_config

from helpers_engine import write_tiny_tokenizer

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
"""Qwen3's published YaRN settings (factor 4 over a 32,768-token window), at a tiny window of 32."""
SPELLINGS: dict[str, dict] = {
    "rope_parameters": {"rope_parameters": {**YARN, "rope_theta": 10000.0}},  # transformers 5
    "rope_scaling": {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 32}},
    # no window given: transformers (and vLLM after it) take max_position_embeddings
    "no_original_window": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
}
"""config.json's rope keys -> the longest sequence they allow."""
DERIVED = {"rope_parameters": 128, "rope_scaling": 128, "no_original_window": 160}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with 40 native positions (as Qwen3's 40,960 over YaRN's 32,768), saved by transformers."""
    config = transformers.Qwen3Config(**{**_COMMON, **TINY_CONFIGS["qwen3"][2], "max_position_embeddings": 40,
                                         "rope_parameters": {**YARN, "rope_theta": 10000.0}})
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("qwen3_yarn")
    transformers.Qwen3ForCausalLM(config).float().eval().save_pretrained(path, safe_serialization=True)
    return path


def with_rope(checkpoint: Path, folder: Path, spelling: str) -> Path:
    """The checkpoint with config.json's rope keys spelled one of SPELLINGS' ways."""
    folder.mkdir()
    shutil.copy(checkpoint / "model.safetensors", folder)
    config = json.loads((checkpoint / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    (folder / "config.json").write_text(json.dumps({**config, **SPELLINGS[spelling]}))
    return folder


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_yarn_logits_equal_transformers_past_the_native_window(spelling: str, checkpoint: Path,
                                                               tmp_path: Path) -> None:
    folder = with_rope(checkpoint, tmp_path / spelling, spelling)
    config = load_hf_config(folder)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_positions == DERIVED[spelling]
    model, hf = load_flotilla_model(folder), load_hf_model(folder)  # transformers reads the same config.json
    tokens = random_tokens(100, seed=7)  # past the 40 native positions and the 32 of the original window
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    prefill = runner.step([(0, tokens[:90])])[0]
    decode = [runner.step([(0, [t])])[0][0] for t in tokens[90:]]
    torch.testing.assert_close(torch.cat([prefill, torch.stack(decode)]), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_the_engine_runs_past_max_position_embeddings_as_far_as_yarn_allows(checkpoint: Path, tmp_path: Path) -> None:
    """max_model_len defaults to the YaRN window x factor (128 here, 131,072 for Qwen3), greedy tokens there are
    transformers'; one token longer is refused before anything starts, as vLLM refuses it."""
    folder = with_rope(checkpoint, tmp_path / "engine", "rope_scaling")
    write_tiny_tokenizer(folder, vocab_size=320)  # (its model_max_length 256 caps at max_position_embeddings first)
    prompt = random_tokens(100, seed=11)
    with LLM(str(folder), kv_cache_blocks=64, block_size=4) as llm:
        assert llm.client.ready_detail["tokenizer/0"]["max_model_len"] == "128"
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)  # fmt: skip
    with torch.inference_mode():
        want = load_hf_model(folder).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 100).long(),
                                              max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 100:]
    assert out[0].outputs[0].token_ids == want.tolist()
    with pytest.raises(ValueError, match=r"max_model_len 129 is longer than engine allows: 128 "
                                         r"\(original_max_position_embeddings 32 x factor 4 \(yarn rope scaling\)\)"):
        LLM(str(folder), max_model_len=129, kv_cache_blocks=64, block_size=4)


QWEN3_8B = SHAPES["qwen3-8b"]


@pytest.mark.parametrize("overrides, tokenizer_max, want", [
    ({}, None, 40960),  # max_position_embeddings
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, None, 131072),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                          "rope_theta": 1e6}}, 131072, 131072),  # YaRN replaces the tokenizer's cap too
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, 163840),  # the window: max_position_embeddings
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, None, 81920),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, 81920),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1,
      "high_freq_factor": 4, "original_max_position_embeddings": 8192}}, None, 131072),  # already scaled
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, None, 40960),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, None, 40960),
    ({}, 8192, 8192),  # the tokenizer's model_max_length caps
    ({}, 1e30, 40960),  # (a tokenizer's "no limit")
    ({"model_max_length": 65536}, None, 65536),  # config.json's own model_max_length wins
    ({"max_position_embeddings": None, "seq_length": 4096, "n_positions": 2048}, None, 2048),  # the smallest key
])
def test_the_max_length_is_derived_as_vllm_derives_it(overrides: dict, tokenizer_max: float | None, want: int) -> None:
    assert derived_max_model_len({**QWEN3_8B, **overrides}, tokenizer_max)[0] == want


def test_a_longer_max_model_len_than_derived_is_refused_and_a_shorter_one_kept() -> None:
    yarn = shape_config("qwen3-8b-yarn")  # the benchmarks' shape for one 128K-token request
    assert resolve_max_model_len(None, yarn) == 131072 and resolve_max_model_len(131072, yarn) == 131072
    assert resolve_max_model_len(4096, QWEN3_8B) == 4096 and resolve_max_model_len(40960, QWEN3_8B) == 40960
    with pytest.raises(ValueError, match=r"max_model_len 131073 is longer than Qwen3-8B allows: 131072"):
        resolve_max_model_len(131073, yarn, name="Qwen3-8B")
    with pytest.raises(ValueError, match=r"max_model_len 40961 .* 40960 \(max_position_embeddings\)"):
        resolve_max_model_len(40961, QWEN3_8B)
    with pytest.raises(ValueError, match=r"8192 \(tokenizer_config.json's model_max_length\)"):
        resolve_max_model_len(8193, QWEN3_8B, tokenizer_max_length=8192)
    # config.json's model_max_length lets a user past the derived length (vLLM's exception), no further
    assert resolve_max_model_len(40000, {**QWEN3_8B, "model_max_length": 65536}, tokenizer_max_length=8192) == 40000
    # a config that gives no length at all: 2048 by default, but what the user asks for is taken
    no_len = {k: v for k, v in QWEN3_8B.items() if k != "max_position_embeddings"}
    assert resolve_max_model_len(None, no_len) == 2048 and resolve_max_model_len(8192, no_len) == 8192
