"""Torch reference kernels against independent oracles: naive per-sequence attention, direct formulas,
and transformers' own RoPE."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from flotilla.kernels.activation import silu_and_mul
from flotilla.kernels.attention import (
    AttentionMetadata,
    get_attention_backend,
    kv_cache_shape,
    positions_from_lists,
)
from flotilla.kernels.attention.torch_ref import paged_attention, store_kv
from flotilla.kernels.norm import fused_add_rms_norm, rms_norm
from flotilla.kernels.rope import apply_rope, rope_cos_sin_cache


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Oracle for one sequence in float64: q [n, Hq, D] are the last n of the L positions of k/v [L, Hkv, D]."""
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_paged_attention_matches_per_sequence_oracle(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads)
    head_dim = 16
    # (cached, new): fresh prefill, decode, prefill chunk over a cached prefix, long decode, short prefill.
    seqs = [(0, 9), (5, 1), (13, 6), (37, 1), (0, 2)]
    num_blocks = 64 if block_size > 1 else 160
    kv_cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    free = list(range(num_blocks))
    random.Random(block_size).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size)

    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in seqs]
    for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v, strict=True):
        for pos in range(cached):  # oracle-side write of the already-cached context
            kv_cache[table[pos // block_size], 0, pos % block_size] = k[pos]
            kv_cache[table[pos // block_size], 1, pos % block_size] = v[pos]
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v, strict=True)])
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    store_kv(new_k, new_v, kv_cache, meta.slot_mapping)
    out = paged_attention(query, kv_cache, meta, scale)

    expected = torch.cat(
        [
            _naive_attention(q, k, v, scale)
            for q, k, v in zip(query.split([n for _, n in seqs]), full_k, full_v, strict=True)
        ]
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_single_decode_batch_and_bf16() -> None:
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_dim = 4, 2, 8
    seqs = [(11, 1), (3, 1), (20, 1)]
    kv_cache = torch.randn(kv_cache_shape(32, block_size, num_kv_heads, head_dim), generator=gen)
    tables = [[5, 9, 1], [30], [2, 7, 8, 20, 21, 3]]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [1, 1, 1], tables, block_size)
    query = torch.randn(3, 4, head_dim, generator=gen)
    out32 = paged_attention(query, kv_cache, meta, 0.3)
    out16 = paged_attention(query.bfloat16(), kv_cache.bfloat16(), meta, 0.3)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)
    for b, ((cached, _), table) in enumerate(zip(seqs, tables, strict=True)):
        k = torch.stack([kv_cache[table[p // block_size], 0, p % block_size] for p in range(cached + 1)])
        v = torch.stack([kv_cache[table[p // block_size], 1, p % block_size] for p in range(cached + 1)])
        expected = _naive_attention(query[b : b + 1], k, v, 0.3)
        torch.testing.assert_close(out32[b : b + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_exactly_the_mapped_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim = 4, 2, 8
    kv_cache = torch.randn(kv_cache_shape(10, block_size, num_kv_heads, head_dim), generator=gen)
    before = kv_cache.clone()
    slots = torch.tensor([0, 7, 13, -1, 39, 22], dtype=torch.int64)  # -1 = padding token, not stored
    key = torch.randn(6, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(6, num_kv_heads, head_dim, generator=gen)

    store_kv(key, value, kv_cache, slots)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 0, slot % block_size] = key[t]
            expected[slot // block_size, 1, slot % block_size] = value[t]
    assert torch.equal(kv_cache, expected)
    assert not torch.equal(kv_cache, before)


def test_metadata_from_lists() -> None:
    meta = AttentionMetadata.from_lists([0, 5, 2], [3, 1, 2], [[7, 2], [4, 1], [9]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [3, 6, 4] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2], [4, 1], [9, 0]] and meta.block_tables.dtype == torch.int32
    # seq 0 positions 0..2 -> block 7; seq 1 position 5 -> block 1 offset 1; seq 2 positions 2, 3 -> block 9.
    assert meta.slot_mapping.tolist() == [28, 29, 30, 5, 38, 39] and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs, meta.num_tokens) == (3, 6, 3, 6)
    assert positions_from_lists([0, 5, 2], [3, 1, 2]).tolist() == [0, 1, 2, 5, 2, 3]
    padded = AttentionMetadata.from_lists([0], [1], [[3]], block_size=4, max_blocks_per_seq=8)
    assert padded.block_tables.shape == (1, 8)
    with pytest.raises(ValueError, match="sequence 1 has 1 blocks but needs 2"):
        AttentionMetadata.from_lists([0, 4], [1, 1], [[1], [2]], block_size=4)


def test_host_metadata_in_flashinfers_csr_form() -> None:
    """The paged cache as FlashInfer's plans take it (the GQA and MLA flashinfer backends share it): each sequence's
    pages in use, concatenated, and how full its last page is."""
    meta = AttentionMetadata.from_lists([0, 5, 2], [3, 1, 2], [[7, 2], [4, 1], [9]], block_size=4)
    indptr, indices, last = meta.host.paged_kv(4)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 1, 3, 4], [7, 4, 1, 9], [3, 2, 4])
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_attention_backend_dispatch() -> None:
    backend = get_attention_backend("torch")
    assert backend.name == "torch" and backend.forward is paged_attention and backend.store_kv is store_kv
    assert get_attention_backend().name == "torch"
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; choices: auto, torch"):
        get_attention_backend("nope")


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ],
)
def test_rope_matches_transformers(rope_scaling: dict | None) -> None:
    head_dim, max_pos, theta = 32, 512, 500000.0
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=rope_scaling,
    )
    hf_rope = LlamaRotaryEmbedding(config=config)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 255, 511, 3], dtype=torch.int64)
    q = torch.randn(len(positions), 4, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)

    cache = rope_cos_sin_cache(head_dim, max_pos, theta, rope_scaling)
    q_out, k_out = apply_rope(positions, q, k, cache)

    cos, sin = hf_rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rope_direct_formula_and_linear_scaling() -> None:
    head_dim, theta = 8, 10000.0
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, head_dim, generator=gen)
    positions = torch.tensor([0, 7, 30])
    for scaling, div in ((None, 1.0), ({"rope_type": "linear", "factor": 4.0}, 4.0)):
        q_out, _ = apply_rope(positions, q, q[:, :1], rope_cos_sin_cache(head_dim, 32, theta, scaling))
        for t, pos in enumerate(positions.tolist()):
            for i in range(head_dim // 2):
                angle = pos / div * theta ** (-2 * i / head_dim)
                x1, x2 = q[t, :, i], q[t, :, i + head_dim // 2]
                expected1 = x1 * math.cos(angle) - x2 * math.sin(angle)
                expected2 = x2 * math.cos(angle) + x1 * math.sin(angle)
                torch.testing.assert_close(q_out[t, :, i], expected1, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(q_out[t, :, i + head_dim // 2], expected2, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        rope_cos_sin_cache(head_dim, 32, theta, {"rope_type": "longrope", "factor": 4.0})


def test_rms_norm_and_fused_residual() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen) * 3
    residual = torch.randn(5, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    eps = 1e-5

    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    torch.testing.assert_close(rms_norm(x, weight, eps), expected)

    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    s = x + residual
    torch.testing.assert_close(new_residual, s)
    torch.testing.assert_close(normed, s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * weight)

    out16 = rms_norm(x.bfloat16(), weight.bfloat16(), eps)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), expected, atol=5e-2, rtol=2e-2)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 4, 2 * 16, generator=torch.Generator().manual_seed(4))
    gate, up = x[..., :16], x[..., 16:]
    torch.testing.assert_close(silu_and_mul(x), gate * torch.sigmoid(gate) * up)
