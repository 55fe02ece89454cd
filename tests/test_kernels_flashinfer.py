"""FlashInfer backend vs the torch reference on fresh random inputs (runs on a CUDA machine with flashinfer)."""

from __future__ import annotations

import random

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata, kv_cache_shape
from flotilla.kernels.attention import flashinfer_backend
from flotilla.kernels.attention.torch_ref import paged_attention, store_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not flashinfer_backend.importable(),
                                                  reason="needs CUDA and flashinfer")]


def _case(seqs: list[tuple[int, int]], block_size: int = 16, num_heads: int = 32, num_kv_heads: int = 8,
          head_dim: int = 128, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 8
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size, device="cuda")
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)  # context = random history
    tokens = sum(n for _, n in seqs)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    return meta, cache, q, k, v


@pytest.mark.parametrize("seqs", [
    [(2000, 1)] * 64,                                        # decode batch at 2k context
    [(0, 300), (128, 64), (1000, 1), (17, 1), (0, 5)],       # mixed: prefills, a chunk over a cached prefix, decodes
    [(0, 1024)],                                             # one long prefill
], ids=["decode64x2k", "mixed", "prefill1k"])
def test_flashinfer_matches_the_torch_reference(seqs):
    meta, cache, q, k, v = _case(seqs)
    fi = flashinfer_backend.FlashInferAttention()
    ref_cache, fi_cache = cache.clone(), cache.clone()
    store_kv(k, v, ref_cache, meta.slot_mapping)
    fi.store_kv(k, v, fi_cache, meta.slot_mapping)
    assert torch.equal(ref_cache, fi_cache)
    scale = 128 ** -0.5
    want = paged_attention(q, ref_cache, meta, scale).float()
    got = fi.forward(q, fi_cache, meta, scale).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    again = fi.forward(q, fi_cache, meta, scale)  # the same step's next layer reuses the plan
    torch.testing.assert_close(again.float(), got)
