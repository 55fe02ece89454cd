"""FP8 block-scaled checkpoints (Qwen's FP8 releases: e4m3 weights with a float32 `weight_scale_inv` per block) of
the models that keep no FP8 weights: the loader dequantizes each weight with its scales as it reads them, so the
model equals the one loaded from the dequantized float checkpoint and answers as transformers does on it."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny_models import (
    QWEN_FP8_QUANTIZED,
    check_greedy_matches_generate,
    load_hf_model,
    write_fp8_pair,
    write_tiny_model,
    write_tiny_moe_model,
    write_tiny_qwen35_model,
)
from safetensors.torch import load_file, save_file

from flotilla.models.loader import ModelLoadError, load_model

WRITERS = {"qwen3": lambda d: write_tiny_model(d, "qwen3"), "qwen3_moe": write_tiny_moe_model,
           "qwen3_5_moe": write_tiny_qwen35_model}


def _pair(tmp_path, name: str):
    return write_fp8_pair(WRITERS[name](tmp_path / "src"), tmp_path, block=(16, 16), quantized=QWEN_FP8_QUANTIZED)


@pytest.mark.parametrize("name", list(WRITERS))
def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, name, caplog):
    fp8, dequantized = _pair(tmp_path, name)
    scales = [k for k in load_file(str(fp8 / "model.safetensors")) if k.endswith("_scale_inv")]
    assert len(scales) >= 4, scales  # (attention and MLP or expert weights of every layer)
    with caplog.at_level("INFO", logger="flotilla.models.loader"):
        got = load_model(fp8, dtype="float32", progress=False).module.state_dict()
    assert any("FP8 block-scaled checkpoint: its weights are dequantized to float32" in r.getMessage()
               for r in caplog.records)
    want = load_model(dequantized, dtype="float32", progress=False).module.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_qwen3_5_from_fp8_gives_transformers_greedy_tokens_on_the_dequantized_weights(tmp_path):
    fp8, dequantized = _pair(tmp_path, "qwen3_5_moe")
    check_greedy_matches_generate(load_model(fp8, dtype="float32", progress=False).module, load_hf_model(dequantized),
                                  num_tokens=12)


def test_an_fp8_weight_without_its_scales_is_a_load_error_naming_it(tmp_path):
    fp8, _ = _pair(tmp_path, "qwen3")
    tensors = load_file(str(fp8 / "model.safetensors"))
    dropped = min(k for k in tensors if k.endswith("_scale_inv"))
    del tensors[dropped]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="FP8 weights without their block scales.*" + dropped.removesuffix(
            "_scale_inv").replace(".", r"\.")):
        load_model(fp8, dtype="float32", progress=False)


def test_dequantize_checkpoint_pairs_weights_and_scales_in_either_order_and_stacked_experts_per_expert():
    from flotilla.kernels.quant import block_dequantize, block_quantize
    from flotilla.kernels.quant.fp8_ref import dequantize_checkpoint

    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(40, 24, generator=gen)
    experts = torch.randn(3, 20, 24, generator=gen)  # [E, N, K], as transformers stacks them
    q, s = block_quantize(dense, (16, 16))
    pairs = [block_quantize(e, (16, 16)) for e in experts]
    eq, es = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    norm = torch.ones(24)
    stream = [("a.weight_scale_inv", s), ("n.weight", norm), ("a.weight", q), ("e.gate_up_proj", eq),
              ("e.gate_up_proj_scale_inv", es)]
    got = dict(dequantize_checkpoint(stream, (16, 16), torch.float32))
    assert got.keys() == {"a.weight", "n.weight", "e.gate_up_proj"} and got["n.weight"] is norm
    assert torch.equal(got["a.weight"], block_dequantize(q, s, (16, 16)))
    for i, (qi, si) in enumerate(pairs):
        assert torch.equal(got["e.gate_up_proj"][i], block_dequantize(qi, si, (16, 16)))
    assert (got["a.weight"] - dense).abs().max() < 0.1 * dense.abs().max()  # (e4m3's rounding, not garbage)
