"""DeepSeek Sparse Attention's triton kernels (kernels/mla/dsa_triton.py) against the torch reference (dsa_ref,
torch_ref): the indexer's logits over paged keys (causal within a step's new tokens, shuffled blocks, rows never
written NaN), the top-k choice in bounded slices, sparse MLA over index lists with -1 holes (one split and
several, an FP8 cache), the one-launch key store, and tiny DeepSeek-V3.2 / GLM-5 models through the triton
backend. Runs under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers_triton import compile_for_sm90, kernel_test_module

INTERPRET, ON_CUDA, DEVICE = kernel_test_module()

from flotilla.kernels.attention import AttentionMetadata  # noqa: E402
from flotilla.kernels.attention.fp8_kv import FP8_DTYPE  # noqa: E402
from flotilla.kernels.mla import dsa_ref, dsa_triton, torch_ref  # noqa: E402

RANK, ROPE, INDEX_DIM = 32, 8, 16


def _step(cached: list[int], new: list[int], block_size: int, seed: int, heads: int = 3, index_heads: int = 4,
          cache_dtype: torch.dtype = torch.float32):
    """One step's inputs over a cache of rows [c_kv | k_pe | index key | its scale] in shuffled blocks (unused rows
    NaN): (q_latent, q_pe, index q, index weights, cache, meta)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = RANK + ROPE + dsa_ref.index_part_width(RANK + ROPE, INDEX_DIM)
    cache = torch.full((num_blocks, block_size, width), float("nan"), device=DEVICE).to(cache_dtype)
    rows = torch.randn(sum(lens), RANK + ROPE + INDEX_DIM, generator=gen, device=DEVICE)
    fill = AttentionMetadata.from_lists([0] * len(lens), lens, tables, block_size, device=DEVICE)
    scale = 0.5 if cache_dtype == FP8_DTYPE else 1.0
    torch_ref.store_latent(rows[:, :RANK], rows[:, RANK:RANK + ROPE], cache[..., :RANK + ROPE], fill.slot_mapping,
                           scale)  # fmt: skip
    dsa_ref.store_index_keys(rows[:, RANK + ROPE:], cache[..., RANK + ROPE:], fill.slot_mapping)
    meta = AttentionMetadata.from_lists(cached, new, tables, block_size, device=DEVICE)
    t = sum(new)
    q_latent = torch.randn(t, heads, RANK, generator=gen, device=DEVICE)
    q_pe = torch.randn(t, heads, ROPE, generator=gen, device=DEVICE)
    index_q = torch.randn(t, index_heads, INDEX_DIM, generator=gen, device=DEVICE)
    weights = torch.randn(t, index_heads, generator=gen, device=DEVICE)
    return q_latent, q_pe, index_q, weights, cache, meta


def _reference_logits(q, weights, index_cache, meta, scale) -> torch.Tensor:
    """[T, max_seq_len]: the indexer's scores as dsa_ref computes them, -inf where a token cannot attend."""
    dim = q.shape[-1]
    keys = torch_ref.gather_latent(index_cache[..., :dim], meta, torch.float32)  # [B, S, D]
    scales = dsa_ref.key_scales(index_cache, dim)
    if scales is not None:  # (an FP8 cache: each key over its own scale)
        keys = keys * torch_ref.gather_latent(scales, meta, torch.float32)
    seq = dsa_triton.token_sequences(meta, q.shape[0]).long()
    qsl = meta.query_start_loc.long()
    last = meta.seq_lens.long()[seq] - qsl[seq + 1] + torch.arange(q.shape[0], device=q.device)
    scores = torch.relu(torch.einsum("thd,tsd->ths", q.float(), keys[seq]) * scale)
    logits = torch.einsum("ths,th->ts", scores, weights.float())
    visible = torch.arange(meta.max_seq_len, device=q.device)[None, :] <= last[:, None]
    return logits.masked_fill(~visible, float("-inf"))


# (cached, new) per sequence: decodes, a prefill chunk over a cached prefix, a fresh prompt, a one-token sequence
BATCHES = [([40, 7, 0, 0], [1, 1, 9, 1]), ([0, 25], [30, 3]), ([63], [1])]


@pytest.mark.parametrize(("cached", "new"), BATCHES)
@pytest.mark.parametrize(("block_size", "cache_dtype"), [(4, torch.float32), (16, torch.float32), (4, FP8_DTYPE)])
def test_index_logits_match_the_reference_and_hide_what_a_token_cannot_see(cached, new, block_size, cache_dtype):
    _, _, q, w, cache, meta = _step(cached, new, block_size, seed=block_size + len(new), cache_dtype=cache_dtype)
    index_cache = cache[..., RANK + ROPE:]
    want = _reference_logits(q, w, index_cache, meta, 0.3)
    got = dsa_triton.index_logits(q, w, index_cache, meta, 0.3)
    assert got.shape == want.shape
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = want != float("-inf")
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)
    # a slice of the rows gives those rows' logits; a slice past the step's tokens is refused
    first = q.shape[0] // 2
    torch.testing.assert_close(dsa_triton.index_logits(q, w, index_cache, meta, 0.3, first=first, count=1),
                               got[first:first + 1])
    with pytest.raises(ValueError, match="not among"):
        dsa_triton.index_logits(q, w, index_cache, meta, 0.3, first=first, count=q.shape[0] - first + 1)


def test_keys_one_per_window_of_rate_positions_are_the_rows_ending_each_window():
    """DeepSeek-V4's entries: key i in the row of position i * rate + rate - 1, seen once that position is."""
    _, _, q, w, cache, meta = _step([40, 7, 0], [1, 2, 12], 4, seed=8)
    index_cache = cache[..., RANK + ROPE:]
    every = dsa_triton.index_logits(q, w, index_cache, meta, 0.3)
    for rate in (4, 8):
        got = dsa_triton.index_logits(q, w, index_cache, meta, 0.3, rate=rate)
        assert got.shape == (15, meta.max_seq_len // rate)
        torch.testing.assert_close(got, every[:, rate - 1::rate][:, :got.shape[1]])
        chosen = dsa_triton.select_topk(q, w, index_cache, meta, 3, 0.3, rate=rate)
        for row, logits in zip(chosen.tolist(), got, strict=True):
            seen = int((logits > float("-inf")).sum())
            assert sorted(i for i in row if i >= 0) == sorted(logits.topk(min(3, seen)).indices.tolist())


@pytest.mark.parametrize("topk", [5, 32, 200])
def test_topk_choice_is_the_references_set_in_any_slicing(topk):
    _, _, q, w, cache, meta = _step([40, 7, 0], [1, 2, 12], 4, seed=topk)
    index_cache = cache[..., RANK + ROPE:]
    want = dsa_ref.select_positions(q, w, index_cache, meta, topk, 0.3)
    for logits_bytes in (dsa_triton.LOGITS_BYTES, 1):  # all rows at once, then one row at a time
        got = dsa_triton.select_topk(q, w, index_cache, meta, topk, 0.3, logits_bytes=logits_bytes)
        assert got.shape == want.shape == (15, min(topk, meta.max_seq_len)) and got.dtype == torch.int32
        for g, r in zip(got.tolist(), want.tolist(), strict=True):
            assert sorted(g) == sorted(r)
    # every token keeps exactly min(topk, positions it sees) positions, none after its own
    visible = torch.tensor([41, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert torch.equal((want >= 0).sum(-1), visible.clamp(max=topk))


@pytest.mark.parametrize(("cached", "new"), BATCHES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_sparse_mla_matches_the_reference_over_index_lists_with_holes(cached, new, num_splits):
    q_latent, q_pe, q, w, cache, meta = _step(cached, new, 4, seed=len(new) + (num_splits or 0))
    select = dsa_ref.select_positions(q, w, cache[..., RANK + ROPE:], meta, 6, 0.3)
    select[::3, 0] = -1  # holes anywhere in a list (a split may hold none but holes)
    latent = cache[..., :RANK + ROPE]
    want = torch_ref.paged_mla(q_latent, q_pe, latent, meta, 0.2, select=select)
    got = dsa_triton.sparse_mla(q_latent, q_pe, latent, meta, 0.2, 1.0, select, num_splits=num_splits, block_n=16)
    assert not got.isnan().any()
    some = (select >= 0).any(-1)  # (a fresh prompt's first token lost its one position: the reference gives NaN)
    torch.testing.assert_close(got[some], want[some], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~some], torch.zeros_like(got[~some]))


def test_sparse_mla_reads_an_fp8_cache_and_answers_zero_for_an_empty_list():
    q_latent, q_pe, q, w, cache, meta = _step([30, 5], [1, 1], 4, seed=3, cache_dtype=FP8_DTYPE)
    latent = cache[..., :RANK + ROPE]
    select = torch.tensor([[3, 29, 30, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    got = dsa_triton.sparse_mla(q_latent, q_pe, latent, meta, 0.2, 0.5, select, num_splits=2, block_n=16)
    want = torch_ref.paged_mla(q_latent, q_pe, latent, meta, 0.2, 0.5, select=select)  # (row 1: NaN, no key)
    torch.testing.assert_close(got[:1], want[:1], atol=2e-5, rtol=2e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_the_key_store_writes_what_the_reference_writes_and_skips_padding():
    keys = torch.randn(5, INDEX_DIM)
    slots = torch.tensor([3, -1, 0, 9, -1])
    want, got = (torch.full((3, 4, RANK + INDEX_DIM), 7.0)[..., RANK:] for _ in range(2))
    dsa_ref.store_index_keys(keys, want, slots)
    dsa_triton.store_rows(keys, got, slots)
    assert torch.equal(got, want) and (got == 7.0).sum() == 9 * INDEX_DIM


def test_fp8_keys_are_stored_over_a_scale_each_as_the_reference_stores_them():
    """An FP8 index cache: each key in e4m3 over its own float32 scale (largest magnitude / 448) in the row's last
    four bytes; dequantized, within e4m3's rounding of the key; padding rows (slot -1) untouched."""
    keys = torch.randn(5, INDEX_DIM, device=DEVICE) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0], device=DEVICE)[:, None]
    slots = torch.tensor([3, -1, 0, 9, -1], device=DEVICE)
    width = dsa_ref.index_part_width(RANK, INDEX_DIM)
    want, got = (torch.full((3, 4, RANK + width), 7.0, device=DEVICE).to(FP8_DTYPE)[..., RANK:] for _ in range(2))
    dsa_ref.store_index_keys(keys, want, slots)
    dsa_triton.store_index_keys(keys, got, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    scales = dsa_ref.key_scales(want, INDEX_DIM)
    stored = [(s // 4, s % 4) for s in slots.tolist() if s >= 0]
    for token, (block, at) in zip((0, 2, 3), stored):
        assert scales[block, at, 0].item() == pytest.approx(keys[token].abs().max().item() / 448, rel=1e-6)
        back = want[block, at, :INDEX_DIM].float() * scales[block, at, 0]
        torch.testing.assert_close(back, keys[token], atol=0, rtol=2 ** -4)  # (e4m3: 3 mantissa bits)
    assert (want.view(torch.uint8) == torch.tensor(7.0).to(FP8_DTYPE).view(torch.uint8)).sum() == 9 * width
    with pytest.raises(ValueError, match="columns after each"):
        dsa_ref.store_index_keys(keys, want[..., :INDEX_DIM], slots)


@pytest.mark.skipif(not INTERPRET, reason="PagedRunner drives the model on the CPU")
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_tiny_sparse_models_decode_the_same_through_the_triton_backend(tmp_path, name):
    from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
    from flotilla.models.hf_config import load_hf_config
    from helpers_mla import check_triton_mla_matches_torch
    from helpers_tiny_models import write_tiny_dsa_model

    model_dir = write_tiny_dsa_model(tmp_path / name, name)
    with pytest.raises(NotImplementedError, match="triton or torch"):  # (FlashMLA's kernels read every row)
        DeepseekV3ForCausalLM(load_hf_config(model_dir), attention_backend="flash_mla", fused_ops="torch",
                              moe_backend="torch")
    # prompts longer than the tiny configs' top-k (6), a decode, then decodes (over rows a decode wrote) beside a new
    # prompt and a two-token step
    check_triton_mla_matches_torch(model_dir, [
        [(0, list(range(10, 22))), (1, [5, 6, 7, 8, 9, 10, 11, 12])], [(0, [40]), (1, [41])],
        [(1, [44]), (2, list(range(50, 60))), (0, [45, 46])]])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_gpu_kernels_at_deepseek_v32_sizes(cache_dtype):
    """128 heads, a latent of 512 + 64, 64 indexer heads of 128, top-2048, pages of 64: a prefill chunk over a
    cached prefix beside decodes of up to 5,000 tokens, against the references in float32."""
    device = torch.device("cuda")
    rank, rope, index_dim, heads, index_heads, block_size = 512, 64, 128, 128, 64, 64
    rng = random.Random(7)
    cached, new = [rng.randint(100, 5000) for _ in range(7)] + [1500], [1] * 7 + [300]
    lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    gen = torch.Generator(device=device).manual_seed(0)
    width = rank + rope + dsa_ref.index_part_width(rank + rope, index_dim)
    cache = torch.randn(num_blocks, block_size, width, generator=gen, device=device).to(cache_dtype)
    index_cache, latent = cache[..., rank + rope:], cache[..., :rank + rope]
    scales = dsa_ref.key_scales(index_cache, index_dim)
    if scales is not None:  # (an FP8 cache: each key over a scale of its own)
        scales.copy_(torch.rand(scales.shape, generator=gen, device=device) + 0.5)
    meta = AttentionMetadata.from_lists(cached, new, tables, block_size, device=device)
    t = sum(new)
    q_latent = torch.randn(t, heads, rank, generator=gen, device=device).bfloat16()
    q_pe = torch.randn(t, heads, rope, generator=gen, device=device).bfloat16()
    index_q = torch.randn(t, index_heads, index_dim, generator=gen, device=device).bfloat16()
    weights = torch.randn(t, index_heads, generator=gen, device=device)

    logits = dsa_triton.index_logits(index_q, weights, index_cache, meta, 0.1)
    want = _reference_logits(index_q.float(), weights, index_cache, meta, 0.1)
    finite = want != float("-inf")
    assert torch.equal(logits != float("-inf"), finite)
    torch.testing.assert_close(logits[finite], want[finite], atol=0.05, rtol=0.02)  # (tf32 dots of bf16 inputs)

    select = dsa_triton.select_topk(index_q, weights, index_cache, meta, 2048, 0.1)
    assert select.shape == (t, 2048)
    got = dsa_triton.sparse_mla(q_latent, q_pe, latent, meta, 0.05, 1.0, select)
    ref = torch_ref.paged_mla(q_latent.float(), q_pe.float(), latent.float(), meta, 0.05, select=select)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_dsa_kernels_compile_for_sm90_at_deepseek_v32_sizes(tmp_path):
    """The interpreter checks little of triton's typing: compile for an H100/H200 (sm_90) in a child process."""
    mod = "flotilla.kernels.mla.dsa_triton"
    tables = {"seq_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32"}
    specs = []
    for cache in ("*bf16", "*fp8e4nv"):
        specs.append((mod, "_index_logits_kernel", {"q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": cache,
                                                    "key_scale_ptr": "*fp32", "out_ptr": "*fp32", **tables}, ["scale"],
                      dict(PAGE_SIZE=64, BLOCK_H=64, BLOCK_N=64, BLOCK_D=128, KEY_SCALES=cache == "*fp8e4nv",
                           DOT_PRECISION="tf32"), 4))
        specs += [(mod, "_sparse_mla_kernel", {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "cache_ptr": cache,
                                               "idx_ptr": "*i32", "seq_ptr": "*i32", "bt_ptr": "*i32",
                                               "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"},
                   ["sm_scale_log2", "kv_scale"], dict(PAGE_SIZE=64, BLOCK_H=16, BLOCK_N=32, BLOCK_L=512, BLOCK_R=64,
                                                       DIRECT_OUT=direct, DOT_PRECISION="tf32"), 8)
                  for direct in (True, False)]
        specs.append((mod, "_store_rows_kernel", {"row_ptr": "*bf16", "cache_ptr": cache, "slot_ptr": "*i64"}, [],
                      dict(BLOCK_D=128), 4))
    specs.append((mod, "_store_fp8_keys_kernel", {"key_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                                                  "slot_ptr": "*i64"}, [], dict(FP8_MAX=448.0, BLOCK_D=128), 4))
    compile_for_sm90(specs, tmp_path)
