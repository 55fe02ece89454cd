"""The one-launch FP8 activation quantization (kernels/quant/fp8_quant_triton.py) against fp8_ref's torch version:
the same e4m3 bytes and the same float32 scales, bit for bit (on CUDA all but the rare value at a rounding
midpoint: _check_identical says why). On CPU under triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), on CUDA at DeepSeek-V3 sizes in the `gpu` test."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from flotilla.kernels.quant import fp8_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _check_identical(x: torch.Tensor, group: int) -> None:
    """Identical scales and e4m3 bytes, except that zeros compare by value: the kernel's float8 cast writes a
    negative value that rounds to zero as +0 where torch writes -0, under triton's CPU interpreter and on CUDA alike.
    -0 and +0 weigh the same in every GEMM."""
    from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize

    want_q, want_s = fp8_ref.per_token_group_quantize(x, group)
    got_q, got_s = per_token_group_quantize(x, group)
    assert got_q.dtype == fp8_ref.FP8_DTYPE and got_q.shape == want_q.shape and got_s.shape == want_s.shape
    assert torch.equal(got_s, want_s)
    zero = want_q.float() == 0
    assert torch.equal(got_q.float()[zero], want_q.float()[zero])
    got_bytes, want_bytes = got_q.view(torch.uint8), want_q.view(torch.uint8)
    assert torch.equal(got_bytes[~zero], want_bytes[~zero])


@pytest.mark.parametrize(("shape", "group", "dtype"), [
    ((3, 256), 128, torch.bfloat16),
    ((5, 300), 128, torch.float32),     # a partial last group
    ((2, 3, 64), 32, torch.float16),    # leading dims kept
    ((7, 1000), 128, torch.bfloat16),   # more groups than one program takes
    ((1, 7168), 128, torch.bfloat16),   # one token at DeepSeek-V3's hidden size
])  # fmt: skip
def test_the_same_bytes_and_scales_as_the_torch_version(shape, group, dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    x.view(-1)[: group + 5] = 0  # an all-zero group gets the smallest scale, not 0/0
    _check_identical(x, group)


def test_rounding_ties_subnormals_and_the_top_of_the_range() -> None:
    """With 448 in every group the scale is exactly 1, so each value is rounded to e4m3 as it is: ties between
    two e4m3 values go to the even one, subnormals (below 2^-6) to multiples of 2^-9, and 448 stays."""
    ties = [124.0, 116.0, 9.5, 3.375, 0.0703125, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 447.0, 440.0]
    others = [-124.76, 0.01, -0.0009, 1.0625, 2.0**-7 * 1.0625, 300.5, -447.99]
    values = torch.tensor([448.0, *ties, *[-t for t in ties], *others])
    row = torch.cat([values, torch.zeros(64 - values.numel())])
    _check_identical(row.view(1, 64), 64)
    from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize

    q, s = per_token_group_quantize(row.view(1, 64), 64)
    assert s.item() == 1.0
    # spot checks against e4m3's grid: 124 lies between 120 and 128 (mantissas 111 and 000), 116 between 112
    # and 120 (110 and 111), 9.5 between 9 and 10 (001 and 010): the even ones win; 2^-10 lies halfway between 0
    # and 2^-9, and 3 * 2^-10 between 2^-9 and 2^-8: 0 and 2^-8
    assert q.float()[0, :4].tolist() == [448.0, 128.0, 112.0, 10.0]
    assert q.float()[0, 6:8].tolist() == [0.0, 2.0**-8]


def test_empty_input_gives_empty_outputs() -> None:
    from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize

    q, s = per_token_group_quantize(torch.zeros(0, 256), 128)
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_on_cuda_at_deepseek_v3_sizes(tokens) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    for k in (7168, 2048, 1536):
        _check_identical((torch.randn(tokens, k, generator=gen, device="cuda") * 4).bfloat16(), 128)


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90_without_a_gpu(tmp_path) -> None:
    """Compiled for Hopper (sm_90) in a child without the interpreter, for bf16 and float32 activations."""
    from helpers_triton import compile_for_sm90

    specs = [("flotilla.kernels.quant.fp8_quant_triton", "_quant_kernel",
              {"x_ptr": x, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, [],
              dict(GROUP=128, GROUP_P2=128, BLOCK_G=4, FP8_MAX=448.0, FP8_MAX_INV=1 / 448.0, MIN_AMAX=1e-12), 4)
             for x in ("*bf16", "*fp32")]  # fmt: skip
    compile_for_sm90(specs, tmp_path)
