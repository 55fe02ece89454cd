"""MLA test inputs: one step over a paged latent cache with random rows (tests/test_mla_flash*.py)."""

from __future__ import annotations

import random

import torch

from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.mla import mla_cache_shape, torch_ref


def mla_step(cached: list[int], new: list[int], rank: int, rope: int, heads: int, block_size: int, seed: int,
             device: str = "cpu", dtype: torch.dtype = torch.float32):  # fmt: skip
    """(q_latent, q_pe, cache, meta) of one step: cached tokens already stored, `new` tokens per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    cache = torch.zeros(mla_cache_shape(num_blocks, block_size, rank, rope), device=device, dtype=dtype)
    rows = torch.randn(sum(lens), rank + rope, generator=gen, device=device).to(dtype)
    fill = AttentionMetadata.from_lists([0] * len(lens), lens, tables, block_size, device=device)
    torch_ref.store_latent(rows[:, :rank], rows[:, rank:], cache, fill.slot_mapping)
    meta = AttentionMetadata.from_lists(cached, new, tables, block_size, device=device)
    q_latent = torch.randn(sum(new), heads, rank, generator=gen, device=device).to(dtype)
    q_pe = torch.randn(sum(new), heads, rope, generator=gen, device=device).to(dtype)
    return q_latent, q_pe, cache, meta


def check_triton_mla_matches_torch(model_dir, steps: list[list[tuple[int, list[int]]]]) -> None:
    """A tiny DeepSeek model through the torch and the triton MLA backends (PagedRunner, blocks of 4): every step of
    `steps` gives both the same logits."""
    from safetensors.torch import load_file

    from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
    from flotilla.models.hf_config import load_hf_config
    from helpers_tiny_models import PagedRunner

    config = load_hf_config(model_dir)
    runners = []
    for backend in ("torch", "triton"):
        model = DeepseekV3ForCausalLM(config, attention_backend=backend, fused_ops="torch", moe_backend="torch")
        model.load_weights(load_file(str(model_dir / "model.safetensors")).items())
        assert model.attention_backend_name == f"mla_{backend}"
        runners.append(PagedRunner(model.eval(), block_size=4))
    for batch in steps:
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
