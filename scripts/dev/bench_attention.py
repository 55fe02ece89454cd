"""Paged attention on the GPU: each backend's decode time and KV bandwidth over batch x context x GQA shape, or its
prompt-chunk time and TFLOP/s (--prefill).

One new token per sequence over a paged bf16 cache (pages of --block tokens, 16 by default, shuffled as a running
engine leaves them); every kernel reads the whole context once, so GB/s = the KV bytes of the batch over the kernel's
time (compare it with the GPU's memory bandwidth). Backends: flashinfer's decode wrapper with and without tensor cores (its
use_tensor_cores), and flotilla's triton split-K decode kernel. Prints one JSON line per point.

    python -m flotilla.scripts.dev.bench_attention --heads 16:8,32:8 --batch 1,64,256 --ctx 128,1024,4096

With --splits, --block-n, --warps or --stages the triton kernel is also timed at every combination of those launch
settings, a JSON line each ("auto" splits: the count its policy picks for the context, as an eager step does;
"graph": the count a decode graph fixes for --max-model-len):

    python -m flotilla.scripts.dev.bench_attention --heads 32:8 --batch 16,64 --ctx 32768 \
        --splits graph,4,8,16,32 --warps 4,8 --stages 2,3,4

Eager launches time the host below ~100 us a kernel; --graph replays each kernel from a CUDA graph instead, as the
engine's decode steps run it, and checks the graph's outputs against eager calls (graph_max_err).

With --prefill NEWxCTX it times a prompt-chunk step instead: --batch sequences each running NEW tokens whose context
ends at CTX (CTX - NEW cached before them), causal, one JSON line per point with each backend's time and TFLOP/s:
FlashInfer's paged prefill (fa3 where the GPU has it, and fa2), the split SGLang's FlashInfer backend runs (the
chunk's own K/V ragged and causal, the cached part paged, the two merged by their log-sum-exps) and flotilla's triton
prefill kernel; --block sets the page size:

    python -m flotilla.scripts.dev.bench_attention --heads 32:8 --batch 1 --prefill 8192x8192,8192x32768 --block 16,64
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
import torch

from flotilla.kernels.attention.metadata import AttentionMetadata


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # us


def _time_in_graph(fn, iters: int) -> tuple[float, torch.Tensor]:
    """`iters` calls of fn captured in one CUDA graph and replayed, as the engine's decode steps run: the host's
    launch cost drops out, which eager timing cannot separate from a kernel of a few microseconds. Returns (us per
    call, the replayed graph's last output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            out = fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters, out


def point(hq: int, hkv: int, batch: int, ctx: int, iters: int, block: int = 16, head_dim: int = 128,
          sweep: dict[str, list] | None = None, flashinfer_too: bool = True, graph: bool = False) -> list[dict]:
    """The backends' times at one shape (a row), then one row per combination of the triton launch settings in
    `sweep` (splits, block_n, warps, stages; None = the kernel's default). graph: each kernel timed in a CUDA graph,
    and the row's graph_max_err is how far the graph's outputs are from the same calls run eagerly."""
    from flotilla.kernels.triton import attention as tri

    errors = []

    def timed(fn) -> float:
        if not graph:
            return _time(fn, iters)
        us, out = _time_in_graph(fn, iters)
        errors.append(float((out.float() - fn().float()).abs().max()))
        return us

    dev = torch.device("cuda")
    pages = -(-ctx // block)
    num_blocks = batch * pages + 1
    cache = torch.randn(num_blocks, 2, block, hkv, head_dim, dtype=torch.bfloat16, device=dev)
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks - 1)[: batch * pages].reshape(batch, pages).astype(np.int32)
    q = torch.randn(batch, hq, head_dim, dtype=torch.bfloat16, device=dev)
    scale = head_dim ** -0.5
    kv_bytes = batch * ctx * 2 * hkv * head_dim * 2
    row = {"heads": f"{hq}:{hkv}", "batch": batch, "ctx": ctx, "block": block}
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32)
    indices = torch.from_numpy(tables.reshape(-1))
    last = torch.full((batch,), ctx - (pages - 1) * block, dtype=torch.int32)
    for tc in (True, False) if flashinfer_too else ():
        import flashinfer

        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        buffers = {}
        if graph:  # a graph wrapper reads its page table from buffers of its own, as the engine's decode graphs do
            buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev),
                           paged_kv_indices_buffer=indices.to(dev), paged_kv_last_page_len_buffer=last.to(dev))
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, **buffers)
        w.plan(indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=block,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
        us = timed(lambda: w.run(q, cache))
        row[f"flashinfer_tc{int(tc)}_us"] = round(us, 1)
        row[f"flashinfer_tc{int(tc)}_GBps"] = round(kv_bytes / us / 1000, 1)
    meta = AttentionMetadata.from_lists([ctx - 1] * batch, [1] * batch, tables.tolist(), block, device=dev)
    us = timed(lambda: tri.paged_decode_attention(q, cache, meta, scale))
    row["triton_us"], row["triton_GBps"] = round(us, 1), round(kv_bytes / us / 1000, 1)
    rows = [row]
    if sweep:
        for splits, block_n, warps, stages in itertools.product(*(sweep[k] for k in SWEPT)):
            n = {"auto": None, "graph": tri._decode_num_splits(batch, hkv, sweep["max_model_len"])}.get(splits, splits)
            us = timed(lambda: tri.paged_decode_attention(q, cache, meta, scale, num_splits=n, block_n=block_n,
                                                          num_warps=warps, num_stages=stages))
            rows.append({"heads": row["heads"], "batch": batch, "ctx": ctx, "splits": splits if n is None else n,
                         "block_n": block_n, "warps": warps, "stages": stages, "triton_us": round(us, 1),
                         "triton_GBps": round(kv_bytes / us / 1000, 1)})
    if graph:
        row["graph_max_err"] = round(max(errors), 4)
    return rows


def prefill_point(hq: int, hkv: int, batch: int, new: int, ctx: int, iters: int, block: int = 16,
                  head_dim: int = 128, flashinfer_too: bool = True) -> dict:
    """The backends' times at one prompt-chunk shape: `batch` sequences of `new` tokens over `ctx - new` cached ones.
    TFLOP/s counts the causal work, 4 x head_dim x Hq x new x (cached + (new + 1) / 2) per sequence. split_max_err:
    the split's largest difference from the paged kernel's output (the two compute the same attention)."""
    from flotilla.kernels.attention.flashinfer_backend import FlashInferAttention
    from flotilla.kernels.triton import attention as tri

    if not 0 < new <= ctx:
        raise ValueError(f"a chunk of {new} new tokens cannot end at context {ctx}")
    dev = torch.device("cuda")
    cached, pages = ctx - new, -(-ctx // block)
    num_blocks = batch * pages + 1
    cache = torch.randn(num_blocks, 2, block, hkv, head_dim, dtype=torch.bfloat16, device=dev)
    tables = np.random.default_rng(0).permutation(num_blocks - 1)[: batch * pages].reshape(batch, pages)
    q = torch.randn(batch * new, hq, head_dim, dtype=torch.bfloat16, device=dev)
    k, v = (torch.randn(batch * new, hkv, head_dim, dtype=torch.bfloat16, device=dev) for _ in range(2))
    positions = np.arange(cached, ctx)
    slots = np.concatenate([tables[b][positions // block] * block + positions % block for b in range(batch)])
    FlashInferAttention.store_kv(k, v, cache, torch.from_numpy(slots).to(dev))  # the chunk's K/V, as a step stores it
    scale = head_dim ** -0.5
    tflop = 4 * head_dim * hq * batch * new * (cached + (new + 1) / 2) / 1e12
    row = {"heads": f"{hq}:{hkv}", "batch": batch, "new": new, "ctx": ctx, "block": block}

    def timed(name: str, fn) -> torch.Tensor:
        us = _time(fn, iters)
        row[f"{name}_us"], row[f"{name}_TFLOPs"] = round(us, 1), round(tflop / us * 1e6, 1)
        return fn()

    meta = AttentionMetadata.from_lists([cached] * batch, [new] * batch, tables.tolist(), block, device=dev)
    timed("triton", lambda: tri.paged_prefill_attention(q, cache, meta, scale))
    if not flashinfer_too:
        return row
    import flashinfer

    qo_indptr = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32)
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    common = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim, sm_scale=scale,
                  q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def paged(tokens: int, causal: bool, backend: str = "auto") -> object:
        """A paged prefill wrapper over each sequence's first `tokens` tokens, planned."""
        used = -(-tokens // block)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo_indptr, torch.arange(0, (batch + 1) * used, used, dtype=torch.int32),
               torch.from_numpy(tables[:, :used].reshape(-1).astype(np.int32)),
               torch.full((batch,), tokens - (used - 1) * block, dtype=torch.int32), page_size=block, causal=causal,
               **common)
        return w

    whole = {}
    for backend in ("fa3", "fa2"):
        try:
            w = paged(ctx, True, backend)
        except (RuntimeError, ValueError) as e:  # fa3 needs sm90a
            row[f"flashinfer_{backend}"] = f"unavailable: {type(e).__name__}"
            continue
        whole[backend] = timed(f"flashinfer_{backend}", lambda w=w: w.run(q, cache))
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    ragged.plan(qo_indptr, qo_indptr, causal=True, **common)
    prefix = paged(cached, False) if cached else None

    def split() -> torch.Tensor:
        out, lse = ragged.run(q, k, v, return_lse=True)
        if prefix is None:
            return out
        out_p, lse_p = prefix.run(q, cache, return_lse=True)
        return flashinfer.merge_state(out_p, lse_p, out, lse)[0]

    got = timed("flashinfer_split", split)
    if whole:
        row["split_max_err"] = round(float((got.float() - next(iter(whole.values())).float()).abs().max()), 4)
    return row


SWEPT = ("splits", "block_n", "warps", "stages")


def _settings(text: str | None, names: tuple[str, ...] = ()) -> list:
    """A comma list of ints (and of `names`), or [None] (the kernel's default) when the flag is not given."""
    if text is None:
        return [None]
    return [t if t in names else int(t) for t in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="16:8,32:8", help="query:kv heads, comma-separated (Qwen3-0.6B 16:8, -8B 32:8)")
    p.add_argument("--batch", help="batch sizes (default 1,64,256; with --prefill, 1)")
    p.add_argument("--ctx", default="128,1024,4096", help="context lengths, tokens")
    p.add_argument("--iters", type=int, default=50, help="timed repetitions per point")
    p.add_argument("--splits", help="triton sweep: context splits per sequence, a comma list of counts, 'auto' (its "
                                    "policy for the context) and 'graph' (its policy for --max-model-len)")
    p.add_argument("--block-n", help="triton sweep: keys per tile, a comma list")
    p.add_argument("--warps", help="triton sweep: num_warps of the decode kernel, a comma list")
    p.add_argument("--stages", help="triton sweep: num_stages of the decode kernel, a comma list")
    p.add_argument("--max-model-len", type=int, default=40960,
                   help="the context a decode graph sizes its splits for ('graph' splits)")
    p.add_argument("--no-flashinfer", action="store_true", help="time the triton kernel only")
    p.add_argument("--graph", action="store_true",
                   help="time decode kernels replayed from a CUDA graph (as the engine's decode steps run) instead of "
                        "eager launches, which time the host below ~100 us")
    p.add_argument("--prefill", help="time prompt-chunk steps instead: NEWxCTX points, comma-separated (NEW tokens "
                                     "per sequence ending at context CTX; --batch sequences; --ctx unused)")
    p.add_argument("--block", default="16", help="KV page sizes, tokens, comma-separated")
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.block.split(",")]
    args.batch = args.batch or ("1" if args.prefill else "1,64,256")
    if args.prefill:
        for h, b, point_, block in itertools.product(args.heads.split(","), args.batch.split(","),
                                                     args.prefill.split(","), blocks):
            hq, hkv = map(int, h.split(":"))
            new, ctx = map(int, point_.lower().split("x"))
            print(json.dumps(prefill_point(hq, hkv, int(b), new, ctx, args.iters, block,
                                           flashinfer_too=not args.no_flashinfer)), flush=True)
        return 0
    sweep = None
    if any(v is not None for v in (args.splits, args.block_n, args.warps, args.stages)):
        sweep = {"splits": _settings(args.splits, ("auto", "graph")), "block_n": _settings(args.block_n),
                 "warps": _settings(args.warps), "stages": _settings(args.stages), "max_model_len": args.max_model_len}
    for h in args.heads.split(","):
        hq, hkv = map(int, h.split(":"))
        for b in map(int, args.batch.split(",")):
            for c, block in itertools.product(map(int, args.ctx.split(",")), blocks):
                for row in point(hq, hkv, b, c, args.iters, block, sweep=sweep, flashinfer_too=not args.no_flashinfer,
                                 graph=args.graph):
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
