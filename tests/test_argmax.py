"""Greedy sampling's argmax kernel (kernels/triton/argmax.py) against torch.argmax: the first index of the maximum,
across the ranges a row is cut into and within a lane over several steps; and the sampler's dispatch to it.

Without CUDA the kernel runs under triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first); a child
process compiles it for Hopper (sm_90)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def test_argmax_is_torch_argmax_with_ties_across_ranges_and_within_a_lane():
    from flotilla.kernels.triton.argmax import BLOCK, argmax_rows

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    one = torch.randn(1, 5000, generator=gen, device=DEVICE)  # one row: 3 ranges of BLOCK values
    one[0, 4500] = one[0, 100] = 50.0  # a tie across ranges: the first wins
    assert argmax_rows(one).tolist() == [100] == one.argmax(dim=-1).tolist()
    many = torch.randn(256, 5000, generator=gen, device=DEVICE)  # 256 rows: one range each, 3 steps per lane
    many[7, 10 + BLOCK] = many[7, 10] = 60.0  # a tie within one lane, two steps apart
    many[9, :] = float("-inf")  # nothing larger than -inf: index 0, as torch
    many[11, 4999] = 70.0  # the last value of a partial step
    got = argmax_rows(many)
    assert got.dtype == torch.int64 and torch.equal(got, many.argmax(dim=-1))
    assert got[7].item() == 10 and got[9].item() == 0 and got[11].item() == 4999
    assert argmax_rows(many[:0]).shape == (0,)


def test_the_sampler_takes_the_kernel_on_cuda_only(monkeypatch):
    from flotilla.kernels import sampling
    from flotilla.kernels.triton import argmax as argmax_module

    calls = []
    real = argmax_module.argmax_rows
    monkeypatch.setattr(argmax_module, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(3, 40, device=DEVICE)
    assert torch.equal(sampling.greedy_argmax(logits), logits.argmax(dim=-1))
    assert calls == ([(3, 40)] if ON_CUDA else [])


@pytest.mark.slow
def test_argmax_compiles_for_sm90_without_a_gpu(tmp_path):
    from helpers_triton import compile_for_sm90

    mod = "flotilla.kernels.triton.argmax"
    compile_for_sm90([(mod, "_argmax_partial_kernel", {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32"}, [],
                       dict(BLOCK=2048), 4),
                      (mod, "_argmax_final_kernel", {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64"}, [],
                       dict(BLOCK_S=64), 1)], tmp_path)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("rows", "vocab"), [(1, 129280), (4, 151936), (256, 151936)])
def test_gpu_argmax_at_real_vocabularies(rows, vocab):
    from flotilla.kernels.triton.argmax import argmax_rows

    x = torch.randn(rows, vocab, device="cuda")
    x[:, vocab // 3] = x[:, -1] = 100.0  # ties: the first wins
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
