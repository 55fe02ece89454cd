"""The FP8 (W8A16) few-row linear kernel (kernels/quant/fp8_gemv.py) against the dequantized layer, and its dispatch
from the triton FP8 backend (kernels/quant/fp8_triton.py).

Without CUDA the kernel runs under triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first); a
child process compiles it for an H200 (sm_90), and `gpu` tests add DeepSeek-V3's shapes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from flotilla.kernels.quant.fp8_ref import block_quantize, fp8_block_linear, fp8_block_linear_w8a8

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def _case(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    # rows of different magnitudes per block, so a wrong block scale shows
    w = torch.randn(n, k, generator=gen, device=DEVICE) * torch.rand(n, 1, generator=gen, device=DEVICE) * k**-0.5
    q, s = block_quantize(w, block)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, q, s, b


def _dequantized(x, q, s, b, block):
    """The torch backend's layer (weights dequantized) computed in float32."""
    return fp8_block_linear(x.float(), q, s, None if b is None else b.float(), block)


@pytest.mark.parametrize(("m", "n", "k", "block", "block_n", "block_k", "bias"), [
    (1, 24, 80, (16, 16), 4, 32, False),  # K over several steps, the last partial; 5 K blocks
    (1, 13, 48, (8, 16), 8, 64, True),  # N not a multiple of the rows per program; a bias; one step wider than K
    (3, 20, 40, (4, 8), 4, 64, False),  # three rows (BLOCK_M 4: a padding row), scale blocks narrower than a step
    (4, 16, 64, (16, 32), 2, 256, True),  # four rows, the step shrinks to 64 per row
])  # fmt: skip
def test_fp8_gemv_matches_the_dequantized_layer(m, n, k, block, block_n, block_k, bias):
    from flotilla.kernels.quant.fp8_gemv import fp8_gemv

    x, q, s, b = _case(m, n, k, block, torch.float32, seed=m + n + k, bias=bias)
    got = fp8_gemv(x, q, s, b, block, block_n=block_n, block_k=block_k)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, _dequantized(x, q, s, b, block), atol=1e-5, rtol=1e-5)


def test_fp8_gemv_keeps_leading_dims_and_bf16():
    from flotilla.kernels.quant.fp8_gemv import fp8_gemv

    x, q, s, _ = _case(2, 16, 96, (8, 32), torch.bfloat16, seed=3)
    got = fp8_gemv(x.view(2, 1, 96), q, s, None, (8, 32))
    assert got.shape == (2, 1, 16) and got.dtype == torch.bfloat16
    want = _dequantized(x, q, s, None, (8, 32))
    torch.testing.assert_close(got.view(2, 16).float(), want, atol=2e-2, rtol=2e-2)
    # closer to the dequantized layer than the W8A8 GEMM's reference, which rounds the activations to e4m3
    w8a8 = fp8_block_linear_w8a8(x.float(), q, s, None, (8, 32))
    assert (got.view(2, 16).float() - want).norm() < (w8a8 - want).norm()


def test_fp8_gemv_refuses_what_it_cannot_take():
    from flotilla.kernels.quant.fp8_gemv import MAX_ROWS, fp8_gemv

    x, q, s, _ = _case(MAX_ROWS + 1, 16, 32, (16, 16), torch.float32, seed=1)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        fp8_gemv(x, q, s)
    with pytest.raises(ValueError, match="block_n 32 must be a power of two dividing"):
        fp8_gemv(x[:1], q, s, None, (16, 16), block_n=32)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_gemv(x[:1, ::2], q[:, :16], s[:, :1], None, (16, 16))


@pytest.mark.slow
def test_fp8_gemv_compiles_for_sm90_without_a_gpu(tmp_path):
    from helpers_triton import compile_for_sm90

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}
    consts = dict(BLOCK_SCALE_N=128, BLOCK_SCALE_K=128, HAS_BIAS=False, BLOCK_N=4)
    compile_for_sm90([("flotilla.kernels.quant.fp8_gemv", "_fp8_gemv_kernel", pointers, [],
                       dict(consts, BLOCK_M=bm, BLOCK_K=4096 // bm), 8) for bm in (1, 4)], tmp_path)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432)])
def test_gpu_fp8_gemv_at_deepseek_v3_shapes(m, n, k):
    from flotilla.kernels.quant.fp8_gemv import fp8_gemv

    x, q, s, _ = _case(m, n, k, (128, 128), torch.bfloat16, seed=n + m)
    want = _dequantized(x, q, s, None, (128, 128))
    got = fp8_gemv(x, q, s, None, (128, 128)).float()
    assert ((got - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_triton_fp8_backend_sends_few_rows_to_the_gemv(monkeypatch):
    """fp8_triton.fp8_block_linear: up to MAX_ROWS rows on CUDA take fp8_gemv (W8A16, near the dequantized layer);
    more rows, or FLOTILLA_FP8_GEMV off, take the W8A8 GEMM (its reference's values)."""
    from flotilla.kernels.quant import fp8_gemv as gemv_module
    from flotilla.kernels.quant.fp8_triton import fp8_block_linear as triton_linear

    calls = []
    real = gemv_module.fp8_gemv
    monkeypatch.setattr(gemv_module, "fp8_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x, q, s, b = _case(6, 512, 1024, (128, 128), torch.bfloat16, seed=7, bias=True)
    for m in (1, 4, 5):
        got = triton_linear(x[:m], q, s, b, (128, 128)).float()
        ref = _dequantized(x[:m], q, s, b, (128, 128)) if m <= 4 else fp8_block_linear_w8a8(x[:m], q, s, b).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert calls == [1, 4]
    monkeypatch.setattr(gemv_module, "GEMV", False)
    triton_linear(x[:1], q, s, b, (128, 128))
    assert calls == [1, 4]
