"""The flash_mla MLA backend (kernels/mla/flash_mla_backend.py).

On CPU a torch stand-in with FlashMLA's contract (written here from its documented interface, not from our
reference) checks the adapter: the query and cache views, the output's shape, and that the scheduler metadata
is made once per step and shared by every layer. The `gpu` tests run the real FlashMLA at DeepSeek-V3's sizes
against the float32 reference, and through the whole engine (eager and in CUDA graphs) against triton MLA.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from flotilla.kernels.mla import flash_mla_backend as fmb
from flotilla.kernels.mla import mla_cache_shape, torch_ref
from helpers_mla import mla_step
from helpers_tiny_models import write_flash_mla_shaped_deepseek

ON_HOPPER = fmb.flash_mla_usable()


def _decode_batch(seq_lens, heads, dtype=torch.bfloat16, seed=0, device="cpu"):
    """A decode step over 64-token blocks: (q_latent [B, H, 512], q_pe [B, H, 64], cache, meta)."""
    return mla_step([n - 1 for n in seq_lens], [1] * len(seq_lens), fmb.LATENT, fmb.ROPE, heads, fmb.BLOCK_SIZE, seed,
                    device, dtype)  # fmt: skip


class _StandIn:
    """FlashMLA's dense decode contract in plain torch: q [B, s_q, H, 576], k_cache [blocks, 64, 1, 576], block_table
    [B, max_blocks] int32, cache_seqlens [B] int32 -> (out [B, s_q, H, head_dim_v], lse); keys are whole rows, values
    their first head_dim_v entries; causal: query i of s_q sees keys up to cache_seqlens - s_q + i (its tests' mask,
    bottom-right aligned). Records the scheduler objects it was handed."""

    def __init__(self) -> None:
        self.scheds: list[object] = []

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return SimpleNamespace(have_initialized=False), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits=None,
                               softmax_scale=None, causal=False):  # fmt: skip
        assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape[2] == 1 and causal
        assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32 and num_splits is None
        self.scheds.append(sched)
        sched.have_initialized = True
        s_q = q.shape[1]
        outs = []
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            keys = k_cache[block_table[b].long()].reshape(-1, k_cache.shape[-1])[:n].float()  # [n, 576]
            scores = torch.einsum("shd,nd->shn", q[b].float(), keys) * softmax_scale  # [s_q, H, n]
            visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]  # [s_q, n]
            probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
            outs.append(probs @ keys[:, :head_dim_v])  # [s_q, H, head_dim_v]
        return torch.stack(outs).to(q.dtype), None


def test_the_adapter_gives_the_reference_and_shares_one_schedule_per_step():
    stand_in = _StandIn()
    q_latent, q_pe, cache, meta = _decode_batch([1, 70, 200, 64], heads=4)
    want = torch_ref.paged_mla(q_latent.float(), q_pe.float(), cache.float(), meta, scale=0.05)
    for _layer in range(3):  # three layers of one step
        got = fmb.paged_mla_decode(q_latent, q_pe, cache, meta, 0.05, flash_mla=stand_in)
        assert got.shape == q_latent.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    assert len(stand_in.scheds) == 3 and len({id(s) for s in stand_in.scheds}) == 1
    next_step = dataclasses.replace(meta, backend_state={})  # the next step's metadata (same shapes here)
    fmb.paged_mla_decode(q_latent, q_pe, cache, next_step, 0.05, flash_mla=stand_in)
    assert stand_in.scheds[-1] is not stand_in.scheds[0]  # a new step schedules anew


@pytest.mark.parametrize("s_q", [2, 4])
def test_the_adapter_takes_a_speculating_steps_same_few_new_tokens_per_sequence(s_q):
    """A verify pass: s_q new tokens for each sequence, causal within them, as one FlashMLA call; steps with other
    shapes are refused (paged_mla sends them to triton's prefill kernel)."""
    stand_in = _StandIn()
    lens = [s_q + 3, 70, 200, 64]
    q_latent, q_pe, cache, meta = mla_step([n - s_q for n in lens], [s_q] * 4, fmb.LATENT, fmb.ROPE, 4,
                                           fmb.BLOCK_SIZE, 1, "cpu", torch.bfloat16)  # fmt: skip
    assert fmb.uniform_query_len(q_latent.shape[0], meta) == s_q
    want = torch_ref.paged_mla(q_latent.float(), q_pe.float(), cache.float(), meta, scale=0.05)
    got = fmb.paged_mla_decode(q_latent, q_pe, cache, meta, 0.05, flash_mla=stand_in)
    assert got.shape == q_latent.shape
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    mixed = mla_step([10, 60], [s_q, 1], fmb.LATENT, fmb.ROPE, 4, fmb.BLOCK_SIZE, 2, "cpu", torch.bfloat16)
    assert fmb.uniform_query_len(mixed[0].shape[0], mixed[3]) == 0
    with pytest.raises(ValueError, match="same number of new tokens"):
        fmb.paged_mla_decode(*mixed, 0.05, flash_mla=stand_in)
    long = mla_step([10], [fmb.MAX_UNIFORM_QUERY + 1], fmb.LATENT, fmb.ROPE, 4, fmb.BLOCK_SIZE, 3, "cpu",
                    torch.bfloat16)  # fmt: skip
    assert fmb.uniform_query_len(long[0].shape[0], long[3]) == 0  # a prefill chunk: triton's kernel


def test_decode_and_speculating_steps_go_to_flash_mla_and_prefills_to_triton(monkeypatch):
    """paged_mla: decode steps (any batch) and speculating steps (several new tokens each) to FlashMLA, prefills to
    triton's prefill kernel."""
    from flotilla.kernels.mla import triton_mla

    calls = []
    monkeypatch.setattr(fmb, "paged_mla_decode", lambda *a, **k: calls.append("flash_mla"))
    monkeypatch.setattr(triton_mla, "paged_mla_prefill", lambda *a, **k: calls.append("triton_prefill"))
    for lens in ([5], [5, 9, 70]):
        fmb.paged_mla(*_decode_batch(lens, heads=2), 0.1)
    verify = mla_step([10, 20], [2, 2], fmb.LATENT, fmb.ROPE, 2, fmb.BLOCK_SIZE, 0, "cpu", torch.bfloat16)
    prefill = mla_step([0], [9], fmb.LATENT, fmb.ROPE, 2, fmb.BLOCK_SIZE, 0, "cpu", torch.bfloat16)
    fmb.paged_mla(*verify, 0.1)
    fmb.paged_mla(*prefill, 0.1)
    assert calls == ["flash_mla", "flash_mla", "flash_mla", "triton_prefill"]


def test_layouts_flash_mla_cannot_read_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="block_size 64"):
        fmb.check_cache(torch.zeros(mla_cache_shape(4, 16, 512, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        fmb.check_cache(torch.zeros(mla_cache_shape(4, 64, 256, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="triton MLA backend for an FP8 cache"):
        fmb.check_cache(torch.zeros(mla_cache_shape(4, 64, 512, 64), dtype=torch.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU with flash_mla")
@pytest.mark.parametrize(("batch", "heads"), [(1, 128), (64, 128), (8, 16)])
def test_flash_mla_matches_the_float32_reference_at_deepseek_v3_sizes(batch, heads):
    lens = [random.Random(batch).randint(1, 3000) for _ in range(batch)]
    q_latent, q_pe, cache, meta = _decode_batch(lens, heads, seed=batch, device="cuda")
    want = torch_ref.paged_mla(q_latent.float(), q_pe.float(), cache.float(), meta, scale=0.1)
    got = fmb.paged_mla_decode(q_latent, q_pe, cache, meta, 0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU with flash_mla")
@pytest.mark.parametrize(("batch", "s_q"), [(1, 2), (16, 2), (4, 4)])
def test_flash_mla_verify_pass_matches_the_float32_reference(batch, s_q):
    """s_q new tokens per sequence in one FlashMLA call (a speculating step's verify pass), causal within them."""
    lens = [random.Random(batch + s_q).randint(s_q, 3000) for _ in range(batch)]
    q_latent, q_pe, cache, meta = mla_step([n - s_q for n in lens], [s_q] * batch, fmb.LATENT, fmb.ROPE, 128,
                                           fmb.BLOCK_SIZE, batch, "cuda", torch.bfloat16)  # fmt: skip
    want = torch_ref.paged_mla(q_latent.float(), q_pe.float(), cache.float(), meta, scale=0.1)
    got = fmb.paged_mla_decode(q_latent, q_pe, cache, meta, 0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU with flash_mla")
def test_the_engine_on_flash_mla_gives_the_same_tokens_in_cuda_graphs_as_eager(tmp_path):
    from flotilla import LLM, SamplingParams

    model = str(write_flash_mla_shaped_deepseek(tmp_path / "ds"))
    rng = random.Random(5)
    ps = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 150))] for _ in range(10)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    outs = {}
    for eager in (True, False):
        with LLM(model, block_size=64, kv_cache_blocks=64, device="cuda", dtype="bfloat16", max_num_seqs=16,
                 attention_backend="flash_mla", enforce_eager=eager, placement="inline",
                 skip_tokenizer_init=True) as engine:  # fmt: skip
            assert engine.client.ready_detail["worker/0"]["attention"] == "mla_flash_mla"
            assert (engine.client.runtime.actors["worker/0"].runner.graphs is None) == eager
            outs[eager] = [o.outputs[0].token_ids for o in engine.generate(
                [{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
    assert outs[False] == outs[True]
