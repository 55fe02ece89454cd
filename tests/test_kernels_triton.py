"""Triton kernels vs their torch references on fresh random inputs.

Without CUDA the kernels run under triton's CPU interpreter at tiny sizes. TRITON_INTERPRET=1 is set
by tests/conftest.py, before flotilla.kernels.triton is imported: triton.jit reads it when a kernel is *defined*, so
it must precede the first import of the kernel modules in this pytest process; a guard fails loudly
otherwise. triton
itself is usually imported earlier (torch imports it when transformers loads torch._dynamo), which
leaves triton.language's own @jit helpers (tl.max, tl.sum, tl.cdiv) in compiled mode;
helpers_triton.repair_interpreter (called by conftest.py) rewraps them, so no subprocess is needed. With CUDA the
same tiny tests run compiled on the GPU, and the `gpu`-marked tests add realistic sizes.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
if not ON_CUDA and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

from flotilla.kernels import activation, norm, rope  # noqa: E402
from flotilla.kernels.attention import (  # noqa: E402
    AttentionMetadata,
    best_attention_backend,
    get_attention_backend,
    kv_cache_shape,
    torch_ref,
)
from flotilla.kernels.triton import attention as tri_attn  # noqa: E402
from flotilla.kernels.triton import fused as tri_fused  # noqa: E402

if INTERPRET and type(tri_attn._decode_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError("flotilla.kernels.triton was imported before TRITON_INTERPRET=1 was set")

DEVICE = torch.device("cuda" if ON_CUDA and not INTERPRET else "cpu")
TOLERANCE = {torch.float32: (2e-4, 1e-5), torch.float16: (5e-3, 3e-3), torch.bfloat16: (2e-2, 1e-2)}
"""Attention per input dtype: (atol = rtol per element, bound on the relative RMS error). fp32 is exact up
to summation order; half types round the probabilities and the output (~0.1-0.3% RMS for bf16). The RMS
bound is what catches a lost tile at realistic sizes: outputs average ~2k values there, so dropping 64
keys moves them by ~20% of their RMS while staying well inside a per-element atol."""


def _assert_rounds_like_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """Close, and for half types rounded where the reference rounds: nearly every element bit-equal
    (a kernel that skipped an intermediate rounding matches only ~75% of bf16 elements)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got, want)
    assert (got == want).float().mean().item() >= 0.99


def gpu_test(fn):
    """Marked `gpu` (deselect with -m "not gpu") and skipped unless triton compiles for a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")(fn))


def _paged_case(seqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int, device: torch.device = DEVICE):  # fmt: skip
    """(meta, cache, q, k, v) for sequences of (cached, new) tokens: blocks shuffled, the cached history
    random, every never-written slot NaN (so reading past a seq_len poisons the result), new K/V not
    stored yet."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.from_lists([c for c, _ in seqs], [n for _, n in seqs], tables, block_size, device=device)
    cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                       device=device)  # fmt: skip
    history = [(c, t) for (c, _), t in zip(seqs, tables, strict=True) if c]
    if history:
        hist = AttentionMetadata.from_lists([0] * len(history), [c for c, _ in history], [t for _, t in history],
                                            block_size, device=device)  # fmt: skip

        def rand(n: int) -> torch.Tensor:
            return torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)

        torch_ref.store_kv(rand(hist.num_tokens), rand(hist.num_tokens), cache, hist.slot_mapping)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    tokens = meta.num_tokens
    return meta, cache, randn(tokens, num_heads, head_dim), randn(tokens, num_kv_heads, head_dim), \
        randn(tokens, num_kv_heads, head_dim)  # fmt: skip


def _check_attention(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed, run) -> None:
    """Store with both backends (caches must match bit for bit, NaN holes included), then compare
    run(q, cache, meta, scale) with the reference computed in float32 from the same inputs."""
    meta, cache, q, k, v = _paged_case(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed)
    ref_cache, tri_cache = cache, cache.clone()
    torch_ref.store_kv(k, v, ref_cache, meta.slot_mapping)
    tri_attn.store_kv(k, v, tri_cache, meta.slot_mapping)
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    scale = head_dim**-0.5
    want = torch_ref.paged_attention(q.float(), ref_cache.float(), meta, scale)
    got = run(q, tri_cache, meta, scale)
    assert got.shape == q.shape and got.dtype == dtype
    tol, rel_rms = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error <= rel_rms, f"relative RMS error {error:.2e} > {rel_rms:.0e}"


# (cached, new): fresh prefills, decodes, chunks over cached prefixes (block-aligned and not), a chunk
# longer than one query tile.
MIXED = [(0, 9), (5, 1), (13, 6), (37, 1), (0, 2), (16, 16), (3, 20)]


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "block_m", "block_n", "dtype"),
    [
        (4, 4, 4, 16, 16, 16, torch.float32),  # MHA; tiles of 16 keys span 4 pages
        (16, 8, 2, 32, 16, 16, torch.float32),  # GQA 4: 4 tokens per query tile, many tiles
        (4, 6, 2, 24, 64, 64, torch.float32),  # group of 3 and head_dim 24: padded rows and columns
        (16, 8, 1, 16, 32, 16, torch.bfloat16),  # MQA, bf16
        (4, 4, 2, 32, 16, 16, torch.float16),
    ],
)
def test_prefill_mixed_batch_matches_reference(block_size, num_heads, num_kv_heads, head_dim, block_m, block_n, dtype):
    def run(q, cache, meta, scale):
        return tri_attn.paged_prefill_attention(q, cache, meta, scale, block_m=block_m, block_n=block_n)

    _check_attention(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size + head_dim, run=run)


@pytest.mark.parametrize("num_splits", [None, 3, 8])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype"),
    [(4, 4, 4, torch.float32), (16, 8, 2, torch.float32), (4, 6, 2, torch.bfloat16)],
)
def test_decode_matches_reference(monkeypatch, num_splits, block_size, num_heads, num_kv_heads, dtype):
    """num_splits None: the default, which is one split at these short contexts (the one-split run: no merge)."""
    from helpers_triton import Launches

    # seq_len 1 with 8 splits leaves splits empty; 101 ends mid-block and mid-tile.
    seqs = [(c, 1) for c in (0, 3, 17, 40, 63, 100)]
    merge = Launches(tri_attn._decode_merge_kernel)
    monkeypatch.setattr(tri_attn, "_decode_merge_kernel", merge)

    def run(q, cache, meta, scale):
        return tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=num_splits, block_n=16)

    _check_attention(seqs, block_size, num_heads, num_kv_heads, 16, dtype, seed=block_size + num_heads, run=run)
    assert merge.count == (num_splits is not None)


def test_decode_drops_the_never_written_partials_of_empty_splits(monkeypatch):
    """With 8 splits a 1-token context leaves 7 empty: their partials are never written, and the merge, which loads
    them beside the lse, must drop them. The scratch buffers start as NaN here, so a partial that counted would show."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    seqs = [(0, 1), (2, 1), (40, 1)]

    def run(q, cache, meta, scale):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", poisoned)
            return tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=8, block_n=16)

    _check_attention(seqs, 4, 4, 2, 16, torch.float32, seed=21, run=run)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_merge_launch_skips_empty_splits_and_padding(monkeypatch, num_splits):
    """The second launch merges a split decode with the same bits whatever its chunk of splits per step: a padding
    sequence (seq_len 0: all splits empty, output 0), contexts shorter than one split and ones filling most splits;
    a group of 3 (a masked merge row); scratch buffers NaN, so a merge reading an empty split's partial, or a row
    left unwritten, would show."""
    from helpers_triton import Launches, nan_scratch

    seqs = [(0, 1), (0, 1), (4, 1), (39, 1), (129, 1)]
    meta, cache, q, k, v = _paged_case(seqs, 4, 3, 1, 16, torch.float32, seed=num_splits)
    tri_attn.store_kv(k, v, cache, meta.slot_mapping)
    want = torch_ref.paged_attention(q, cache, meta, 0.25)
    meta.seq_lens[0] = 0  # the padding sequence of a CUDA graph's batch
    nan_scratch(monkeypatch)
    merge = Launches(tri_attn._decode_merge_kernel)
    monkeypatch.setattr(tri_attn, "_decode_merge_kernel", merge)
    got = tri_attn.paged_decode_attention(q, cache, meta, 0.25, num_splits=num_splits, block_n=16)
    assert merge.count == (num_splits > 1)
    monkeypatch.setattr(tri_attn, "merge_chunk", lambda block_s, block_d: 3)
    assert torch.equal(tri_attn.paged_decode_attention(q, cache, meta, 0.25, num_splits=num_splits, block_n=16), got)
    assert not got[0].any()
    torch.testing.assert_close(got[1:], want[1:], atol=1e-5, rtol=1e-5)


def _single_split_case(monkeypatch, seqs, num_heads, num_kv_heads, head_dim, dtype, num_splits, block_n):
    """(the split decode's output, the one-split output, the reference, seq_lens) of a decode over fixed
    `num_splits` (a CUDA graph's), scratch NaN: a merge that wrote a sequence the decode kernel wrote itself would
    show."""
    from helpers_triton import nan_scratch

    meta, cache, q, k, v = _paged_case(seqs, 16, num_heads, num_kv_heads, head_dim, dtype, seed=len(seqs))
    tri_attn.store_kv(k, v, cache, meta.slot_mapping)
    scale = head_dim**-0.5
    want = torch_ref.paged_attention(q.float(), cache.float(), meta, scale)
    one_split = tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=1, block_n=block_n)
    nan_scratch(monkeypatch)
    got = tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=num_splits, block_n=block_n)
    return got, one_split, want, meta.seq_lens.cpu()


def test_decode_writes_a_context_within_split_0_itself_and_merges_the_rest(monkeypatch):
    """Splits are whole tiles, so a context within split 0's share is written by split 0, with the bits of a one-split
    decode, and the merge leaves it alone; longer ones are merged. Every sequence matches the reference."""
    seqs = [(c, 1) for c in (0, 14, 15, 31, 90, 200)]  # seq_len 1 ... 201
    got, one_split, want, seq_lens = _single_split_case(monkeypatch, seqs, 6, 2, 16, torch.float32, num_splits=8,
                                                        block_n=16)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    single = (seq_lens <= (-(-seq_lens // 8) + 15) // 16 * 16).tolist()
    # seq_lens 1, 15, 16, 32, 91, 201; eight splits of whole tiles take 16 positions each (32 at 201)
    assert single == [True, True, True, False, False, False]
    for i, one in enumerate(single):
        if one:  # one split wrote it: exactly the one-split decode's numbers
            assert torch.equal(got[i], one_split[i]), i


@gpu_test
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_decode_single_split_at_qwen3_30b_a3b_sizes(monkeypatch, batch):
    """Qwen3-30B-A3B's heads in bf16 at a CUDA graph's 64 splits, contexts of 1 to 3,000: each sequence the
    reference's numbers, and the contexts within one tile (64 positions) the one-split decode's bits."""
    seqs = [(random.Random(batch + i).randint(0, 3000 if i % 2 else 63), 1) for i in range(batch)]
    got, one_split, want, seq_lens = _single_split_case(monkeypatch, seqs, 32, 4, 128, torch.bfloat16, num_splits=64,
                                                        block_n=None)  # fmt: skip
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    short = (seq_lens <= 64).nonzero().flatten().tolist()
    assert short, "no context within one tile"
    assert torch.equal(got[short], one_split[short])


def test_backend_dispatch_and_forward_picks_decode_or_prefill():
    backend = get_attention_backend("triton")
    assert backend.name == "triton" and backend.store_kv is tri_attn.store_kv and backend.forward is tri_attn.forward
    if not ON_CUDA:  # "auto" must not change: torch on the CPU even with triton runnable
        assert best_attention_backend(torch.device("cpu"), 16) == "torch"
        assert get_attention_backend("auto").name == "torch"
    for seqs in ([(7, 1), (0, 1), (30, 1)], [(7, 1), (0, 5), (30, 2)]):
        _check_attention(seqs, 4, 4, 2, 16, torch.float32, seed=len(seqs), run=backend.forward)


def test_store_kv_skips_padding_slots_and_casts():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, tokens = 6, 4, 3, 24, 10
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=gen, device=DEVICE)
    cache = cache.to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    slots[[1, 4, 9]] = -1
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen, device=DEVICE)  # fp32 into a bf16 cache
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen, device=DEVICE)
    want, got = cache.clone(), cache.clone()
    torch_ref.store_kv(key, value, want, slots)
    tri_attn.store_kv(key, value, got, slots)
    assert torch.equal(got, want)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(got.transpose(1, 2).reshape(-1, 2, num_kv_heads, head_dim)[untouched],
                       cache.transpose(1, 2).reshape(-1, 2, num_kv_heads, head_dim)[untouched])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 40)])
def test_rms_norm_and_fused_add_match_reference(shape, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(len(shape))
    x, residual = (torch.randn(shape, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device=DEVICE)).to(dtype)
    _assert_rounds_like_reference(tri_fused.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    got_out, got_res = tri_fused.fused_add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_res = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_res, want_res)
    _assert_rounds_like_reference(got_out, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = (3 * torch.randn(2, 7, 2 * 40, generator=gen, device=DEVICE)).to(dtype)
    _assert_rounds_like_reference(tri_fused.silu_and_mul(x), activation.silu_and_mul(x))


@pytest.mark.parametrize(("head_dim", "dtype"), [(16, torch.float32), (24, torch.bfloat16)])
def test_rope_and_rope_with_store_match_reference(head_dim, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    tokens, num_heads, num_kv_heads, block_size, num_blocks = 9, 4, 2, 4, 5
    table = rope.rope_cos_sin_cache(head_dim, 512, 10000.0, device=DEVICE)
    positions = torch.randint(0, 512, (tokens,), generator=gen, device=DEVICE)
    # q/k as column slices of one fused qkv output: strided rows, like the model's split()
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=DEVICE).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    want_q, want_k = rope.apply_rope(positions, q, k, table)
    got_q, got_k = tri_fused.apply_rope(positions, q, k, table)
    _assert_rounds_like_reference(got_q, want_q)
    _assert_rounds_like_reference(got_k, want_k)

    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    slots[[0, 5]] = -1
    cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                       device=DEVICE)  # fmt: skip
    want_cache, got_cache = cache.clone(), cache.clone()
    torch_ref.store_kv(want_k, v, want_cache, slots)
    got_q = tri_fused.rope_and_store_kv(positions, q, k, v, table, got_cache, slots)
    _assert_rounds_like_reference(got_q, want_q)
    written = ~want_cache.isnan()
    assert torch.equal(got_cache.isnan(), ~written)  # padding slots (-1) and unused slots untouched
    _assert_rounds_like_reference(got_cache[written], want_cache[written])


@pytest.mark.skipif(not INTERPRET, reason="PagedRunner drives the model on the CPU")
def test_tiny_llama_with_triton_backend_matches_torch_backend(tmp_path):
    from helpers_tiny_models import PagedRunner, load_flotilla_model, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    runners = [PagedRunner(load_flotilla_model(model_dir, backend), block_size=4) for backend in ("torch", "triton")]
    steps = [
        [(0, list(range(10, 17))), (1, [5, 6, 7])],  # two prefills
        [(0, [40]), (1, [41])],  # decode
        [(1, [42]), (2, list(range(50, 62))), (0, [43, 44, 45])],  # decode + prefill + chunk
    ]
    for batch in steps:
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ---- realistic sizes on the GPU (bf16, Llama-3-8B-like heads, block_size 16) ----


@gpu_test
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gpu_decode_batch64_at_2k(num_splits):
    rng = random.Random(0)
    seqs = [(rng.randint(1900, 2100), 1) for _ in range(64)]

    def run(q, cache, meta, scale):
        return tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=num_splits)

    _check_attention(seqs, 16, 32, 8, 128, torch.bfloat16, seed=1, run=run)


@gpu_test
@pytest.mark.parametrize(("warps", "stages"), [(4, 2), (8, 4)])
def test_gpu_decode_launch_settings_give_the_reference(warps, stages):
    """bench_attention's sweep settings (num_warps, num_stages) compile kernels that still match the reference."""

    def run(q, cache, meta, scale):
        return tri_attn.paged_decode_attention(q, cache, meta, scale, num_splits=8, num_warps=warps,
                                               num_stages=stages)

    _check_attention([(4000, 1), (700, 1), (33, 1)], 16, 32, 8, 128, torch.bfloat16, seed=3, run=run)


@gpu_test
def test_bench_attention_sweeps_the_triton_launch_settings(capsys):
    from flotilla.scripts.dev import bench_attention

    bench_attention.main(["--heads", "8:2", "--batch", "2", "--ctx", "600", "--iters", "2", "--no-flashinfer",
                          "--splits", "auto,graph,2", "--warps", "4,8"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 + 3 * 2 and all(r["triton_GBps"] > 0 for r in rows)
    assert [r["splits"] for r in rows[1::2]] == ["auto", tri_attn._decode_num_splits(2, 2, 40960), 2]


@gpu_test
def test_gpu_decode_long_context_splits():
    _check_attention([(16000, 1), (9000, 1)], 16, 32, 8, 128, torch.bfloat16, seed=2, run=tri_attn.forward)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mixed_prefill_batch(dtype):
    seqs = [(0, 300), (128, 64), (1000, 1), (17, 1), (0, 5), (1500, 700), (0, 1024)] + [(2000, 1)] * 16
    _check_attention(seqs, 16, 32, 8, 128, dtype, seed=3, run=tri_attn.forward)


@gpu_test
def test_gpu_fused_ops_at_llama8b_sizes():
    dev, dtype, tokens = torch.device("cuda"), torch.bfloat16, 512
    gen = torch.Generator(device=dev).manual_seed(4)
    x, residual = (torch.randn(tokens, 4096, generator=gen, device=dev).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(4096, generator=gen, device=dev)).to(dtype)
    _assert_rounds_like_reference(tri_fused.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    got, got_res = tri_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_res = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got_res, want_res)
    _assert_rounds_like_reference(got, want)
    gate_up = torch.randn(tokens, 2 * 14336, generator=gen, device=dev).to(dtype)
    _assert_rounds_like_reference(tri_fused.silu_and_mul(gate_up), activation.silu_and_mul(gate_up))

    table = rope.rope_cos_sin_cache(128, 8192, 500000.0, device=dev)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device=dev)
    q = torch.randn(tokens, 32, 128, generator=gen, device=dev).to(dtype)
    k, v = (torch.randn(tokens, 8, 128, generator=gen, device=dev).to(dtype) for _ in range(2))
    slots = torch.randperm(64 * 16, generator=gen, device=dev)[:tokens]
    slots[::7] = -1
    want_q, want_k = rope.apply_rope(positions, q, k, table)
    want_cache = torch.full(kv_cache_shape(64, 16, 8, 128), float("nan"), dtype=dtype, device=dev)
    got_cache = want_cache.clone()
    torch_ref.store_kv(want_k, v, want_cache, slots)
    got_q = tri_fused.rope_and_store_kv(positions, q, k, v, table, got_cache, slots)
    _assert_rounds_like_reference(got_q, want_q)
    written = ~want_cache.isnan()
    assert torch.equal(got_cache.isnan(), ~written)
    _assert_rounds_like_reference(got_cache[written], want_cache[written])


# ---- Qwen3's q/k norm + RoPE + K/V store in one launch (kernels/triton/qk_norm_rope.py) ----

from flotilla.kernels.triton import qk_norm_rope as tri_qk  # noqa: E402


def _assert_rounds_like_rope_of_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """As _assert_rounds_like_reference, but per element within 2 ulps of the value's scale rather than of the
    element: the norm's float32 sum runs in another order, so a rare normalised element rounds 1 ulp apart,
    and where RoPE then cancels (x1 cos - x2 sin ~ 0) that ulp is large relative to the result (a few elements in a
    million, 0.004 absolute at unit scale)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got, want, atol=2 * 2**-7, rtol=1.6e-2)
    assert (got == want).float().mean().item() >= 0.99


def _check_qk_norm_rope(dev, tokens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, block_size=4,
                        num_blocks=5, max_pos=512, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    eps = 1e-6
    table = rope.rope_cos_sin_cache(head_dim, max_pos, 1000000.0, device=dev)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=dev)
    qkv = (3 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=dev)).to(dtype)
    qw, kw = (1 + 0.3 * torch.randn(2, head_dim, generator=gen, device=dev)).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    want_q, want_k = rope.apply_rope(positions, norm.rms_norm(q, qw, eps), norm.rms_norm(k, kw, eps), table)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:tokens]
    slots[::7] = -1
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    if cache_dtype is not None:
        cache = cache.to(cache_dtype)
    want_cache, got_cache = cache.clone(), cache.clone()
    scales = (0.5, 2.0) if cache_dtype is not None else (1.0, 1.0)
    torch_ref.store_kv(want_k, v, want_cache, slots, *scales)
    got_q = tri_qk.qk_norm_rope_and_store_kv(qkv, positions, qw, kw, eps, table, got_cache, slots, num_heads,
                                             num_kv_heads, *scales)
    _assert_rounds_like_rope_of_norm(got_q, want_q)
    written = ~want_cache.float().isnan()
    assert torch.equal(got_cache.float().isnan(), ~written)  # padding slots (-1) and unused slots untouched
    if cache_dtype is None:
        _assert_rounds_like_rope_of_norm(got_cache[written], want_cache[written])
    else:  # the same e4m3 bytes, but for a rare rounding tie
        assert (got_cache.view(torch.uint8) == want_cache.view(torch.uint8))[written].float().mean() >= 0.99


@pytest.mark.parametrize(("head_dim", "dtype", "cache_dtype"), [(16, torch.float32, None), (24, torch.bfloat16, None),
                                                                (16, torch.bfloat16, torch.float8_e4m3fn)])
def test_qk_norm_rope_and_store_matches_the_ops_one_by_one(head_dim, dtype, cache_dtype):
    _check_qk_norm_rope(DEVICE, 9, 4, 2, head_dim, dtype, cache_dtype, seed=head_dim)


@gpu_test
@pytest.mark.parametrize(("heads", "cache_dtype"), [((16, 8), None), ((32, 8), None), ((32, 8), torch.float8_e4m3fn)])
def test_gpu_qk_norm_rope_at_qwen3_sizes(heads, cache_dtype):
    _check_qk_norm_rope(torch.device("cuda"), 512, *heads, 128, torch.bfloat16, cache_dtype, block_size=16,
                        num_blocks=64, max_pos=8192)


def test_qk_norm_rope_refuses_a_qkv_that_does_not_match_the_heads():
    qkv = torch.zeros(3, (4 + 2 * 2) * 16 + 1, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    table = rope.rope_cos_sin_cache(16, 64, 10000.0, device=DEVICE)
    cache = torch.zeros(kv_cache_shape(2, 4, 2, 16), device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        tri_qk.qk_norm_rope_and_store_kv(qkv, torch.zeros(3, dtype=torch.long, device=DEVICE), w, w, 1e-6, table,
                                         cache, torch.zeros(3, dtype=torch.long, device=DEVICE), 4, 2)


@pytest.mark.skipif(not INTERPRET, reason="PagedRunner drives the model on the CPU")
def test_tiny_qwen3_with_triton_ops_matches_torch_ops(tmp_path):
    """Qwen3's attention takes the one-launch q/k norm + RoPE + store path under the triton ops."""
    from safetensors.torch import load_file

    from flotilla.models.hf_config import load_hf_config
    from flotilla.models.registry import get_model_class
    from helpers_tiny_models import PagedRunner, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "qwen3", "qwen3")
    config = load_hf_config(model_dir)
    runners = []
    for ops in ("torch", "triton"):
        model = get_model_class(config.architectures)(config, attention_backend="torch", fused_ops=ops)
        model.load_weights(load_file(str(model_dir / "model.safetensors")).items())
        assert model.model.layers[0].self_attn.ops.qk_norm_rope_and_store_kv is not None or ops == "torch"
        runners.append(PagedRunner(model.eval(), block_size=4))
    steps = [[(0, list(range(10, 17))), (1, [5, 6, 7])], [(0, [40]), (1, [41])],
             [(1, [42]), (2, list(range(50, 62))), (0, [43, 44, 45])]]
    for batch in steps:
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_flashinfer_triton_decodes_with_triton_and_leaves_prefill_to_flashinfer(monkeypatch):
    """"flashinfer_triton": pure-decode steps go to triton's decode kernel (so decode graphs capture it over static
    tables), the prompt rows of a step to FlashInfer (a stand-in here: FlashInfer needs CUDA) and its decode rows to
    triton's decode kernel, whether the prompt rows are one range of the step's tokens or not."""
    import flotilla.kernels.attention as attention
    from flotilla.actors.cuda_graphs import STATIC_TABLE_BACKENDS
    from flotilla.kernels.attention import flashinfer_backend

    prefills = []

    class StandIn:
        store_kv = staticmethod(tri_attn.store_kv)

        def forward(self, query, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, out=None):
            prefills.append((meta.num_seqs, meta.num_tokens, meta.max_query_len))
            got = tri_attn.paged_prefill_attention(query, kv_cache, meta, scale)
            return got if out is None else out.copy_(got)

    monkeypatch.setattr(flashinfer_backend, "importable", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "shared", StandIn)
    monkeypatch.delitem(attention._BACKENDS, "flashinfer_triton", raising=False)
    backend = get_attention_backend("flashinfer_triton")
    monkeypatch.delitem(attention._BACKENDS, "flashinfer_triton")
    assert backend.name in STATIC_TABLE_BACKENDS and "flashinfer_triton" in attention.available_attention_backends()
    _check_attention([(7, 1), (0, 1), (30, 1)], 4, 4, 2, 16, torch.float32, seed=1, run=backend.forward)
    assert prefills == []
    _check_attention([(7, 1), (0, 5), (30, 2)], 4, 4, 2, 16, torch.float32, seed=2, run=backend.forward)
    assert prefills == [(2, 7, 5)]  # the two prompts' 7 rows; the decode row went to triton
    _check_attention([(0, 5), (7, 1), (30, 2), (11, 1), (40, 1)], 4, 4, 2, 16, torch.float32, seed=5,
                     run=backend.forward)  # (the prompt rows apart: gathered, and their outputs put back)
    assert prefills[1:] == [(2, 7, 5)]
    _check_attention([(0, 5), (3, 3)], 4, 4, 2, 16, torch.float32, seed=6, run=backend.forward)
    assert prefills[2:] == [(2, 8, 5)]  # (no decode rows: FlashInfer takes the whole step)
    monkeypatch.setattr(attention, "FLASHINFER_DECODE_ABOVE", 2)  # decodes of more sequences go to FlashInfer's
    _check_attention([(7, 1), (0, 1), (30, 1)], 4, 4, 2, 16, torch.float32, seed=3, run=backend.forward)
    assert prefills[3:] == [(3, 3, 1)]
    _check_attention([(7, 1), (30, 1)], 4, 4, 2, 16, torch.float32, seed=4, run=backend.forward)
    assert len(prefills) == 4


def test_flashinfer_triton_names_what_it_lacks(monkeypatch):
    import flotilla.kernels.attention as attention
    from flotilla.kernels.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "importable", lambda: False)
    monkeypatch.delitem(attention._BACKENDS, "flashinfer_triton", raising=False)
    with pytest.raises(ValueError, match="'flashinfer_triton' needs CUDA with the flashinfer and triton packages"):
        get_attention_backend("flashinfer_triton")


def test_float32_models_get_an_attention_backend_that_takes_them(monkeypatch):
    """FlashInfer's kernels take 16-bit queries only: "auto" gives a float32 model on CUDA triton's kernels, and naming
    a FlashInfer backend for one is a clear error rather than a KeyError deep in FlashInfer's JIT at the first step."""
    import flotilla.kernels.attention as attention
    from flotilla.kernels.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "importable", lambda: True)
    monkeypatch.setattr(attention, "triton_usable", lambda: True)
    cuda = torch.device("cuda")
    assert best_attention_backend(cuda, 128, torch.bfloat16) == "flashinfer_triton"
    assert best_attention_backend(cuda, 128) == "flashinfer_triton"
    assert best_attention_backend(cuda, 128, torch.float32) == "triton"
    assert get_attention_backend("auto", device=cuda, head_dim=128, dtype=torch.float32).name == "triton"
    for name in ("flashinfer", "flashinfer_triton"):
        with pytest.raises(ValueError, match=f"'{name}' takes float16 or bfloat16 models, not torch.float32"):
            get_attention_backend(name, device=cuda, head_dim=128, dtype=torch.float32)
