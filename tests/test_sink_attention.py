"""The sink-attention kernel (kernels/triton/sink_attention.py, DeepSeek-V4's attention) against a torch reference:
keys named by offsets into a flat cache at any column of a row, -1 holes anywhere in a list, one split and several
(the sinks then join the merge), a token without any key, bf16. Runs under TRITON_INTERPRET=1 on the CPU
(tests/conftest.py sets it without CUDA); the `gpu` test adds DeepSeek-V4-Flash's sizes on a device."""

from __future__ import annotations

import pytest
import torch
from helpers_triton import compile_for_sm90, kernel_test_module

INTERPRET, ON_CUDA, DEVICE = kernel_test_module()

from flotilla.kernels.triton.sink_attention import sink_attention  # noqa: E402


def reference(q: torch.Tensor, cache: torch.Tensor, offsets: torch.Tensor, sinks: torch.Tensor,
              scale: float) -> torch.Tensor:
    """softmax over the listed keys and the sink, in float32 (transformers' DeepSeek-V4 attention, keys gathered)."""
    d = q.shape[-1]
    valid = offsets >= 0
    index = offsets.clamp(min=0)[..., None] + torch.arange(d, device=q.device)
    keys = cache.float()[index].masked_fill(~valid[..., None], 0.0)  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.cat([logits, sinks.float()[None, :, None].expand(q.shape[0], -1, 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def _inputs(tokens: int, heads: int, dim: int, keys: int, seed: int, dtype=torch.float32, row: int = 3):
    """Rows of `row` * dim values (keys at any of their columns), lists with holes, the last token's list empty."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rows = 4 * keys
    cache = torch.randn(rows * row * dim, generator=gen, device=DEVICE).to(dtype)
    starts = torch.randint(0, rows, (tokens, keys), generator=gen, device=DEVICE) * row * dim
    starts += torch.randint(0, row, (tokens, keys), generator=gen, device=DEVICE) * dim
    holes = torch.rand(tokens, keys, generator=gen, device=DEVICE) < 0.3
    offsets = torch.where(holes, -1, starts)
    offsets[-1] = -1
    q = torch.randn(tokens, heads, dim, generator=gen, device=DEVICE).to(dtype)
    sinks = torch.randn(heads, generator=gen, device=DEVICE)
    return q, cache, offsets.contiguous(), sinks


@pytest.mark.parametrize(("heads", "dim", "keys", "num_splits"), [
    (4, 32, 40, 1), (4, 32, 40, 3), (20, 16, 100, None), (3, 64, 17, 2),
])  # fmt: skip
def test_the_kernel_matches_the_reference(heads, dim, keys, num_splits):
    q, cache, offsets, sinks = _inputs(5, heads, dim, keys, seed=heads + keys)
    want = reference(q, cache, offsets, sinks, 0.3)
    got = sink_attention(q, cache, offsets, sinks, 0.3, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # no key: only the sink, which carries no value


def test_a_sink_takes_its_share_of_the_softmax():
    """One key of score 0 beside a sink of logit 0: half the weight on the key's value."""
    cache = torch.ones(16, device=DEVICE)
    q = torch.zeros(1, 1, 16, device=DEVICE)
    got = sink_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64, device=DEVICE),
                         torch.zeros(1, device=DEVICE), 1.0)
    torch.testing.assert_close(got, torch.full_like(got, 0.5))


def test_bf16_inputs():
    q, cache, offsets, sinks = _inputs(4, 8, 64, 70, seed=9, dtype=torch.bfloat16)
    want = reference(q, cache, offsets, sinks, 0.125)
    for splits in (1, 4):
        got = sink_attention(q, cache, offsets, sinks, 0.125, num_splits=splits)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 500])
def test_gpu_kernel_at_deepseek_v4_flash_sizes(tokens):
    """64 heads of 512, a window of 128 plus 512 chosen entries, bf16."""
    q, cache, offsets, sinks = _inputs(tokens, 64, 512, 640, seed=tokens, dtype=torch.bfloat16)
    want = reference(q, cache, offsets, sinks, 512**-0.5)
    torch.testing.assert_close(sink_attention(q, cache, offsets, sinks, 512**-0.5).float(), want, atol=2e-2,
                               rtol=2e-2)


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90_at_deepseek_v4_sizes(tmp_path):
    """The interpreter checks little of triton's typing: compile for an H100/H200 (sm_90) in a child process."""
    mod = "flotilla.kernels.triton.sink_attention"
    ptrs = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "off_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": "*bf16",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    compile_for_sm90([(mod, "_sink_attention_kernel", ptrs, ["sm_scale_log2"],
                       dict(BLOCK_H=16, BLOCK_N=32, BLOCK_D=512, DIRECT_OUT=direct, DOT_PRECISION="tf32"), 8)
                      for direct in (True, False)], tmp_path)
