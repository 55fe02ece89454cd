"""DeepSeek-V3's fused latent projection (DeepseekV3Attention.fused_qkv_a_proj: q_a_proj and kv_a_proj_with_mqa as
one GEMM of rows [q_a | kv_a]): built wherever the FP8 weight blocks allow it and two layers elsewhere; its logits
equal the two-layer model's bit for bit (float32, bfloat16, FP8) and transformers' (attention biases included); the
checkpoint's two tensors (weights, block scales, biases) load into its parts, in the MTP layer too, and errors name
the checkpoint tensor. Under tensor parallelism (replicated on every rank): tests/test_deepseek_tp.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers_spec import add_mtp_layer
from helpers_tiny_models import (
    TINY_DEEPSEEK_CONFIGS,
    PagedRunner,
    check_prefill_then_paged_decode,
    load_hf_model,
    random_tokens,
    write_tiny_deepseek_fp8_pair,
    write_tiny_deepseek_model,
)
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import HUB_V3

from flotilla.kernels.quant import FP8_DTYPE
from flotilla.kernels.quant.fp8_linear import Fp8BlockLinear
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
from flotilla.models.deepseek_v3_mla import deinterleaved_rope_rows
from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.linears import Linears
from flotilla.models.llama import Linear
from flotilla.models.loader import load_model
from flotilla.models.parallel import ColumnParallelLinear, Fp8ColumnParallelLinear

ATTN = "model.layers.0.self_attn"
Q64 = {**TINY_DEEPSEEK_CONFIGS["deepseek_v3"], "q_lora_rank": 64, "attention_bias": True}
"""The tiny DeepSeek-V3 with q_lora_rank 64 (two whole blocks of the FP8 pair's 32 rows, so FP8 fuses; kv_a's
32 + 16 rows then end the fused tensor on half a block, as DeepSeek-V3's 576 do on 128) and attention biases."""


def _randomize_biases(folders: tuple[Path, ...], seed: int = 3) -> None:
    """transformers initializes biases to zero, which would hide a misplaced one: the same random biases into
    each checkpoint folder."""
    gen = torch.Generator().manual_seed(seed)
    files = [load_file(str(d / "model.safetensors")) for d in folders]
    for name in sorted(files[0]):
        if name.endswith(".bias"):
            bias = 0.1 * torch.randn(files[0][name].shape, generator=gen)
            for f in files:
                f[name] = bias
    for d, f in zip(folders, files, strict=True):
        save_file(f, str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """float: the tiny model (q_lora_rank 48, float weights: fused); fp8_48: its FP8 checkpoint in 32x32 blocks
    (48 rows are 1.5 blocks: two layers); fp8 / dequantized: Q64's FP8 checkpoint (fused) and the same weights
    dequantized to float32."""
    root = tmp_path_factory.mktemp("fused_latent")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TINY_DEEPSEEK_CONFIGS, "deepseek_v3_q64", Q64)
        fp8, dequantized = write_tiny_deepseek_fp8_pair(root / "q64", "deepseek_v3_q64")
    _randomize_biases((fp8, dequantized))
    return {"float": write_tiny_deepseek_model(root / "float"), "fp8_48": write_tiny_deepseek_fp8_pair(root / "q48")[0],
            "fp8": fp8, "dequantized": dequantized}


def _load(model_dir: Path, fused: bool = True, dtype: str = "float32", **kwargs: object) -> torch.nn.Module:
    """The model of a checkpoint folder, every parameter loaded (load_model checks); fused=False builds the two
    separate latent projections even where they could fuse (the unfused path)."""
    with pytest.MonkeyPatch.context() as mp:
        if not fused:
            mp.setattr(Linears, "can_fuse", lambda self, part_sizes: False)
        return load_model(model_dir, dtype=dtype, progress=False,
                          model_kwargs={"attention_backend": "torch", **kwargs}).module  # fmt: skip


def _stacked(weights: dict[str, torch.Tensor], prefix: str, suffix: str, model: torch.nn.Module) -> torch.Tensor:
    """What fused_qkv_a_proj's `suffix` holds after load: the checkpoint's q_a rows, then its kv_a rows with k_pe's
    rotary rows in halves (deinterleaved_rope_rows; not the block scales, which the reordering leaves as they are)."""
    mla = model.mla
    kv_a = weights[f"{prefix}.kv_a_proj_with_mqa.{suffix}"]
    if suffix != "weight_scale_inv" and mla.rope_interleave:
        kv_a = deinterleaved_rope_rows(kv_a, "kv_a_proj_with_mqa", mla.qk_nope_head_dim, mla.qk_rope_head_dim)
    return torch.cat([weights[f"{prefix}.q_a_proj.{suffix}"], kv_a]).float()


def test_fused_where_the_fp8_blocks_allow_and_two_layers_elsewhere(dirs: dict[str, Path], tmp_path: Path) -> None:
    attn = _load(dirs["float"]).model.layers[0].self_attn
    assert attn.q_a_proj is None and attn.kv_a_proj_with_mqa is None
    assert type(attn.fused_qkv_a_proj) is ColumnParallelLinear and attn.fused_qkv_a_proj.parts == {
        "q_a": (48, 48, 0), "kv_a": (48, 48, 0)}  # fmt: skip
    unfusable = _load(dirs["fp8_48"]).model.layers[0].self_attn  # 48 rows: 1.5 blocks of 32
    assert unfusable.fused_qkv_a_proj is None
    assert type(unfusable.q_a_proj) is type(unfusable.kv_a_proj_with_mqa) is Fp8BlockLinear
    model = _load(dirs["fp8"])
    weights = load_file(str(dirs["fp8"] / "model.safetensors"))
    for layer in model.model.layers:
        fused = layer.self_attn.fused_qkv_a_proj
        assert isinstance(fused, Fp8ColumnParallelLinear) and fused.weight.dtype == FP8_DTYPE
        assert tuple(fused.weight.shape) == (64 + 48, 64) and tuple(fused.weight_scale_inv.shape) == (4, 2)
    fused = model.model.layers[0].self_attn.fused_qkv_a_proj
    for suffix in ("weight", "weight_scale_inv", "bias"):  # the checkpoint's q_a rows, then its kv_a rows
        assert torch.equal(getattr(fused, suffix).float(), _stacked(weights, ATTN, suffix, model)), suffix
    no_q_lora = write_tiny_deepseek_model(tmp_path, "deepseek_v3_no_q_lora")
    attn = _load(no_q_lora).model.layers[0].self_attn  # one q_proj: kv_a alone
    assert attn.fused_qkv_a_proj is None and attn.q_a_proj is None and type(attn.kv_a_proj_with_mqa) is Linear
    # DeepSeek-V3's shapes and FP8 blocks: q_lora_rank 1536 is 12 blocks of 128, the 576 kv_a rows 4.5 more
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    for config in ({**HUB_V3, "num_hidden_layers": 4, "quantization_config": quant},
                   {**HUB_V3, "num_hidden_layers": 4, "q_lora_rank": 1472, "quantization_config": quant}):
        with torch.device("meta"):
            attn = DeepseekV3ForCausalLM(parse_hf_config(config)).model.layers[0].self_attn
        if config["q_lora_rank"] == 1536:
            assert tuple(attn.fused_qkv_a_proj.weight.shape) == (1536 + 576, 7168)
            assert tuple(attn.fused_qkv_a_proj.weight_scale_inv.shape) == (17, 56)
        else:  # 11.5 blocks: a block would hold rows of both parts
            assert attn.fused_qkv_a_proj is None and tuple(attn.q_a_proj.weight.shape) == (1472, 7168)


@pytest.mark.parametrize(("folder", "dtype"), [("float", "float32"), ("float", "bfloat16"), ("fp8", "float32"),
                                               ("fp8", "bfloat16")])  # fmt: skip
def test_fused_logits_equal_the_two_layers_bit_for_bit(dirs: dict[str, Path], folder: str, dtype: str) -> None:
    """The same weights in one GEMM: each output column is the same dot product, so prefill, a mixed step and
    paged decodes give exactly the two-layer model's logits."""
    fused, separate = _load(dirs[folder], dtype=dtype), _load(dirs[folder], fused=False, dtype=dtype)
    assert fused.model.layers[0].self_attn.fused_qkv_a_proj is not None
    assert separate.model.layers[0].self_attn.fused_qkv_a_proj is None
    steps = [[(0, random_tokens(11, seed=1))], [(1, random_tokens(6, seed=2)), (0, [7])], [(0, [9]), (1, [12])]]
    got_runner, want_runner = PagedRunner(fused), PagedRunner(separate)
    for batch in steps:
        for got, want in zip(got_runner.step(batch), want_runner.step(batch), strict=True):
            assert torch.isfinite(want).all()
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fused_fp8_model_with_attention_biases_matches_transformers(dirs: dict[str, Path]) -> None:
    """Q64's FP8 checkpoint (fused, biases through both parts) against transformers on its dequantized weights."""
    model = _load(dirs["fp8"])
    assert model.model.layers[0].self_attn.fused_qkv_a_proj.bias is not None
    check_prefill_then_paged_decode(model, load_hf_model(dirs["dequantized"]))


def _fp8_mtp_checkpoint(fp8_dir: Path, out: Path) -> Path:
    """fp8_dir with an MTP layer (DeepSeek-V3's names at layer num_hidden_layers): layer 1's FP8 tensors with its
    q_a / kv_a rows scaled by two (so they differ from layer 1's), and the MTP layer's own small tensors."""
    float_out = add_mtp_layer(write_tiny_deepseek_model(out / "float"))  # enorm, hnorm, eh_proj, shared_head
    config = json.loads((fp8_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = load_file(str(fp8_dir / "model.safetensors"))
    mtp = {k: v for k, v in load_file(str(float_out / "model.safetensors")).items()
           if k.startswith(f"model.layers.{n}.") and ".self_attn." not in k and ".mlp." not in k
           and "layernorm" not in k}  # fmt: skip
    for name, t in weights.items():
        if name.startswith("model.layers.1."):
            scaled = re.search(r"\.(q_a_proj|kv_a_proj_with_mqa)\.(weight_scale_inv|bias)$", name)
            mtp[name.replace("model.layers.1.", f"model.layers.{n}.")] = t * 2 if scaled else t.clone()
    (out / "fp8").mkdir()
    save_file({**weights, **mtp}, str(out / "fp8" / "model.safetensors"))
    (out / "fp8" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out / "fp8"


def test_mtp_layer_loads_its_fused_projection_and_errors_name_the_checkpoint_tensor(dirs: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    folder = _fp8_mtp_checkpoint(dirs["fp8"], tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    model = _load(folder, mtp=True)  # load_model: every parameter loaded, the MTP layer's included
    fused = model.model.mtp_layers[0].self_attn.fused_qkv_a_proj
    assert isinstance(fused, Fp8ColumnParallelLinear)
    for suffix in ("weight", "weight_scale_inv", "bias"):
        want = _stacked(weights, "model.layers.3.self_attn", suffix, model)
        assert torch.equal(getattr(fused, suffix).float(), want), suffix
    assert not torch.equal(fused.weight_scale_inv, model.model.layers[1].self_attn.fused_qkv_a_proj.weight_scale_inv)

    config = load_hf_config(folder)
    fresh = DeepseekV3ForCausalLM(config)
    one_part = [(f"{ATTN}.q_a_proj.{s}", weights[f"{ATTN}.q_a_proj.{s}"]) for s in ("weight", "weight_scale_inv")]
    assert f"{ATTN}.fused_qkv_a_proj.weight" not in fresh.load_weights(one_part)  # loaded once both parts came
    name = f"{ATTN}.kv_a_proj_with_mqa.weight"
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {name!r} has shape (40, 64) but parameter "
                                                   f"'{ATTN}.fused_qkv_a_proj.weight' expects (48, 64)")):  # fmt: skip
        DeepseekV3ForCausalLM(config).load_weights([(name, weights[name][:40]),
                                                    (name + "_scale_inv", weights[name + "_scale_inv"])])  # fmt: skip
    for missing, named in ((f"{ATTN}.q_a_proj", f"{ATTN}.q_a_proj"),  # the MTP layer's by its name in the model
                           ("model.layers.3.self_attn.kv_a_proj_with_mqa",
                            "model.mtp_layers.0.self_attn.kv_a_proj_with_mqa")):  # fmt: skip
        partial = {k: v for k, v in weights.items() if k != f"{missing}.weight_scale_inv"}
        with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{named}.weight_scale_inv' is missing")):
            DeepseekV3ForCausalLM(config, mtp=True).load_weights(partial.items())
    # a float model's fused layer refuses the checkpoint's FP8 tensors by their own names
    float_model = DeepseekV3ForCausalLM(load_hf_config(dirs["dequantized"]))
    assert float_model.model.layers[0].self_attn.fused_qkv_a_proj is not None
    with pytest.raises(ValueError, match=re.escape(f"'{ATTN}.q_a_proj.weight_scale_inv': FP8 block-scaled")):
        float_model.load_weights([(f"{ATTN}.q_a_proj.weight_scale_inv", weights[f"{ATTN}.q_a_proj.weight_scale_inv"])])


def test_rotary_rows_are_reordered_into_halves_at_load_within_their_fp8_blocks() -> None:
    """deinterleaved_rope_rows: each head's rope rows (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...), the
    nope rows and kv_a's latent rows untouched; an e4m3 tensor keeps its bytes; at DeepSeek-V3's sizes no rope row
    leaves its 128-row weight block, so the block scales still fit; an unexpected shape passes as it is."""
    q = torch.arange(2 * 6, dtype=torch.float32)[:, None].repeat(1, 3)  # 2 heads of nope 2 + rope 4
    got = deinterleaved_rope_rows(q, "q_b_proj", nope=2, rope=4)[:, 0].tolist()
    assert got == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]
    kv_a = torch.arange(7, dtype=torch.float32)
    assert deinterleaved_rope_rows(kv_a, "kv_a_proj_with_mqa", nope=0, rope=4).tolist() == [0, 1, 2, 3, 5, 4, 6]
    fp8 = torch.randn(12, 5).to(FP8_DTYPE)
    assert torch.equal(deinterleaved_rope_rows(fp8, "q_proj", 2, 4).view(torch.uint8),
                       fp8.view(torch.uint8)[[0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]])  # fmt: skip
    odd = torch.zeros(13, 2)
    assert deinterleaved_rope_rows(odd, "q_b_proj", 2, 4) is odd
    order = deinterleaved_rope_rows(torch.arange(128 * 192, dtype=torch.float64), "q_b_proj", 128, 64).long()
    assert torch.equal(order // 128, torch.arange(128 * 192) // 128)  # every row stays in its block
    kv = deinterleaved_rope_rows(torch.arange(1536 + 576, dtype=torch.float64), "kv_a_proj_with_mqa", 0, 64).long()
    assert torch.equal(kv // 128, torch.arange(1536 + 576) // 128)


def test_rotary_rows_reordered_at_load_give_the_de_interleave_at_every_steps_logits(dirs: dict[str, Path]) -> None:
    """The FP8 checkpoints whose rope rows would straddle a weight block (rope_rows_in_blocks false: none of
    DeepSeek's or Kimi's) keep the de-interleave at every step; forced here on the tiny FP8 model, both ways give
    the same logits (to float32 summation order: the GEMMs' output columns sit elsewhere)."""
    from flotilla.models import deepseek_v3

    at_load = _load(dirs["fp8"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deepseek_v3, "rope_rows_in_blocks", lambda *a: False)
        every_step = _load(dirs["fp8"])
    assert at_load.rope_halves_at_load and not at_load.model.layers[0].self_attn.deinterleave
    assert not every_step.rope_halves_at_load and every_step.model.layers[0].self_attn.deinterleave
    steps = [[(0, random_tokens(11, seed=1))], [(1, random_tokens(6, seed=2)), (0, [7])], [(0, [9]), (1, [12])]]
    got_runner, want_runner = PagedRunner(at_load), PagedRunner(every_step)
    for batch in steps:
        for got, want in zip(got_runner.step(batch), want_runner.step(batch), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_a_float_model_reorders_its_rotary_rows_at_load_and_matches_transformers(dirs: dict[str, Path]) -> None:
    check_prefill_then_paged_decode(_load(dirs["float"]), load_hf_model(dirs["float"]))


def test_rope_rows_in_blocks_at_deepseek_v3_sizes() -> None:
    """192-row heads (nope 128 + rope 64): every rope range lies in one 128-row block; 160- or 100-row blocks
    would cut some."""
    from flotilla.models.deepseek_v3_mla import rope_rows_in_blocks

    config = parse_hf_config({**HUB_V3, "num_hidden_layers": 1})
    assert rope_rows_in_blocks(config, config.mla, 128) and rope_rows_in_blocks(config, config.mla, 64)
    assert not rope_rows_in_blocks(config, config.mla, 160) and not rope_rows_in_blocks(config, config.mla, 100)
