"""FP8 (e4m3) KV cache (kv_cache_dtype fp8 / fp8_e4m3): the quantize / dequantize round trip; every attention
backend that runs on the CPU (torch, triton under the interpreter, the fused RoPE + KV store, MLA's torch path)
stores what the reference stores and reads what it reads; tiny Llama / Qwen3 / DeepSeek-V3 / V3.2 / GLM-5 models
with an FP8 cache stay within a stated tolerance of their float32 cache (and measurably off it, so the check can
fail); the option reaches the runner (dtype, doubled capacity, the ready log), the CLI, the engine end to end and
the KV migration's layout check. FlashInfer's FP8 decode against the torch reference runs on a GPU only."""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from helpers_engine import write_tiny_tokenizer
from helpers_tiny_models import (
    PagedRunner,
    load_flotilla_model,
    random_tokens,
    write_tiny_deepseek_model,
    write_tiny_dsa_model,
    write_tiny_model,
)
from safetensors.torch import load_file, save_file

from flotilla import LLM, SamplingParams
from flotilla.actors.kv_memory import KVMemory
from flotilla.actors.kv_migration import KVMigrationActor
from flotilla.actors.model_runner import ModelRunner
from flotilla.config import EngineConfig
from flotilla.kernels.attention import AttentionMetadata, flashinfer_backend, kv_cache_shape, kv_cache_torch_dtype
from flotilla.kernels.attention import torch_ref
from flotilla.kernels.attention.fp8_kv import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from flotilla.kernels.mla import mla_cache_shape
from flotilla.kernels.mla import torch_ref as mla_ref
from flotilla.kernels.rope import apply_rope, rope_cos_sin_cache
from flotilla.models.hf_config import load_hf_config
from flotilla.models.loader import load_model
from flotilla.models.registry import get_model_class
from flotilla.server.cli import add_engine_arguments, engine_config_from_args
from flotilla.transport.data_plane import EndpointInfo, RegionInfo
from flotilla.transport.messages import KVEndpointEvent

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not INTERPRET, reason="the triton kernels run here under TRITON_INTERPRET=1")

LOGITS_REL_RMS = 0.10
"""FP8 vs float32 KV cache: bound on the logits' relative RMS error (||fp8 - fp32|| / ||fp32||) of the tiny random
models over a prefill and 16 decode steps. e4m3 keeps 3 mantissa bits (per-element relative error <= 2^-4); the
tiny models measure 0.05-0.06 (Llama, Qwen3) and ~0.04 (DeepSeek-V3), a 16-bit cache ~0.002."""
LOGITS_REL_RMS_FLOOR = 1e-3
"""...and at least this much: an FP8 cache that silently stored full precision would pass the bound above."""


# ---- quantization -------------------------------------------------------------------------------------------

def test_option_values_and_dtypes() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)
    assert EngineConfig.from_options(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(msgspec.ValidationError):
        EngineConfig.from_options(kv_cache_dtype="int8")


@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_quantize_dequantize_round_trip(scale: float) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4 * scale
    q = quantize_kv(x, scale)
    assert q.dtype == FP8_KV_DTYPE
    back = dequantize_kv(q, scale, torch.float32)
    normal = (x / scale).abs() >= 2**-6  # e4m3's smallest normal; below it the spacing is absolute (2^-9)
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-7  # round to nearest with 3 mantissa bits
    assert (back - x)[~normal].abs().max() <= 2**-10 * scale + 1e-9
    assert rel.mean() > 1e-3  # it did quantize
    # values on the e4m3 grid come back exactly; beyond +-448 * scale they saturate
    grid = dequantize_kv(q, scale, torch.float32)
    assert torch.equal(dequantize_kv(quantize_kv(grid, scale), scale, torch.float32), grid)
    big = torch.tensor([1000.0, -1e6]) * scale
    assert dequantize_kv(quantize_kv(big, scale), scale, torch.float32).tolist() == [448 * scale, -448 * scale]
    # a cache of any other dtype casts and ignores the scale
    assert torch.equal(quantize_kv(x, scale, torch.bfloat16), x.to(torch.bfloat16))


# ---- kernels ------------------------------------------------------------------------------------------------

K_SCALE, V_SCALE = 0.5, 2.0
"""Scales other than 1.0, so a kernel that ignores one (or swaps them) is caught."""


def _case(seqs: list[tuple[int, int]], dtype: torch.dtype = torch.float32, block_size: int = 4,
          num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, seed: int = 0):
    """(meta, FP8 cache with random history, q, k, v) for (cached, new) token counts, blocks in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size)
    history = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    cache = (history * 2).to(FP8_KV_DTYPE)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tokens = meta.num_tokens
    return meta, cache, randn(tokens, num_heads, head_dim), randn(tokens, num_kv_heads, head_dim), \
        randn(tokens, num_kv_heads, head_dim)  # fmt: skip


def _dequantized(cache: torch.Tensor) -> torch.Tensor:
    """The float32 cache an FP8 one stands for (K * K_SCALE, V * V_SCALE)."""
    return torch.stack((cache[:, 0].float() * K_SCALE, cache[:, 1].float() * V_SCALE), dim=1)


MIXED = [(0, 9), (5, 1), (13, 6), (0, 2), (16, 5)]


def test_torch_store_quantizes_and_attention_reads_the_dequantized_values() -> None:
    meta, cache, q, k, v = _case(MIXED)
    full = _dequantized(cache)  # the same history, the new tokens stored unquantized
    torch_ref.store_kv(k, v, full, meta.slot_mapping)
    torch_ref.store_kv(k, v, cache, meta.slot_mapping, K_SCALE, V_SCALE)
    blocks, offsets = meta.slot_mapping // 4, meta.slot_mapping % 4
    assert torch.equal(cache[blocks, 0, offsets].view(torch.uint8), quantize_kv(k, K_SCALE).view(torch.uint8))
    assert torch.equal(cache[blocks, 1, offsets].view(torch.uint8), quantize_kv(v, V_SCALE).view(torch.uint8))
    got = torch_ref.paged_attention(q, cache, meta, 0.2, K_SCALE, V_SCALE)
    want = torch_ref.paged_attention(q, _dequantized(cache), meta, 0.2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    error = (torch_ref.paged_attention(q, full, meta, 0.2) - got).abs().max().item()
    assert 1e-3 < error < 0.2  # the quantized new tokens move the output, a little


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_and_attention_match_the_reference(dtype: torch.dtype) -> None:
    from flotilla.kernels.triton import attention as tri_attn

    meta, cache, q, k, v = _case(MIXED, dtype)
    ref, tri = cache.clone(), cache.clone()
    torch_ref.store_kv(k, v, ref, meta.slot_mapping, K_SCALE, V_SCALE)
    tri_attn.store_kv(k, v, tri, meta.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(tri.view(torch.uint8), ref.view(torch.uint8))  # the same bytes: round to nearest even
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = torch_ref.paged_attention(q.float(), ref, meta, 0.2, K_SCALE, V_SCALE)
    got = tri_attn.paged_prefill_attention(q, tri, meta, 0.2, block_m=16, block_n=16, k_scale=K_SCALE, v_scale=V_SCALE)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # decode: one new token per sequence over a long context, split and merged
    meta, cache, q, _, _ = _case([(40, 1), (7, 1), (70, 1)], dtype, seed=1)
    want = torch_ref.paged_attention(q.float(), cache, meta, 0.2, K_SCALE, V_SCALE)
    for splits in (1, 4):
        got = tri_attn.paged_decode_attention(q, cache, meta, 0.2, num_splits=splits, block_n=16,
                                              k_scale=K_SCALE, v_scale=V_SCALE)  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_triton
def test_triton_fused_rope_and_store_quantizes_like_rope_then_store() -> None:
    from flotilla.kernels.triton import fused as tri_fused

    meta, cache, q, k, v = _case(MIXED, torch.bfloat16)
    table = rope_cos_sin_cache(32, 64, 10000.0, None)
    positions = torch.randint(0, 64, (meta.num_tokens,), generator=torch.Generator().manual_seed(3))
    slots = meta.slot_mapping.clone()
    slots[3] = -1  # padding is not stored
    want_cache, got_cache = cache.clone(), cache.clone()
    want_q, want_k = apply_rope(positions, q, k, table)
    torch_ref.store_kv(want_k, v, want_cache, slots, K_SCALE, V_SCALE)
    got_q = tri_fused.rope_and_store_kv(positions, q, k, v, table, got_cache, slots, K_SCALE, V_SCALE)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    torch.testing.assert_close(got_q, want_q, atol=1e-2, rtol=1e-2)


def test_mla_latent_store_quantizes_and_attention_reads_the_dequantized_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    rank, rope_dim, heads, block_size = 32, 16, 4, 4
    seqs = [(0, 7), (5, 1), (9, 4)]
    tables = [[0, 1], [2, 3], [4, 5, 6, 7]]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size)
    cache = (torch.randn(mla_cache_shape(8, block_size, rank, rope_dim), generator=gen)).to(FP8_KV_DTYPE)
    c_kv, k_pe = torch.randn(meta.num_tokens, rank, generator=gen), torch.randn(meta.num_tokens, rope_dim, generator=gen)
    mla_ref.store_latent(c_kv, k_pe, cache, meta.slot_mapping, K_SCALE)
    rows = cache[meta.slot_mapping // block_size, meta.slot_mapping % block_size]
    assert torch.equal(rows.view(torch.uint8), quantize_kv(torch.cat((c_kv, k_pe), -1), K_SCALE).view(torch.uint8))
    q_latent = torch.randn(meta.num_tokens, heads, rank, generator=gen)
    q_pe = torch.randn(meta.num_tokens, heads, rope_dim, generator=gen)
    got = mla_ref.paged_mla(q_latent, q_pe, cache, meta, 0.1, K_SCALE)
    want = mla_ref.paged_mla(q_latent, q_pe, cache.float() * K_SCALE, meta, 0.1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---- tiny models: FP8 cache vs float32 cache ---------------------------------------------------------------

def _build(model_dir: Path, attention_backend: str, fused_ops: str = "torch") -> torch.nn.Module:
    config = load_hf_config(model_dir)
    model = get_model_class(config.architectures)(config, attention_backend=attention_backend, fused_ops=fused_ops)
    model.load_weights(load_file(str(model_dir / "model.safetensors")).items())
    return model.eval()


def _prefill_and_decode(model: torch.nn.Module, kv_dtype: torch.dtype | None, tokens: list[int] | None = None,
                        decode_steps: int = 16) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """Logits [11 + decode_steps, vocab] of an 11-token prefill and paged decode steps (blocks of 4, NaN-filled
    cache) and the tokens fed: greedy, or `tokens` (teacher forcing, so both caches see the same sequence)."""
    runner = PagedRunner(model, block_size=4, kv_dtype=kv_dtype)
    fed = random_tokens(11, seed=1)
    logits = [runner.step([(0, fed)])[0]]
    for i in range(decode_steps):
        fed.append(tokens[11 + i] if tokens else int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, [fed[-1]])])[0])
    return torch.cat(logits), fed


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv_fp8")
    dirs = {name: write_tiny_model(root / name, name) for name in ("llama", "qwen3")}
    dirs["deepseek_v3"] = write_tiny_deepseek_model(root / "deepseek_v3", "deepseek_v3")
    for name in ("deepseek_v32", "glm_moe_dsa"):
        dirs[name] = write_tiny_dsa_model(root / name, name)
    return dirs


@pytest.fixture(scope="module")
def torch_runs(model_dirs: dict[str, Path]):
    """name -> (its torch-backend model, the logits over a float32 cache, the tokens fed, the logits over an FP8
    cache), computed once: the torch case's result, and the float32 cache and the reference the triton case is
    held to (the triton kernels' float32 path is tests/test_kernels_triton.py's and tests/test_dsa_triton.py's)."""
    runs: dict[str, tuple[torch.nn.Module, torch.Tensor, list[int], torch.Tensor]] = {}

    def run(name: str) -> tuple[torch.nn.Module, torch.Tensor, list[int], torch.Tensor]:
        if name not in runs:
            model = _build(model_dirs[name], "torch")
            want, tokens = _prefill_and_decode(model, None)
            runs[name] = model, want, tokens, _prefill_and_decode(model, FP8_KV_DTYPE, tokens)[0]
        return runs[name]

    return run


BACKENDS = [("torch", "torch"), pytest.param("triton", "triton", marks=needs_triton)]
"""(attention backend, fused ops): the triton pair also runs the fused RoPE + quantizing store."""


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize(("backend", "fused_ops"), BACKENDS)
def test_gqa_model_with_fp8_cache_is_within_tolerance(name: str, backend: str, fused_ops: str,
                                                      model_dirs: dict[str, Path], torch_runs) -> None:  # fmt: skip
    model, want, tokens, reference = torch_runs(name)
    if backend != "torch":
        model = _build(model_dirs[name], backend, fused_ops)
    assert model.attention_backend_name == backend and model.fused_ops_name == fused_ops
    got = reference if backend == "torch" else _prefill_and_decode(model, FP8_KV_DTYPE, tokens)[0]
    assert got.isfinite().all()  # nothing read from never-written (NaN) slots
    assert LOGITS_REL_RMS_FLOOR < _rel_rms(got, want) < LOGITS_REL_RMS
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
    if backend != "torch":  # the same quantized cache as the reference backend, read the same way
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def test_deepseek_v3_with_fp8_latent_cache_is_within_tolerance(model_dirs: dict[str, Path]) -> None:
    model = load_flotilla_model(model_dirs["deepseek_v3"])
    assert model.attention_backend_name == "mla_torch"
    want, tokens = _prefill_and_decode(model, None)
    got, _ = _prefill_and_decode(model, FP8_KV_DTYPE, tokens)
    assert got.isfinite().all()
    assert LOGITS_REL_RMS_FLOOR < _rel_rms(got, want) < LOGITS_REL_RMS
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_sparse_attention_with_an_fp8_cache_is_within_tolerance(name: str, backend: str, model_dirs: dict[str, Path],
                                                                torch_runs) -> None:  # fmt: skip
    """DeepSeek-V3.2 and GLM-5: the latent and the indexer's keys in e4m3, each key over its own scale (the indexer
    then chooses from quantized keys); the triton kernels read the quantized cache exactly as the reference does.
    These tiny sparse models move further than DeepSeek-V3's (0.40 and 0.11 relative RMS, 63% and 93% of argmaxes
    kept: a top-k of 5-6 positions flips with small changes of the scores), so the bound here only tells a quantized
    cache from a misread one."""
    model, want, tokens, reference = torch_runs(name)
    if backend != "torch":
        model = _build(model_dirs[name], backend)
    assert model.attention_backend_name == f"mla_{backend}"
    got = reference if backend == "torch" else _prefill_and_decode(model, FP8_KV_DTYPE, tokens)[0]
    assert got.isfinite().all()
    assert LOGITS_REL_RMS_FLOOR < _rel_rms(got, want) < 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5
    if backend != "torch":  # (the torch case is the reference itself)
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("backend", "fused_ops"), BACKENDS)
def test_the_layers_scales_reach_the_store_and_the_read(backend: str, fused_ops: str,
                                                        model_dirs: dict[str, Path]) -> None:  # fmt: skip
    """A power-of-two k_scale / v_scale only shifts the stored exponent (the logits barely move: only values near
    e4m3's subnormals round differently); a huge one flushes K and V to zero (they move a lot)."""
    model = _build(model_dirs["llama"], backend, fused_ops)
    base, tokens = _prefill_and_decode(model, FP8_KV_DTYPE, decode_steps=2)  # (the triton pair runs interpreted)

    def with_scales(k_scale: float, v_scale: float) -> torch.Tensor:
        for layer in model.model.layers:
            layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
        return _prefill_and_decode(model, FP8_KV_DTYPE, tokens, decode_steps=2)[0]

    assert _rel_rms(with_scales(0.5, 0.25), base) < 0.02
    assert _rel_rms(with_scales(1e4, 1.0), base) > 0.05
    assert _rel_rms(with_scales(1.0, 1e4), base) > 0.05


def test_checkpoint_kv_scales_are_read(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Calibrated scales under the names FP8 checkpoints use set the layers' k_scale / v_scale (per-head ones
    collapse to their largest); layers without keep 1.0."""
    model_dir = shutil.copytree(model_dirs["llama"], tmp_path / "scaled")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.125, 0.375])
    tensors["model.layers.2.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, str(model_dir / "model.safetensors"))
    model = load_model(str(model_dir), dtype="float32", device=torch.device("cpu"), progress=False).module
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.model.layers]
    assert scales == [(0.5, 0.25), (0.375, 1.0), (2.0, 2.0)]


# ---- the option through the engine -------------------------------------------------------------------------

def test_runner_allocates_fp8_and_the_capacity_doubles(model_dirs: dict[str, Path]) -> None:
    def runner(kv_cache_dtype: str) -> ModelRunner:
        config = EngineConfig.from_options(model=str(model_dirs["llama"]), dtype="bfloat16", device="cpu",
                                           cpu_kv_cache_gib=0.01, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        return ModelRunner(config, progress=False)

    auto, fp8 = runner("auto"), runner("fp8")
    assert auto.kv_caches[0].dtype == torch.bfloat16 and fp8.kv_caches[0].dtype == FP8_KV_DTYPE
    assert fp8.kv_bytes_per_block * 2 == auto.kv_bytes_per_block
    assert fp8.num_blocks in (2 * auto.num_blocks, 2 * auto.num_blocks + 1)
    assert fp8.capacity_tokens >= 2 * auto.capacity_tokens


def test_cli_flag_maps_to_the_option() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert "--kv-cache-dtype" in parser.format_help()
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert engine_config_from_args(args, None).cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


def test_engine_greedy_run_with_fp8_cache(tmp_path: Path) -> None:
    """LLM(kv_cache_dtype="fp8") end to end: the worker reports the cache's dtype, and each prompt's greedy
    tokens are the ones the FP8-cache model gives alone."""
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    write_tiny_tokenizer(model_dir, vocab_size=320)
    prompts = [random_tokens(n, seed=30 + n) for n in (5, 13)]
    with LLM(str(model_dir), kv_cache_dtype="fp8", kv_cache_blocks=64, block_size=4) as llm:
        assert llm.client.ready_detail["worker/0"]["kv_dtype"] == "float8_e4m3fn"
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    model = load_flotilla_model(model_dir)
    for prompt, out in zip(prompts, outs, strict=True):
        runner = PagedRunner(model, block_size=4, kv_dtype=FP8_KV_DTYPE)
        generated = [int(runner.step([(0, prompt)])[0][-1].argmax())]
        while len(generated) < 8:
            generated.append(int(runner.step([(0, [generated[-1]])])[0][-1].argmax()))
        assert out.outputs[0].token_ids == generated


# ---- KV migration: bytes move, dtypes must agree --------------------------------------------------------------

def test_fp8_blocks_stage_as_bytes_and_a_dtype_mismatch_is_refused() -> None:
    caches = [torch.randn(6, 2, 4, 2, 8).to(FP8_KV_DTYPE) for _ in range(2)]
    memory = KVMemory(caches)
    assert memory.kv_dtype == "float8_e4m3fn" and memory.block_bytes == 2 * 4 * 2 * 8
    buffer = memory.staging_buffer(3)
    memory.stage_out(buffer, [4, 1])
    dst = KVMemory([torch.zeros_like(c) for c in caches])
    dst.stage_in(buffer, [0, 5])
    for src, got in zip(caches, dst.caches, strict=True):
        assert torch.equal(got[[0, 5]].view(torch.uint8), src[[4, 1]].view(torch.uint8))

    actor = KVMigrationActor.__new__(KVMigrationActor)  # only the layout check, no sockets
    actor.memory = memory

    def event(kv_dtype: str) -> KVEndpointEvent:
        regions = [RegionInfo(name=f"kv.layer{i}", engine_id="x", backend="local", length=6 * memory.block_bytes)
                   for i in range(2)]
        return KVEndpointEvent(rank=0, endpoint=EndpointInfo(backend="local", engine_id="x"), regions=regions,
                               block_bytes=memory.block_bytes, kv_dtype=kv_dtype)  # fmt: skip

    assert actor._layout_mismatch(event("float8_e4m3fn")) is None
    assert actor._layout_mismatch(event("")) is None  # a peer that does not say (older) is judged by bytes alone
    assert "bfloat16" in actor._layout_mismatch(event("bfloat16"))


# ---- flashinfer (GPU) ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_backend.importable(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("seqs", [[(2000, 1)] * 16, [(0, 300), (128, 64), (1000, 1), (17, 1)]],
                         ids=["decode16x2k", "mixed"])
def test_flashinfer_fp8_matches_the_torch_reference(seqs: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    block_size, heads, kv_heads, head_dim = 16, 32, 8, 128
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 4
    order = torch.randperm(num_blocks).tolist()
    tables = [[order.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size, device="cuda")
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), device="cuda").to(FP8_KV_DTYPE)
    q, k, v = (torch.randn(meta.num_tokens, h, head_dim, device="cuda", dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    fi = flashinfer_backend.FlashInferAttention()
    ref_cache, fi_cache = cache.clone(), cache.clone()
    torch_ref.store_kv(k, v, ref_cache, meta.slot_mapping, K_SCALE, V_SCALE)
    fi.store_kv(k, v, fi_cache, meta.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(ref_cache.view(torch.uint8), fi_cache.view(torch.uint8))
    scale = head_dim**-0.5
    want = torch_ref.paged_attention(q, ref_cache, meta, scale, K_SCALE, V_SCALE).float()
    got = fi.forward(q, fi_cache, meta, scale, K_SCALE, V_SCALE).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


# ---- the engine on a GPU, in CUDA graphs ---------------------------------------------------------------------

GPU_FP8_CASES = [("qwen3_hd64", "triton"), ("qwen3_hd64", "flashinfer_triton"), ("qwen3_hd64", "flashinfer"),
                 ("deepseek_v3", "triton"), ("deepseek_v32", "triton")]
"""(tiny model, attention backend): triton's fused RoPE + quantizing store, its decode (in graphs) and prefill kernels;
FlashInfer's FP8 decode and prefill; triton's MLA latent store and kernels (FlashMLA takes a bf16 cache only), and
its sparse ones (the indexer's keys quantized too)."""


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "backend"), GPU_FP8_CASES, ids=[f"{n}-{b}" for n, b in GPU_FP8_CASES])
def test_gpu_engine_with_an_fp8_cache_follows_its_bf16_cache(name: str, backend: str, tmp_path: Path) -> None:
    """On CUDA, decode steps in CUDA graphs: an FP8 cache gives every prompt its full output and the first token (the
    prefill's argmax, which read the quantized cache) of a bf16 cache for at least 7 of 10 prompts (the CPU tests
    bound the logits' error at 10% RMS; the tiny models' near-ties flip some argmaxes); 5 for the tiny sparse model,
    which keeps 63% of its argmaxes under FP8 on the CPU as well (test_sparse_attention_with_an_fp8_cache_...)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if "flashinfer" in backend and not flashinfer_backend.importable():
        pytest.skip("needs flashinfer")
    model = (write_tiny_deepseek_model(tmp_path / name, name) if name == "deepseek_v3"
             else write_tiny_dsa_model(tmp_path / name, name) if name == "deepseek_v32"
             else write_tiny_model(tmp_path / name, name))  # fmt: skip
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 60))] for _ in range(10)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    outs = {}
    for kv in ("auto", "fp8"):
        with LLM(str(model), kv_cache_blocks=256, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 attention_backend=backend, kv_cache_dtype=kv, skip_tokenizer_init=True) as engine:  # fmt: skip
            detail = engine.client.ready_detail["worker/0"]
            assert detail["kv_dtype"] == ("float8_e4m3fn" if kv == "fp8" else "bfloat16"), detail
            outs[kv] = [o.outputs[0].token_ids for o in engine.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert [len(o) for o in outs["fp8"]] == [p.max_tokens for p in params]
    assert sum(a[0] == b[0] for a, b in zip(outs["fp8"], outs["auto"])) >= (5 if name == "deepseek_v32" else 7), outs
