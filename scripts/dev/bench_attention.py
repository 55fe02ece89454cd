"""Paged decode attention on the GPU: each backend's time and KV bandwidth over batch x context x GQA shape.

One new token per sequence over a paged bf16 cache (block 16, blocks shuffled as a running engine leaves
them); every kernel reads the whole context once, so GB/s = the KV bytes of the batch over the kernel's time
(compare it with the GPU's memory bandwidth). Backends: flashinfer's decode wrapper with and without tensor cores (its
use_tensor_cores), and flotilla's triton split-K decode kernel. Prints one JSON line per point.

    python -m flotilla.scripts.dev.bench_attention --heads 16:8,32:8 --batch 1,64,256 --ctx 128,1024,4096

With --splits, --block-n, --warps or --stages the triton kernel is also timed at every combination of those launch
settings, a JSON line each ("auto" splits: the count its policy picks for the context, as an eager step does;
"graph": the count a decode graph fixes for --max-model-len):

    python -m flotilla.scripts.dev.bench_attention --heads 32:8 --batch 16,64 --ctx 32768 \
        --splits graph,4,8,16,32 --warps 4,8 --stages 2,3,4
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


def point(hq: int, hkv: int, batch: int, ctx: int, iters: int, block: int = 16, head_dim: int = 128,
          sweep: dict[str, list] | None = None, flashinfer_too: bool = True) -> list[dict]:
    """The backends' times at one shape (a row), then one row per combination of the triton launch settings in
    `sweep` (splits, block_n, warps, stages; None = the kernel's default)."""
    from flotilla.kernels.triton import attention as tri

    dev = torch.device("cuda")
    pages = -(-ctx // block)
    num_blocks = batch * pages + 1
    cache = torch.randn(num_blocks, 2, block, hkv, head_dim, dtype=torch.bfloat16, device=dev)
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks - 1)[: batch * pages].reshape(batch, pages).astype(np.int32)
    q = torch.randn(batch, hq, head_dim, dtype=torch.bfloat16, device=dev)
    scale = head_dim ** -0.5
    kv_bytes = batch * ctx * 2 * hkv * head_dim * 2
    row = {"heads": f"{hq}:{hkv}", "batch": batch, "ctx": ctx}
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32)
    indices = torch.from_numpy(tables.reshape(-1))
    last = torch.full((batch,), ctx - (pages - 1) * block, dtype=torch.int32)
    for tc in (True, False) if flashinfer_too else ():
        import flashinfer

        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=block,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
        us = _time(lambda: w.run(q, cache), iters)
        row[f"flashinfer_tc{int(tc)}_us"] = round(us, 1)
        row[f"flashinfer_tc{int(tc)}_GBps"] = round(kv_bytes / us / 1000, 1)
    meta = AttentionMetadata.from_lists([ctx - 1] * batch, [1] * batch, tables.tolist(), block, device=dev)
    us = _time(lambda: tri.paged_decode_attention(q, cache, meta, scale), iters)
    row["triton_us"], row["triton_GBps"] = round(us, 1), round(kv_bytes / us / 1000, 1)
    rows = [row]
    if sweep:
        for splits, block_n, warps, stages in itertools.product(*(sweep[k] for k in SWEPT)):
            n = {"auto": None, "graph": tri._decode_num_splits(batch, hkv, sweep["max_model_len"])}.get(splits, splits)
            us = _time(lambda: tri.paged_decode_attention(q, cache, meta, scale, num_splits=n, block_n=block_n,
                                                          num_warps=warps, num_stages=stages), iters)
            rows.append({"heads": row["heads"], "batch": batch, "ctx": ctx, "splits": splits if n is None else n,
                         "block_n": block_n, "warps": warps, "stages": stages, "triton_us": round(us, 1),
                         "triton_GBps": round(kv_bytes / us / 1000, 1)})
    return rows


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
    p.add_argument("--batch", default="1,64,256", help="batch sizes")
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
    args = p.parse_args(argv)
    sweep = None
    if any(v is not None for v in (args.splits, args.block_n, args.warps, args.stages)):
        sweep = {"splits": _settings(args.splits, ("auto", "graph")), "block_n": _settings(args.block_n),
                 "warps": _settings(args.warps), "stages": _settings(args.stages), "max_model_len": args.max_model_len}
    for h in args.heads.split(","):
        hq, hkv = map(int, h.split(":"))
        for b in map(int, args.batch.split(",")):
            for c in map(int, args.ctx.split(",")):
                for row in point(hq, hkv, b, c, args.iters, sweep=sweep, flashinfer_too=not args.no_flashinfer):
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
