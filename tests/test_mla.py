"""The paged MLA torch reference (kernels/mla) against a per-sequence, per-token softmax attention written out
by hand, on fresh random inputs: mixed batches of prefill chunks over a cached prefix and decodes, blocks in
shuffled order, never-written cache rows NaN; the store's padding rule; the backend choice."""

from __future__ import annotations

import random

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.mla import available_mla_backends, get_mla_backend, mla_cache_shape
from flotilla.kernels.mla.torch_ref import paged_mla, store_latent

RANK, ROPE, HEADS = 16, 8, 3


def _naive(q_latent: torch.Tensor, q_pe: torch.Tensor, latents: list[torch.Tensor], cached: list[int],
           new: list[int], scale: float) -> torch.Tensor:  # fmt: skip
    """Every new token of every sequence, one at a time: softmax over its visible rows of [c_kv | k_pe]."""
    out, t = [], 0
    for rows, c, n in zip(latents, cached, new, strict=True):
        for i in range(n):
            visible = rows[: c + i + 1]  # [S, RANK + ROPE]
            q = torch.cat((q_latent[t], q_pe[t]), dim=-1)  # [H, RANK + ROPE]
            probs = torch.softmax((q @ visible.T) * scale, dim=-1)  # [H, S]
            out.append(probs @ visible[:, :RANK])
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_mla_matches_naive_attention_over_mixed_batches(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 64
    cache = torch.full(mla_cache_shape(num_blocks, block_size, RANK, ROPE), float("nan"))
    free = list(range(num_blocks))
    random.Random(block_size).shuffle(free)
    # prefill from empty, a chunk over a cached prefix, two decodes (one with a long context)
    cached, new = [0, 5, 9, 1], [7, 4, 1, 1]
    latents = [torch.randn(c + n, RANK + ROPE, generator=gen) for c, n in zip(cached, new, strict=True)]
    tables = []
    for c, n in zip(cached, new, strict=True):
        tables.append([free.pop() for _ in range(-(-(c + n) // block_size))])
    # the cached prefixes were stored by earlier steps
    prefix = AttentionMetadata.from_lists([0] * 4, [max(c, 1) for c in cached], tables, block_size)
    rows = torch.cat([lat[: max(c, 1)] for lat, c in zip(latents, cached, strict=True)])
    keep = torch.cat([torch.arange(max(c, 1)) < c for c in cached])
    slots = torch.where(keep, prefix.slot_mapping, -1)  # a sequence with nothing cached stores nothing
    store_latent(rows[:, :RANK], rows[:, RANK:], cache, slots)

    meta = AttentionMetadata.from_lists(cached, new, tables, block_size)
    step_rows = torch.cat([lat[c:] for lat, c in zip(latents, cached, strict=True)])
    store_latent(step_rows[:, :RANK], step_rows[:, RANK:], cache, meta.slot_mapping)
    q_latent = torch.randn(sum(new), HEADS, RANK, generator=gen)
    q_pe = torch.randn(sum(new), HEADS, ROPE, generator=gen)
    got = paged_mla(q_latent, q_pe, cache, meta, scale=0.3)
    want = _naive(q_latent, q_pe, latents, cached, new, scale=0.3)
    assert got.shape == (sum(new), HEADS, RANK)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_store_latent_skips_padding_slots() -> None:
    cache = torch.zeros(mla_cache_shape(2, 4, RANK, ROPE))
    c_kv, k_pe = torch.ones(3, RANK), torch.full((3, ROPE), 2.0)
    store_latent(c_kv, k_pe, cache, torch.tensor([5, -1, 0]))
    assert cache[1, 1, :RANK].eq(1).all() and cache[1, 1, RANK:].eq(2).all() and cache[0, 0].ne(0).all()
    assert int(cache.ne(0).any(dim=-1).sum()) == 2  # the padding token wrote nowhere


def test_backend_choice_and_errors() -> None:
    assert get_mla_backend("auto", device=torch.device("cpu")).name == "torch"
    assert available_mla_backends()[:2] == ["auto", "torch"]  # + "triton" where triton can run
    with pytest.raises(ValueError, match="unknown MLA backend 'flash_mla'; choices: auto, torch"):
        get_mla_backend("flash_mla")
