"""DeepSeek-V3 / Kimi-K2 under tensor parallelism: an engine with tensor_parallel_size=2 (two worker processes
joined by gloo) gives the greedy tokens of the one-rank engine; 2 gloo ranks decode like one rank on the tiny
float model, a Kimi-K2-like one (one expert group, q_proj without q_lora, tied embeddings) and an FP8
block-scaled checkpoint; each rank holds its heads and its slice of every MLP and expert (checked on
DeepSeek-V3's real shapes, built on the meta device) and its blocks of FP8 weights and scales; splits that
cannot work are refused with the reason."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_deepseek_tp_rank import decode_greedy, load
from helpers_engine import write_tiny_tokenizer
from helpers_tiny_models import write_tiny_deepseek_fp8_pair, write_tiny_deepseek_model
from safetensors.torch import load_file
from test_deepseek_v3 import HUB_V3

from flotilla import LLM, SamplingParams
from flotilla.kernels.quant import FP8_DTYPE
from flotilla.models import parallel
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
from flotilla.models.deepseek_v3_mla import deinterleaved_rope_rows
from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.parallel import (
    ColumnParallelLinear,
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    RowParallelLinear,
)
from flotilla.transport.endpoints import free_tcp_port

# chunked prefill (16-token budget) and mixed prefill + decode steps, pipelined
OPTIONS = dict(kv_cache_blocks=96, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _greedy_tokens(model_dir: Path, **options: object) -> list[list[int]]:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 21, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), **OPTIONS, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_engine_tp2_greedy_tokens_equal_one_rank(tmp_path: Path) -> None:
    model_dir = write_tiny_deepseek_model(tmp_path / "deepseek_v3", "deepseek_v3")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    want = _greedy_tokens(model_dir, placement="inline")
    got = _greedy_tokens(model_dir, placement="process", tensor_parallel_size=2)
    assert all(len(t) == 10 for t in got)
    assert got == want


def test_tp2_ranks_decode_like_one_rank(tmp_path: Path) -> None:
    """The float model, the Kimi-K2-like one (one expert group, q_proj without q_lora, tied embeddings) and an
    FP8 checkpoint, each loaded by 2 gloo ranks (tests/helpers_deepseek_tp_rank.py) and decoded greedily in a
    batch: every rank's logits are the one-rank model's."""
    # 16x16 blocks: every rank's FP8 share (q_b_proj's 96 rows, o_proj's 48 columns, the dense MLP's 64, the
    # shared expert's and each routed expert's 16 intermediate rows) is whole blocks; kv_b_proj dequantizes
    fp8_dir, _ = write_tiny_deepseek_fp8_pair(tmp_path / "fp8", block=(16, 16))
    model_dirs = [write_tiny_deepseek_model(tmp_path / n, n) for n in ("deepseek_v3", "deepseek_v3_no_q_lora")]
    model_dirs.append(fp8_dir)
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    script = Path(__file__).with_name("helpers_deepseek_tp_rank.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", init, str(tmp_path), *map(str, model_dirs)],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    wants = [decode_greedy(load(d)) for d in model_dirs]  # meanwhile, one rank in this process
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    for i, want in enumerate(wants):
        for rank in range(2):
            got = load_file(str(tmp_path / f"rank{rank}_{i}.safetensors"))["logits"]
            assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1)), (model_dirs[i].name, rank)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _build(config: dict, monkeypatch: pytest.MonkeyPatch, rank: int, size: int,
           **kwargs: object) -> DeepseekV3ForCausalLM:  # fmt: skip
    """The model rank `rank` of `size` would build (on the meta device: real shapes, no memory, no group)."""
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=rank, size=size))
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(parse_hf_config(config), **kwargs)


@pytest.mark.parametrize("fp8", [False, True])
def test_each_rank_keeps_its_heads_and_slices(fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 at TP8: 16 of 128 heads, the latent projections whole, 1/8 of every MLP and expert."""
    config = {**HUB_V3, "num_hidden_layers": 4, **({"quantization_config": FP8_QUANT} if fp8 else {})}
    model = _build(config, monkeypatch, rank=3, size=8)
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == 16
    assert tuple(attn.q_b_proj.weight.shape) == (16 * 192, 1536)
    # the latent projections are whole, fused into one GEMM (q_lora_rank 1536 is whole FP8 blocks)
    assert attn.q_a_proj is None and attn.kv_a_proj_with_mqa is None
    assert tuple(attn.fused_qkv_a_proj.weight.shape) == (1536 + 576, 7168)
    assert tuple(attn.kv_b_proj.weight.shape) == (16 * 256, 512)
    w_uk, w_uv = attn.absorbed_weights()
    assert tuple(w_uk.shape) == (16, 128, 512) and tuple(w_uv.shape) == (16, 128, 512)
    assert tuple(attn.o_proj.weight.shape) == (7168, 16 * 128)
    assert tuple(model.model.layers[0].mlp.gate_up_proj.weight.shape) == (2 * 18432 // 8, 7168)
    moe = model.model.layers[3].mlp
    assert tuple(moe.experts.gate_up_proj.shape) == (256, 2 * 256, 7168)
    assert tuple(moe.experts.down_proj.shape) == (256, 7168, 256)
    assert tuple(moe.shared_experts.gate_up_proj.weight.shape) == (2 * 256, 7168)
    assert moe.shared_experts.down_proj.reduce_results is False  # summed with the routed experts' output once
    assert tuple(moe.gate.weight.shape) == (256, 7168)  # the router is whole on every rank
    assert tuple(model.model.embed_tokens.weight.shape) == (129280 // 8, 7168)
    assert model.kv_cache_shape(1, 64) == (1, 64, 576)  # every rank caches the whole latent
    if fp8:
        assert isinstance(attn.q_b_proj, Fp8ColumnParallelLinear) and attn.q_b_proj.weight.dtype == FP8_DTYPE
        assert tuple(attn.q_b_proj.weight_scale_inv.shape) == (16 * 192 // 128, 1536 // 128)
        assert isinstance(attn.o_proj, Fp8RowParallelLinear)
        assert tuple(attn.fused_qkv_a_proj.weight_scale_inv.shape) == (-(-(1536 + 576) // 128), 7168 // 128)
        assert tuple(attn.o_proj.weight_scale_inv.shape) == (7168 // 128, 16 * 128 // 128)
        assert attn.kv_b_proj.weight.dtype != FP8_DTYPE  # dequantized at load, then sliced
        assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == FP8_DTYPE  # the routed experts stay
        assert tuple(moe.experts.gate_up_proj_scale_inv.shape) == (256, 2 * 256 // 128, 7168 // 128)
        assert tuple(moe.experts.down_proj_scale_inv.shape) == (256, 7168 // 128, 256 // 128)
    else:
        assert isinstance(attn.q_b_proj, ColumnParallelLinear) and isinstance(attn.o_proj, RowParallelLinear)


def test_fp8_shards_load_their_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 of the tiny FP8 model (16x16 blocks) holds exactly its rows / columns of each FP8 weight and
    of its block scales, and its heads of the dequantized kv_b_proj."""
    fp8_dir, float_dir = write_tiny_deepseek_fp8_pair(tmp_path, block=(16, 16))
    weights = load_file(str(fp8_dir / "model.safetensors"))
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=1, size=2))
    model = DeepseekV3ForCausalLM(load_hf_config(fp8_dir), fp8_backend="torch")
    assert model.load_weights(weights.items()) == set(dict(model.named_parameters()))
    attn, p = model.model.layers[0].self_attn, "model.layers.0.self_attn"
    mla = model.mla  # q's rotary rows in halves, reordered at load before the rank takes its heads' rows
    assert model.rope_halves_at_load and not attn.deinterleave
    q_b = deinterleaved_rope_rows(weights[f"{p}.q_b_proj.weight"], "q_b_proj", mla.qk_nope_head_dim,
                                  mla.qk_rope_head_dim)  # fmt: skip
    assert torch.equal(attn.q_b_proj.weight.float(), q_b[96:].float())
    assert torch.equal(attn.q_b_proj.weight_scale_inv, weights[f"{p}.q_b_proj.weight_scale_inv"][6:])
    assert torch.equal(attn.o_proj.weight.float(), weights[f"{p}.o_proj.weight"][:, 48:].float())
    assert torch.equal(attn.o_proj.weight_scale_inv, weights[f"{p}.o_proj.weight_scale_inv"][:, 3:])
    for suffix in ("weight", "weight_scale_inv"):  # the fused latent projection whole: q_a's rows, then kv_a's
        kv_a = weights[f"{p}.kv_a_proj_with_mqa.{suffix}"]
        if suffix == "weight":
            kv_a = deinterleaved_rope_rows(kv_a, "kv_a_proj_with_mqa", 0, mla.qk_rope_head_dim)
        want = torch.cat([weights[f"{p}.q_a_proj.{suffix}"], kv_a])
        assert torch.equal(getattr(attn.fused_qkv_a_proj, suffix).float(), want.float()), suffix
    kv_b = load_file(str(float_dir / "model.safetensors"))[f"{p}.kv_b_proj.weight"]  # dequantized there
    torch.testing.assert_close(attn.kv_b_proj.weight, kv_b[2 * 56:], atol=0, rtol=0)
    mlp, p = model.model.layers[0].mlp, "model.layers.0.mlp"
    gate, up = (weights[f"{p}.{proj}_proj.weight_scale_inv"][4:] for proj in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight_scale_inv, torch.cat([gate, up]))


def test_splits_that_cannot_work_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(128\) is not divisible by the tensor-parallel size 3"):
        _build(HUB_V3, monkeypatch, rank=0, size=3)
    # DeepSeek-V3's FP8 checkpoint over 32 ranks: the dense MLP's 18432 / 32 = 576 rows are 4.5 blocks of 128
    with pytest.raises(ValueError, match=r"the dense MLP of layer 0 .* keep 576 of its 18432 rows .* multiple of the "
                                         r"weight block"):
        _build({**HUB_V3, "quantization_config": FP8_QUANT}, monkeypatch, rank=1, size=32)
    # the tiny FP8 model's default 32x32 blocks: o_proj's 96 input columns halve into 48, not whole blocks
    fp8_dir, _ = write_tiny_deepseek_fp8_pair(tmp_path)
    with pytest.raises(ValueError, match=r"o_proj: tensor-parallel rank 0 of 2 would keep 48 of its 96 input columns"):
        _build(json.loads((fp8_dir / "config.json").read_text()), monkeypatch, rank=0, size=2)
    # the MTP layer is split like the decoder layers (speculation under TP: tests/test_spec_decode.py)
    mtp = _build({**HUB_V3, "num_hidden_layers": 4}, monkeypatch, rank=0, size=8, mtp=True).model.mtp_layers[0]
    assert mtp.self_attn.num_heads == 16 and tuple(mtp.eh_proj.weight.shape) == (7168, 2 * 7168)


def test_kimi_k2_fp8_splits_over_8_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi-K2's config (64 heads, 384 experts in one group) with DeepSeek's FP8 blocks: 8 heads a rank."""
    kimi = {**HUB_V3, "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 64,
            "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
            "first_k_dense_replace": 1, "vocab_size": 163840, "quantization_config": FP8_QUANT}  # fmt: skip
    model = _build(kimi, monkeypatch, rank=7, size=8)
    attn = model.model.layers[1].self_attn
    assert attn.num_heads == 8 and tuple(attn.q_b_proj.weight_scale_inv.shape) == (8 * 192 // 128, 1536 // 128)
    assert tuple(model.model.layers[1].mlp.experts.gate_up_proj.shape) == (384, 2 * 256, 7168)
    assert tuple(model.model.embed_tokens.weight.shape) == (163840 // 8, 7168)
