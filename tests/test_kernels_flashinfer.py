"""FlashInfer backend vs the torch reference on fresh random inputs (runs on a CUDA machine with flashinfer)."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("seqs", [
    [(30000, 1), (12000, 1), (8000, 4096)],                  # decodes at long contexts first, then a prompt chunk
    [(0, 300), (128, 64), (1000, 1), (17, 1), (0, 5), (5000, 1)],  # prompt rows apart (gathered), decodes between
], ids=["decodes-then-chunk", "interleaved"])
def test_flashinfer_triton_on_a_mixed_step_matches_the_torch_reference(seqs):
    """flashinfer_triton on a step with decode and prompt rows: the decode rows through triton's decode kernel into
    the step's output, the prompt rows through FlashInfer planned for them alone; twice, as two layers of a step."""
    from flotilla.kernels.attention import get_attention_backend

    meta, cache, q, k, v = _case(seqs)
    backend = get_attention_backend("flashinfer_triton")
    store_kv(k, v, cache, meta.slot_mapping)
    scale = 128 ** -0.5
    want = paged_attention(q, cache, meta, scale).float()
    got = backend.forward(q, cache, meta, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert meta.backend_state["mixed_split"] is not None
    torch.testing.assert_close(backend.forward(q, cache, meta, scale), got)


def _scheduler_output(plan_info: list[int], workspace: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """The bytes of the pinned int workspace that FlashInfer 0.6's fa2 prefill scheduler (PrefillPlan, which the
    tensor-core decode plans with) writes and its kernels read, by PrefillPlanInfo's offsets. Its tile index arrays
    are allocated for padded_batch_size CTAs but written for the valid ones only: under CUDA graphs split_kv is
    always on and the kernels return at once in a CTA whose block_valid_mask entry is false, so the rest of those
    arrays (and the alignment gaps) keep whatever the buffer held before, and nothing reads them."""
    (padded, total_rows, total_rows_at, _, request_at, qo_tile_at, kv_tile_at, merge_at, o_indptr_at, chunk_at,
     _, _, mask_at, cuda_graph, split_kv) = (int(x) for x in plan_info)
    raw = workspace.view(torch.uint8)

    def int32s(at: int, n: int) -> torch.Tensor:
        return raw[at:at + 4 * n].clone().view(torch.int32)

    out = {"o_indptr": int32s(o_indptr_at, batch + 1), "kv_chunk_size": int32s(chunk_at, 1)}
    valid = padded
    if split_kv:
        out["merge_indptr"] = int32s(merge_at, total_rows + 1)
        if cuda_graph:
            out["block_valid_mask"] = raw[mask_at:mask_at + padded].clone()
            valid = int(out["block_valid_mask"].sum())  # the valid CTAs come first
    if cuda_graph:
        out["total_num_rows"] = int32s(total_rows_at, 1)
    for name, at in (("request_indices", request_at), ("qo_tile_indices", qo_tile_at), ("kv_tile_indices", kv_tile_at)):
        out[name] = int32s(at, valid)
    return out


def test_the_fast_graph_replan_gives_flashinfers_own_plan():
    """fast_plan_graph (what a CUDA-graph decode re-plans with) must leave the wrapper exactly as FlashInfer's
    plan() would: the same plan info, the same scheduler output in the pinned workspace (the bytes its kernels
    read: the rest keeps what the buffer held before either plan), the same page tables, and attention equal to
    the torch reference."""
    import numpy as np

    batch, block_size, num_heads, num_kv_heads, head_dim = 24, 16, 32, 8, 128
    fi = flashinfer_backend.FlashInferAttention()
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    indices_buf = torch.zeros(batch * 64, dtype=torch.int32, device="cuda")
    last_buf = torch.zeros(batch, dtype=torch.int32, device="cuda")
    wrapper = fi.graph_decode_wrapper(torch.device("cuda"), indptr_buf, indices_buf, last_buf)
    heads = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=block_size)
    rng = np.random.default_rng(0)
    for trial in range(4):
        lens = rng.integers(1, 1000, batch)
        meta, cache, q, _, _ = _case([(int(n) - 1, 1) for n in lens], block_size, num_heads, num_kv_heads, head_dim,
                                     seed=trial)
        host = meta.host
        pages = -(-host.seq_lens // block_size)
        indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
        indices = np.concatenate([t[:p] for t, p in zip(host.block_tables, pages)]).astype(np.int32)
        last = (host.seq_lens - (pages - 1) * block_size).astype(np.int32)
        indices_buf[:len(indices)].copy_(torch.from_numpy(indices))
        wrapper.plan(torch.from_numpy(indptr), indices_buf[:len(indices)], torch.from_numpy(last), **heads,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=head_dim ** -0.5)
        torch.cuda.synchronize()
        want_info = list(wrapper._plan_info)
        want_ws = _scheduler_output(want_info, wrapper._pin_memory_int_workspace_buffer, batch)
        want_out = wrapper.run(q, cache)
        indptr_buf.zero_(), last_buf.zero_()
        wrapper._pin_memory_int_workspace_buffer.zero_()
        assert flashinfer_backend.fast_plan_graph(wrapper, indptr, last, **heads)
        torch.cuda.synchronize()
        assert list(wrapper._plan_info) == want_info
        got_ws = _scheduler_output(want_info, wrapper._pin_memory_int_workspace_buffer, batch)
        for name, want in want_ws.items():
            assert torch.equal(got_ws[name], want), name
        assert indptr_buf.tolist() == indptr.tolist() and last_buf.tolist() == last.tolist()
        got_out = wrapper.run(q, cache)
        torch.testing.assert_close(got_out, want_out, atol=0, rtol=0)
        ref = paged_attention(q, cache, meta, head_dim ** -0.5).float()
        torch.testing.assert_close(got_out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch,heads", [(1024, (32, 8, 128)), (256, (64, 4, 128)), (128, (40, 2, 128))],
                         ids=["qwen3-8b-1024", "group16-256", "group20-128"])
def test_a_graph_decode_plan_fits_the_estimated_workspace_and_not_a_smaller_one(batch, heads):
    """FlashInfer's CUDA-graph decode plan at `batch` sequences fits a workspace of decode_workspace_bytes exactly,
    and overflows one 64 bytes smaller (the estimate is FlashInfer's own request, not a bound)."""
    import flashinfer

    qo, kv, head_dim = heads
    need = flashinfer_backend.decode_workspace_bytes(
        batch, qo, kv, head_dim, num_sms=torch.cuda.get_device_properties(0).multi_processor_count)

    def plan(nbytes: int) -> None:
        i32 = dict(dtype=torch.int32, device="cuda")
        indptr, indices, last = torch.arange(batch + 1, **i32), torch.zeros(batch, **i32), torch.ones(batch, **i32)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        wrapper.plan(indptr.cpu(), indices, last.cpu(), num_qo_heads=qo, num_kv_heads=kv, head_dim=head_dim,
                     page_size=16, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    plan(need)
    with pytest.raises(RuntimeError, match="Buffer overflow"):
        plan(need - 64)



def test_bench_attention_times_prompt_chunks_and_its_split_computes_the_paged_attention(capsys):
    """bench_attention --prefill: every backend timed at a chunk over a cached prefix (not page-aligned) and at a fresh
    prompt; the ragged + paged split it times gives the paged kernel's attention."""
    from flotilla.scripts.dev import bench_attention

    bench_attention.main(["--heads", "16:4", "--batch", "2", "--prefill", "300x1000,256x256", "--block", "16,32",
                          "--iters", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["new"], r["ctx"], r["block"]) for r in rows] == [(300, 1000, 16), (300, 1000, 32), (256, 256, 16),
                                                                 (256, 256, 32)]
    for r in rows:
        assert r["triton_TFLOPs"] > 0 and r["flashinfer_split_TFLOPs"] > 0 and r["flashinfer_fa2_TFLOPs"] > 0
        assert r["split_max_err"] < 2e-2, r


def test_bench_attention_times_decode_in_cuda_graphs_and_the_graphs_compute_the_eager_attention(capsys):
    """bench_attention --graph: FlashInfer's decode (a graph wrapper over its own page-table buffers) and triton's
    (at its defaults and a swept setting) replayed from CUDA graphs give what the same calls give eagerly."""
    from flotilla.scripts.dev import bench_attention

    bench_attention.main(["--heads", "16:4", "--batch", "3", "--ctx", "700", "--iters", "4", "--graph",
                          "--stages", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[1]["stages"] == 2
    assert rows[0]["flashinfer_tc1_us"] > 0 and rows[0]["flashinfer_tc0_us"] > 0 and rows[1]["triton_us"] > 0
    assert rows[0]["graph_max_err"] < 1e-2, rows[0]
