"""FP8 block-scaled weights (DeepSeek's checkpoint format): block quantization and dequantization, dynamic
per-token-group activation quantization, fp8_block_linear's backends (torch against a block loop written
out here; triton against the w8a8 reference, under TRITON_INTERPRET=1 on CPU and compiled for sm_90), the
Fp8BlockLinear module, and a tiny DeepSeek-V3 FP8 checkpoint (quantized by the test from the float tiny
model) against the float model with the dequantized weights: logits and 16 greedy tokens; loader errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

from helpers_tiny_models import (  # noqa: E402
    FP8_BLOCK as BLOCK,
    PagedRunner,
    load_flotilla_model,
    write_tiny_deepseek_fp8_pair,
)
from safetensors.torch import load_file  # noqa: E402

from helpers_triton import compile_for_sm90  # noqa: E402
from flotilla.kernels.quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    available_fp8_backends,
    best_fp8_backend,
    block_dequantize,
    block_quantize,
    deep_gemm_usable,
    fp8_block_linear,
    get_fp8_backend,
    per_token_group_dequantize,
    per_token_group_quantize,
)
from flotilla.kernels.arrivals import arrival_counters  # noqa: E402
from flotilla.kernels.quant import fp8_ref  # noqa: E402
from flotilla.kernels.quant.fp8_linear import Fp8BlockLinear  # noqa: E402
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from flotilla.models.hf_config import load_hf_config, parse_hf_config  # noqa: E402
from flotilla.models.loader import ModelLoadError, load_model  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA and not INTERPRET else "cpu")
needs_triton = pytest.mark.skipif(not HAS_TRITON or not (ON_CUDA or INTERPRET), reason="triton cannot run here")
E4M3_REL = 2.0**-4
"""e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value (normal range)."""
E4M3_SUBNORMAL_STEP = 2.0**-9
"""The spacing of e4m3's subnormals (in units of the block scale): the absolute error floor near zero."""

SHAPES = [((256, 384), (128, 128)), ((300, 200), (128, 128)), ((1, 7), (128, 128)), ((130, 129), (32, 64)),
          ((48, 96), (16, 32))]  # fmt: skip


def gpu_test(fn):
    """Marked `gpu` and skipped unless a CUDA device runs compiled triton."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")(fn))


def _weights(shape: tuple[int, int], seed: int, device: torch.device | None = None) -> torch.Tensor:
    """Random weights whose blocks have very different magnitudes (so a misplaced scale shows)."""
    device = device or torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(*shape, generator=gen, device=device)
    return w * torch.logspace(-3, 1, shape[1], device=device)[torch.randperm(shape[1], generator=gen, device=device)]


def _expected_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each block's amax / 448, block by block (written out independently of fp8_ref)."""
    (n, k), (bn, bk) = w.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    out = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / FP8_MAX
    return out


def _blockwise_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x W^T with W's blocks scaled one at a time (the format's definition, float64)."""
    (n, k), (bn, bk) = q.shape, block
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bn, min((i + 1) * bn, n)), slice(j * bk, min((j + 1) * bk, k))
            y[:, rows] += x[:, cols].double() @ (q[rows, cols].double() * float(s[i, j])).T
    return y


@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_block_quantize_round_trip_within_e4m3_rounding(shape: tuple[int, int], block: tuple[int, int]) -> None:
    w = _weights(shape, seed=shape[0])
    q, s = block_quantize(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    torch.testing.assert_close(s, _expected_scales(w, block), rtol=1e-6, atol=0)
    back = block_dequantize(q, s, block)
    per_element = fp8_ref.expand_block_scales(s, shape, block)
    bound = E4M3_REL * w.abs() + E4M3_SUBNORMAL_STEP / 2 * per_element + 1e-12
    assert ((back - w).abs() <= bound).all()
    # every block's largest value lands on 448 exactly
    assert torch.equal(_expected_scales(q.float(), block) * FP8_MAX, torch.full_like(s, FP8_MAX))
    assert block_dequantize(q, s, block, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_a_block_scale_misplaced_or_misshapen_is_seen() -> None:
    w = _weights((256, 256), seed=3)
    q, s = block_quantize(w, (128, 128))
    swapped = s.flip(0)  # block rows exchanged
    assert (block_dequantize(q, swapped) - w).abs().max() > 0.5
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 3\), but a \[256, 256\] weight"):
        block_dequantize(q, torch.ones(2, 3))
    assert torch.equal(block_quantize(torch.zeros(3, 5))[0].float(), torch.zeros(3, 5))  # no 0/0


@pytest.mark.parametrize(("tokens", "k", "group"), [(5, 256, 128), (3, 200, 128), (7, 40, 16)])
def test_per_token_group_quantization_round_trip(tokens: int, k: int, group: int) -> None:
    x = _weights((tokens, k), seed=k)
    q, s = per_token_group_quantize(x, group)
    assert q.dtype == FP8_DTYPE and s.shape == (tokens, -(-k // group))
    torch.testing.assert_close(s, _expected_scales(x, (1, group)), rtol=1e-6, atol=0)
    back = per_token_group_dequantize(q, s, group)
    per_element = s.repeat_interleave(group, dim=1)[:, :k]
    assert ((back - x).abs() <= E4M3_REL * x.abs() + E4M3_SUBNORMAL_STEP / 2 * per_element + 1e-12).all()
    q3, s3 = per_token_group_quantize(x.view(1, tokens, k), group)  # leading dims are kept
    assert torch.equal(q3.view(tokens, k).float(), q.float()) and s3.shape == (1, *s.shape)


@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_torch_fp8_linear_equals_the_blockwise_definition(shape: tuple[int, int], block: tuple[int, int]) -> None:
    n, k = shape
    q, s = block_quantize(_weights(shape, seed=n + k), block)
    x, bias = torch.randn(9, k, generator=torch.Generator().manual_seed(1)), torch.randn(n)
    want = _blockwise_linear(x, q, s, block)
    y = fp8_block_linear(x, q, s, None, block, backend="torch")
    assert y.dtype == torch.float32 and y.shape == (9, n)
    torch.testing.assert_close(y.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
    torch.testing.assert_close(fp8_block_linear(x, q, s, bias, block, backend="torch"), y + bias)
    y16 = fp8_block_linear(x.bfloat16(), q, s, None, block, backend="torch")
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_backend_dispatch_by_name_and_capability() -> None:
    assert set(available_fp8_backends()) == {"auto", "torch", "triton", "deep_gemm"}
    assert best_fp8_backend(torch.device("cpu")) == "torch"  # even with the interpreter on
    assert get_fp8_backend("torch").linear is fp8_ref.fp8_block_linear
    with pytest.raises(ValueError, match="unknown FP8 linear backend 'cutlass'; choices: auto, torch"):
        get_fp8_backend("cutlass")
    if not ON_CUDA:
        with pytest.raises(ValueError, match="'deep_gemm' needs the deep_gemm package"):
            get_fp8_backend("deep_gemm")


# ---- the triton block-scaled GEMM ----

TRITON_CASES = [(5, (300, 200), (128, 128)), (33, (48, 64), (32, 32)), (1, (70, 130), (64, 32)),
                (70, (96, 256), (32, 128)), (3, (520, 64), (256, 32))]  # fmt: skip
"""Weights not a multiple of their blocks; a 256-row block spans two 128-wide output tiles."""


@needs_triton
@pytest.mark.parametrize(("tokens", "shape", "block"), TRITON_CASES)
def test_triton_fp8_linear_matches_the_w8a8_reference(tokens: int, shape: tuple[int, int],
                                                      block: tuple[int, int]) -> None:  # fmt: skip
    n, k = shape
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    q, s = block_quantize(_weights(shape, seed=tokens, device=DEVICE), block)
    x = torch.randn(tokens, k, generator=gen, device=DEVICE)
    bias = torch.randn(n, generator=gen, device=DEVICE)
    got = fp8_block_linear(x, q, s, bias, block, backend="triton")
    want = fp8_ref.fp8_block_linear_w8a8(x, q, s, bias, block)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    # the activation's quantization is the only difference from the weight-only reference
    weight_only = fp8_block_linear(x, q, s, bias, block, backend="torch")
    torch.testing.assert_close(got, weight_only, atol=0.1 * weight_only.abs().max().item(), rtol=0)
    assert fp8_block_linear(x[:0], q, s, None, block, backend="triton").shape == (0, n)


@needs_triton
@pytest.mark.parametrize(("tokens", "shape", "block", "tiles"), [
    (1, (300, 1100), (128, 128), "sk=3"),          # K blocks (9) split 3 ways, N not a multiple of the tile
    (7, (200, 1000), (64, 128), "n=32,sk=4"),      # 8 K blocks in runs of 2; narrow tiles
    (3, (130, 1200), (128, 128), "sk=4,m=32"),     # 10 K blocks in runs of 3: the last run has idle steps
    (70, (96, 512), (32, 128), "sk=2"),            # two row tiles
])  # fmt: skip
def test_triton_fp8_linear_with_k_split_matches_the_w8a8_reference(tokens, shape, block, tiles, monkeypatch) -> None:
    """The K split (float32 partials, then one launch adding them and the bias) forced by FLOTILLA_FP8_TILES."""
    from flotilla.kernels.quant import fp8_triton

    n, k = shape
    monkeypatch.setenv("FLOTILLA_FP8_TILES", tiles)
    assert fp8_triton.pick_tiles(tokens, n, k, block, 132, fp8_triton.parse_tiles(tiles))["split_k"] > 1
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    q, s = block_quantize(_weights(shape, seed=tokens, device=DEVICE), block)
    x = torch.randn(tokens, k, generator=gen, device=DEVICE)
    bias = torch.randn(n, generator=gen, device=DEVICE)
    for b in (bias, None):
        got = fp8_block_linear(x, q, s, b, block, backend="triton")
        want = fp8_ref.fp8_block_linear_w8a8(x, q, s, b, block)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        # the last split of each tile adds the partials in the GEMM's launch (r=1, the default): the second
        # launch's bits, and the arrival counters are left at zero for the next call
        forced = fp8_triton.parse_tiles(tiles)
        again = fp8_triton.fp8_block_linear(x, q, s, b, block, tiles={**forced, "sum_in_kernel": 1})
        assert torch.equal(again, got)
        assert torch.equal(fp8_triton.fp8_block_linear(x, q, s, b, block, tiles={**forced, "sum_in_kernel": 0}), got)
        assert not arrival_counters(x.device).any()


@needs_triton
def test_small_batches_split_k_until_the_sms_are_busy() -> None:
    """pick_tiles at DeepSeek-V3's shapes on 132 SMs: at batch-1 decode q_a+kv_a (N 2112, K 7168) takes 33 tiles of
    64 columns with K split 8 ways, not 17 tiles of 128 that would leave most SMs idle. Wide outputs and prefill
    batches do not split."""
    from flotilla.kernels.quant.fp8_triton import parse_tiles, pick_tiles

    def tiles(m: int, n: int, k: int, forced: str = "") -> tuple[int, int, int]:
        t = pick_tiles(m, n, k, (128, 128), 132, parse_tiles(forced))
        return t["block_m"], t["block_n"], t["split_k"]

    assert tiles(1, 2112, 7168) == (16, 64, 8)
    assert tiles(1, 7168, 16384) == (16, 64, 3)  # o_proj: 112 tiles
    assert tiles(1, 24576, 1536) == (16, 64, 1)  # q_b: 384 tiles already
    assert tiles(1, 2112, 512) == (16, 64, 1)  # 4 K blocks: too few to split
    assert tiles(64, 2112, 7168) == (64, 64, 8)
    assert tiles(65, 2112, 7168) == (64, 128, 1) and tiles(4096, 7168, 16384) == (64, 128, 1)
    assert tiles(1, 2112, 7168, "n=128,sk=1") == (16, 128, 1)  # the tiles before the split, for a sweep
    with pytest.raises(ValueError, match="must divide the weight's block rows"):
        pick_tiles(1, 256, 256, (64, 128), 132, parse_tiles("n=128"))
    with pytest.raises(ValueError, match=r"'x=3' is not one of m=N, n=N, sk=N, w=N, s=N, r=0\|1"):
        parse_tiles("x=3")
    with pytest.raises(ValueError, match="'r=2'"):
        parse_tiles("r=2")
    assert parse_tiles("r=0") == {"sum_in_kernel": 0} and pick_tiles(1, 256, 256, (128, 128), 132)["sum_in_kernel"] == 1


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow
def test_fp8_gemm_kernel_compiles_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    """The interpreter checks little of the language's typing (fp8 dots included): compile for Hopper
    (sm_90) at DeepSeek-V3's o_proj shape (K 16384 -> N 7168, 128x128 blocks), bf16 out, with a bias."""
    pointers = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
                "bias_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip
    specs = [(pointers, dict(K=16384, BLOCK_SCALE_N=128, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128)),
             (pointers, dict(K=7168, BLOCK_SCALE_N=128, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)),
             ({**pointers, "part_ptr": "*fp32"},  # batch-1 decode's q_a+kv_a: 64-column tiles, K split 8 ways
              dict(K=7168, BLOCK_SCALE_N=128, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8)),
             ({**pointers, "part_ptr": "*fp32", "count_ptr": "*i32"},  # the same, its tiles' last splits adding up
              dict(K=7168, BLOCK_SCALE_N=128, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8,
                   SUM_IN_KERNEL=True))]  # fmt: skip
    defaults = dict(SPLIT_K=1, SUM_IN_KERNEL=False)  # constexprs left out would compile as i32
    kernels = [("flotilla.kernels.quant.fp8_triton", "_fp8_block_gemm_kernel", p, [], {**defaults, **c}, 4)
               for p, c in specs]  # fmt: skip
    kernels.append(("flotilla.kernels.quant.fp8_triton", "_split_k_sum_kernel",
                    {"part_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}, [],
                    dict(SPLIT_K=8, HAS_BIAS=True, BLOCK=1024), 4))  # fmt: skip
    compile_for_sm90(kernels, tmp_path)


@gpu_test
@pytest.mark.parametrize("tiles", ["", "sk=8", "sk=16,n=128"])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_gpu_k_split_summed_in_the_gemm_gives_the_second_launchs_bits_eager_and_in_a_graph(tokens, tiles) -> None:
    """r=1 (each tile's last split adds the partials, counting arrivals with atomics) against r=0 (a second launch):
    the same bits at DeepSeek-V3's split shapes, eager and over several replays of one CUDA graph (the counters
    must be back at zero after every call for the next to be right)."""
    from flotilla.kernels.quant import fp8_triton

    forced = fp8_triton.parse_tiles(tiles)
    for n, k in ((2112, 7168), (7168, 16384), (7168, 2048)):  # q_a+kv_a, o_proj, the shared experts' down_proj
        q, s = block_quantize(_weights((n, k), seed=n, device=DEVICE) * 0.01, (128, 128))
        gen = torch.Generator(device=DEVICE).manual_seed(tokens)
        xs = [torch.randn(tokens, k, device=DEVICE, generator=gen).bfloat16() for _ in range(3)]
        bias = torch.randn(n, device=DEVICE, generator=gen).bfloat16()
        assert fp8_triton.pick_tiles(tokens, n, k, (128, 128), 132, forced)["split_k"] > 1
        want = [fp8_triton.fp8_block_linear(x, q, s, bias, (128, 128), tiles={**forced, "sum_in_kernel": 0})
                for x in xs]  # fmt: skip
        for x, w in zip(xs, want):
            assert torch.equal(fp8_triton.fp8_block_linear(x, q, s, bias, (128, 128), tiles=forced), w), (n, k)
        static = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_triton.fp8_block_linear(static, q, s, bias, (128, 128), tiles=forced)
        for x, w in [*zip(xs, want), *zip(xs, want)]:
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, w), (n, k)
        assert not arrival_counters(DEVICE).any()


@gpu_test
@pytest.mark.parametrize("tokens", [1, 16, 257, 4096])
@pytest.mark.parametrize("shape", [(7168, 16384), (36864, 7168), (2112, 7168)])  # o_proj, gate_up, q_a+kv_a
def test_gpu_triton_fp8_linear_at_deepseek_v3_sizes(tokens: int, shape: tuple[int, int]) -> None:
    n, k = shape
    q, s = block_quantize(_weights(shape, seed=n, device=DEVICE) * 0.01, (128, 128))
    x = torch.randn(tokens, k, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(tokens))
    x = x.bfloat16()
    got = fp8_block_linear(x, q, s, None, (128, 128), backend="triton")
    # the reference quantizes the same bf16 activations: from the fp32 ones, a value that bf16 rounding moves
    # across an e4m3 rounding boundary lands one e4m3 step (6-12%) away, which would fail 0.01-0.4% of the outputs
    want = fp8_ref.fp8_block_linear_w8a8(x.float(), q, s, None, (128, 128))
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


@gpu_test
@pytest.mark.skipif(not (ON_CUDA and deep_gemm_usable()), reason="needs deep_gemm on a Hopper GPU")
@pytest.mark.parametrize("tokens", [1, 16, 257, 4096])
@pytest.mark.parametrize("shape", [(7168, 16384), (24576, 1536), (2112, 7168)])  # o_proj, q_b, q_a+kv_a
def test_gpu_deep_gemm_fp8_linear_at_deepseek_v3_sizes(tokens: int, shape: tuple[int, int]) -> None:
    """DeepGEMM's fp8_gemm_nt behind the "deep_gemm" backend against the W8A8 reference: what letting "auto" pick it
    (DEEP_GEMM_IN_AUTO) rests on."""
    n, k = shape
    q, s = block_quantize(_weights(shape, seed=n, device=DEVICE) * 0.01, (128, 128))
    x = torch.randn(tokens, k, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(tokens))
    x = x.bfloat16()
    got = fp8_block_linear(x, q, s, None, (128, 128), backend="deep_gemm")
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    want = fp8_ref.fp8_block_linear_w8a8(x.float(), q, s, None, (128, 128))
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


# ---- the module ----


def test_fp8_block_linear_module_and_its_dummy_weights() -> None:
    layer = Fp8BlockLinear(200, 300, bias=True, block_size=(128, 128), backend=get_fp8_backend("torch"))
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.shape == (3, 2)
    layer.dummy_init_(torch.Generator().manual_seed(0))
    assert layer.weight.float().abs().max() == FP8_MAX and (layer.weight_scale_inv > 0).all()
    x = torch.randn(4, 200)
    want = F.linear(x, block_dequantize(layer.weight, layer.weight_scale_inv), layer.bias)
    torch.testing.assert_close(layer(x), want)
    assert "backend=torch" in repr(layer)


# ---- a tiny DeepSeek-V3 FP8 checkpoint ----

@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_deepseek_fp8_pair(tmp_path_factory.mktemp("tiny_deepseek_fp8"))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """16 greedy tokens through the paged cache, and the logits of every step."""
    runner = PagedRunner(model, block_size=4)
    logits = [runner.step([(0, prompt)])[0]]
    tokens = [int(logits[-1][-1].argmax())]
    while len(tokens) < steps:
        logits.append(runner.step([(0, [tokens[-1]])])[0])
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


def test_fp8_checkpoint_matches_its_dequantized_float_model(fp8_dirs: tuple[Path, Path]) -> None:
    fp8_dir, float_dir = fp8_dirs
    fp8 = load_model(fp8_dir, progress=False, model_kwargs={"attention_backend": "torch", "fp8_backend": "torch"})
    model = fp8.module
    assert model.fp8_backend_name == "torch" and fp8.config.quantization is not None
    attn = model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj is None  # q_lora_rank 48 is 1.5 blocks of 32: q_a and kv_a stay two layers
    for layer in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj,
                  model.model.layers[0].mlp.gate_up_proj, model.model.layers[1].mlp.shared_experts.down_proj):  # fmt: skip
        assert isinstance(layer, Fp8BlockLinear) and layer.weight.dtype == FP8_DTYPE
    assert attn.kv_b_proj.weight.dtype == torch.float32  # dequantized at load (absorbed into the attention)
    experts = model.model.layers[1].mlp.experts  # routed: e4m3 with block scales, dequantized per call on CPU
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.down_proj.dtype == FP8_DTYPE
    assert experts.gate_up_proj_scale_inv.dtype == torch.float32
    reference = load_flotilla_model(float_dir)
    prompt = _tokens(11, seed=1)
    tokens, logits = _greedy(model, prompt, 16)
    want_tokens, want_logits = _greedy(reference, prompt, 16)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)


@needs_triton
@pytest.mark.slow
def test_fp8_checkpoint_on_the_triton_gemm(fp8_dirs: tuple[Path, Path]) -> None:
    """The triton backend quantizes activations too: every FP8 layer of the model gives the w8a8 torch reference's
    output for the input it really got, and the model stays near the dequantized float model.

    (Layer by layer, not the whole model against a w8a8 model: a float32 difference of 1e-6 upstream can move an
    activation across an e4m3 rounding midpoint, one e4m3 step, 6% of that value, and move the logits visibly.)"""
    fp8_dir, float_dir = fp8_dirs
    kwargs = {"attention_backend": "torch", "fp8_backend": "triton"}
    model = load_model(fp8_dir, progress=False, model_kwargs=kwargs).module
    assert model.fp8_backend_name == "triton"
    checked = []

    def against_reference(layer: Fp8BlockLinear, inputs: tuple, out: torch.Tensor) -> None:
        want = fp8_ref.fp8_block_linear_w8a8(inputs[0], layer.weight, layer.weight_scale_inv, layer.bias,
                                             layer.block_size)  # fmt: skip
        torch.testing.assert_close(out, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        checked.append(layer)

    layers = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    handles = [layer.register_forward_hook(against_reference) for layer in layers]
    tokens = _tokens(9, seed=2)
    got = PagedRunner(model).step([(0, tokens)])[0]
    for h in handles:
        h.remove()
    assert len(checked) == len(layers) > 0
    want = PagedRunner(load_flotilla_model(float_dir)).step([(0, tokens)])[0]
    torch.testing.assert_close(got, want, atol=0.1 * want.abs().max().item(), rtol=0)


def test_fp8_scales_stay_float32_in_a_bf16_model_and_dummy_weights(fp8_dirs: tuple[Path, Path]) -> None:
    fp8_dir, _ = fp8_dirs
    file = load_file(str(fp8_dir / "model.safetensors"))
    bf16 = load_model(fp8_dir, dtype="bfloat16", progress=False).module
    o_proj = bf16.model.layers[2].self_attn.o_proj
    assert o_proj.weight_scale_inv.dtype == torch.float32
    assert torch.equal(o_proj.weight_scale_inv, file["model.layers.2.self_attn.o_proj.weight_scale_inv"])
    assert torch.equal(o_proj.weight.float(), file["model.layers.2.self_attn.o_proj.weight"].float())
    dummy = load_model(fp8_dir, dtype="bfloat16", load_format="dummy", progress=False).module
    layer = dummy.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == FP8_DTYPE and layer.weight.float().abs().max() == FP8_MAX
    assert (layer.weight_scale_inv > 0).all() and layer.weight_scale_inv.max() < 1e-5  # uniform(-1e-3, 1e-3)
    assert torch.isfinite(PagedRunner(dummy).step([(0, _tokens(6, seed=3))])[0]).all()


@pytest.mark.parametrize("missing", ["model.layers.2.self_attn.o_proj.weight_scale_inv",
                                     "model.layers.0.mlp.up_proj.weight_scale_inv",
                                     "model.layers.1.self_attn.kv_b_proj.weight_scale_inv",
                                     "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"])  # fmt: skip
def test_a_missing_scale_is_named(fp8_dirs: tuple[Path, Path], missing: str) -> None:
    fp8_dir, _ = fp8_dirs
    weights = load_file(str(fp8_dir / "model.safetensors"))
    del weights[missing]
    model = DeepseekV3ForCausalLM(load_hf_config(fp8_dir))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {missing!r} is missing")):
        model.load_weights(weights.items())


def test_loader_errors_for_mismatched_fp8_tensors(fp8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    fp8_dir, float_dir = fp8_dirs
    config = load_hf_config(fp8_dir)
    weights = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=re.escape(f"{name!r} is float32, but the fp8 quantization_config")):
        DeepseekV3ForCausalLM(config).load_weights([(name, torch.zeros(64, 96))])
    weights.pop("model.layers.2.mlp.experts.3.gate_proj.weight")
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.mlp\.experts\.3\.gate_proj\.weight_scale_inv' has no FP8 wei"):
        DeepseekV3ForCausalLM(config).load_weights(weights.items())
    # an FP8 checkpoint whose config lost its quantization_config: refused at the first FP8 tensor, named
    (tmp_path / "config.json").write_text((float_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.\d\.[a-z_.]+weight(_scale_inv)?': FP8 block-scaled"):
        load_model(tmp_path, progress=False)
    with pytest.raises(ValueError, match="multiple of the weight block"):
        DeepseekV3ForCausalLM(parse_hf_config({**json.loads((fp8_dir / "config.json").read_text()),
                                               "quantization_config": {"quant_method": "fp8",
                                                                       "weight_block_size": [64, 64]}}))  # fmt: skip


@pytest.mark.parametrize(("quant", "error"), [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8 is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
])  # fmt: skip
def test_quantization_config_parsing(fp8_dirs: tuple[Path, Path], quant: dict, error: str) -> None:
    raw = json.loads((fp8_dirs[0] / "config.json").read_text())
    assert parse_hf_config(raw).quantization.weight_block_size == BLOCK
    assert parse_hf_config({k: v for k, v in raw.items() if k != "quantization_config"}).quantization is None
    with pytest.raises(ValueError, match=error):
        parse_hf_config({**raw, "quantization_config": quant})


# ---- the engine option (--fp8-backend) ----


def test_the_fp8_backend_option_reaches_the_model_and_is_refused_where_it_does_not_apply(fp8_dirs, tmp_path):
    from flotilla import LLM, SamplingParams
    from flotilla.actors.runtime import ActorFailure
    from helpers_engine import write_tiny_engine_model

    fp8_dir, float_dir = fp8_dirs
    options = dict(kv_cache_blocks=64, block_size=4, skip_tokenizer_init=True)
    prompt = [{"prompt_token_ids": _tokens(9, 5)}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(fp8_dir), fp8_backend="torch", **options) as llm:
        assert llm.client.ready_detail["worker/0"]["fp8"] == "torch"
        forced = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(fp8_dir), **options) as llm:  # auto: the torch backend on the CPU, so the same tokens
        assert llm.client.ready_detail["worker/0"]["fp8"] == "torch"
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == forced
    with pytest.raises(ActorFailure, match="has no FP8 weights"):
        LLM(str(float_dir), fp8_backend="torch", **options)
    dense = write_tiny_engine_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ActorFailure, match=r"Qwen3ForCausalLM\) takes no fp8_backend='triton'"):
        LLM(str(dense), fp8_backend="triton", kv_cache_blocks=64, block_size=4)
