"""The flashinfer MLA backend (kernels/mla/flashinfer_mla_backend.py).

On CPU a torch stand-in with FlashInfer's BatchMLAPagedAttentionWrapper contract (plan with host page tables, run on
the latent and rope page views; written here from its documented interface, not from our reference) checks the
page tables, the views and the one plan per step, in decode and mixed prefill steps. The `gpu` test runs the real
wrapper against the float32 reference at DeepSeek-V3's sizes.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from flotilla.kernels.mla import flashinfer_mla_backend as fib
from flotilla.kernels.mla import torch_ref
from helpers_mla import mla_step


class _Wrapper:
    """BatchMLAPagedAttentionWrapper's contract in torch: plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads,
    head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_dtype, kv_dtype) with CPU int32 tensors, then
    run(q_nope, q_pe, ckv_cache [pages, page_size, ckv], kpe_cache [pages, page_size, kpe]) -> [T, H, ckv]; causal:
    a sequence's new tokens are its last ones."""

    plans = 0

    def __init__(self, workspace, backend="auto") -> None:
        self.plan_args = None
        self.kv_lens = torch.zeros(64, dtype=torch.int32)  # (FlashInfer's wrapper fills buffers of its own at plan)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type) -> None:  # fmt: skip
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.device.type == "cpu" and t.dtype == torch.int32
        _Wrapper.plans += 1
        self.kv_lens[:len(kv_len_arr)].copy_(kv_len_arr)
        self.plan_args = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(), kv_len_arr.tolist(),
                          page_size, causal, sm_scale)  # fmt: skip

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        qo, kv_indptr, kv_indices, kv_lens, page_size, causal, scale = self.plan_args
        out = torch.empty_like(q_nope)
        for b in range(len(kv_lens)):
            pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
            n = kv_lens[b]
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:n].float()
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n].float()
            q_len = qo[b + 1] - qo[b]
            for i in range(q_len):
                t = qo[b] + i
                visible = n - q_len + i + 1 if causal else n
                s = (q_nope[t].float() @ ckv[:visible].T + q_pe[t].float() @ kpe[:visible].T) * scale
                out[t] = (torch.softmax(s, dim=-1) @ ckv[:visible]).to(out.dtype)
        return out


STAND_IN = SimpleNamespace(mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=_Wrapper))


@pytest.mark.parametrize(("cached", "new"), [([0, 9, 40, 3], [1, 1, 1, 1]),     # decode
                                             ([0, 12, 5], [7, 1, 16]),           # prefill, decode, a chunk
                                             ([], [])])  # fmt: skip
def test_the_adapter_gives_the_reference_and_plans_once_permla_step(cached, new):
    q_latent, q_pe, cache, meta = mla_step(cached, new, rank=32, rope=8, heads=4, block_size=4, seed=len(new))
    before = _Wrapper.plans
    want = torch_ref.paged_mla(q_latent, q_pe, cache, meta, scale=0.2)
    for _layer in range(3):
        got = fib.paged_mla(q_latent, q_pe, cache, meta, 0.2, flashinfer=STAND_IN)
        assert got.shape == q_latent.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert _Wrapper.plans - before == (1 if new else 0)
    fib.paged_mla(q_latent, q_pe, cache, dataclasses.replace(meta, backend_state={}), 0.2, flashinfer=STAND_IN)
    assert _Wrapper.plans - before == (2 if new else 0)  # the next step plans anew


def test_an_fp8_cache_and_a_step_without_host_metadata_are_refused():
    q_latent, q_pe, cache, meta = mla_step([3], [1], rank=32, rope=8, heads=4, block_size=4, seed=1)
    with pytest.raises(ValueError, match="not FP8"):
        fib.paged_mla(q_latent, q_pe, cache.to(torch.float8_e4m3fn), meta, 0.2, flashinfer=STAND_IN)
    with pytest.raises(ValueError, match="host metadata"):
        fib.paged_mla(q_latent, q_pe, cache, dataclasses.replace(meta, host=None), 0.2, flashinfer=STAND_IN)


@pytest.mark.gpu
@pytest.mark.skipif(not fib.flashinfer_mla_usable(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize(("cached", "new"), [([random.Random(1).randint(1, 3000) for _ in range(64)], [1] * 64),
                                             ([0, 700, 31], [300, 1, 64])])  # fmt: skip
def test_flashinfer_mla_matches_the_float32_reference_at_deepseek_v3_sizes(cached, new):
    q_latent, q_pe, cache, meta = mla_step(cached, new, rank=512, rope=64, heads=128, block_size=64, seed=len(new),
                                        device="cuda", dtype=torch.bfloat16)  # fmt: skip
    want = torch_ref.paged_mla(q_latent.float(), q_pe.float(), cache.float(), meta, scale=0.1)
    got = fib.paged_mla(q_latent, q_pe, cache, meta, 0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_a_wrapper_made_under_inference_mode_plans_outside_it():
    """The process keeps one wrapper per device: made in the engine's inference mode, a later step without it (a
    benchmark, a test) still plans into its buffers in place."""
    stand_in = SimpleNamespace(mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=_Wrapper))  # a wrapper of its own
    q_latent, q_pe, cache, meta = mla_step([0, 9], [3, 1], rank=32, rope=8, heads=4, block_size=4, seed=3)
    with torch.inference_mode():
        first = fib.paged_mla(q_latent, q_pe, cache, meta, 0.2, flashinfer=stand_in)
    again = fib.paged_mla(q_latent, q_pe, cache, dataclasses.replace(meta, backend_state={}), 0.2, flashinfer=stand_in)
    torch.testing.assert_close(again, first)
