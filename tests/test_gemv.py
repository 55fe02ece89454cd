"""The one-row linear kernel (kernels/triton/gemv.py) against F.linear, and its dispatch (kernels/linear.py).

Without CUDA the kernel runs under triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first); a
child process compiles it for Hopper (sm_90), and `gpu` tests add real shapes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

from flotilla.kernels import linear as linear_module  # noqa: E402


def _case(n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5).to(dtype)
    x = torch.randn(1, k, generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize(("n", "k", "block_n", "block_k", "bias", "dtype"), [
    (24, 40, 8, 16, False, torch.float32),  # K past several steps, the last one partial
    (13, 64, 8, 64, True, torch.float32),  # N not a multiple of the rows per program; a bias
    (40, 24, 16, 1024, False, torch.float16),  # a K step wider than K
])  # fmt: skip
def test_gemv_matches_f_linear(n, k, block_n, block_k, bias, dtype):
    from flotilla.kernels.triton.gemv import gemv

    x, w, b = _case(n, k, dtype, seed=n + k, bias=bias)
    got = gemv(x, w, b, block_n=block_n, block_k=block_k)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert gemv(x.view(-1), w, b, block_n=block_n, block_k=block_k).shape == (n,)  # one row without the batch dim


@pytest.mark.parametrize(("n", "k"), [(9, 40), (4, 3000)])  # one K step narrower than the tile; two, the last partial
def test_gemv_with_its_default_tiles_matches_f_linear(n, k):
    from flotilla.kernels.triton.gemv import gemv

    x, w, b = _case(n, k, torch.float32, seed=n, bias=True)
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_gemv_widens_a_bf16_row_against_float32_weights_into_a_float32_output():
    """A MoE router's logits (kernels/linear.linear_float32): bf16 hidden state, float32 weight, float32 logits."""
    from flotilla.kernels.triton.gemv import gemv

    x, w, _ = _case(24, 200, torch.float32, seed=5)
    xh = x.to(torch.bfloat16)
    got = gemv(xh, w, block_n=8, block_k=64, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(xh.float(), w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear_module.linear_float32(xh, w), F.linear(xh.float(), w))  # CPU: F.linear


def test_gemv_refuses_more_than_one_row():
    from flotilla.kernels.triton.gemv import gemv

    x, w, _ = _case(8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="one row of 16 values"):
        gemv(torch.cat([x, x]), w)


def test_linear_is_f_linear_unless_switched_on_for_one_row_on_cuda(monkeypatch):
    """kernels/linear.linear: F.linear for anything but a single bf16/fp16 row on CUDA (unless FLOTILLA_GEMV=0)."""
    calls = []
    from flotilla.kernels.triton import gemv as gemv_module

    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x, w, b = _case(24, 40, torch.float32, seed=1, bias=True)
    for on in (False, True):
        monkeypatch.setattr(linear_module, "GEMV", on)
        torch.testing.assert_close(linear_module.linear(x, w, b), F.linear(x, w, b))
        torch.testing.assert_close(linear_module.linear(torch.cat([x, x]), w, b), F.linear(torch.cat([x, x]), w, b))
    assert calls == []  # float32 (and, on this machine, no CUDA): never the kernel
    if ON_CUDA:
        xh, wh, bh = (t.to(torch.bfloat16) for t in (x, w, b))
        linear_module.linear(xh, wh, bh)
        assert calls == [(1, 40)]
        strided = torch.cat([xh, xh], dim=1)[:, ::2]  # a row that is not contiguous: F.linear takes it
        torch.testing.assert_close(linear_module.linear(strided, wh, bh), F.linear(strided, wh, bh))
        assert calls == [(1, 40)]


@pytest.mark.slow
def test_gemv_compiles_for_sm90_without_a_gpu(tmp_path):
    from helpers_triton import compile_for_sm90

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"}
    compile_for_sm90([("flotilla.kernels.triton.gemv", "_gemv_kernel", pointers, [],
                       dict(HAS_BIAS=has_bias, BLOCK_N=4, BLOCK_K=2048), 8) for has_bias in (False, True)],
                     tmp_path)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("n", "k"), [(5120, 2048), (2048, 4096), (128, 2048), (4096, 12288)])
def test_gpu_gemv_at_qwen3_shapes(n, k):
    from flotilla.kernels.triton.gemv import gemv

    x, w, _ = _case(n, k, torch.bfloat16, seed=n)
    got = gemv(x, w)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_router_logits_in_float32_at_deepseek_v3_shape():
    x, w, _ = _case(256, 7168, torch.float32, seed=11)
    xh = x.to(torch.bfloat16)
    got = linear_module.linear_float32(xh, w)
    assert got.dtype == torch.float32 and got.shape == (1, 256)
    torch.testing.assert_close(got, F.linear(xh.float(), w), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_gpu_engine_with_the_gemv_kernel_gives_the_cublas_greedy_tokens(tmp_path, monkeypatch):
    """With the kernel on (the default; here the switch flipped in this process, an inline engine) batch-1 decode
    graphs capture it for every float linear layer; the greedy tokens are cuBLAS's (FLOTILLA_GEMV=0)."""
    from helpers_engine import write_tiny_engine_model

    from flotilla import LLM, SamplingParams

    model = str(write_tiny_engine_model(tmp_path / "hd64", "qwen3_hd64"))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(linear_module, "GEMV", on)
        with LLM(model, kv_cache_blocks=256, block_size=16, device="cuda", dtype="bfloat16", placement="inline") as llm:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            outs[on] = [list(llm.generate({"prompt_token_ids": [5 + i, 9, 17, 3 + i]}, params, use_tqdm=False)[0]
                             .outputs[0].token_ids) for i in range(3)]  # one at a time: batch-1 decode steps
    assert outs[True] == outs[False]
