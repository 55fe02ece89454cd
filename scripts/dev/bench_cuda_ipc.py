"""KV bytes per second through the cuda_ipc backend, per transfer size, between two processes of one host.

A child process holds a prefill KV cache at a real model's KV shape (default Qwen3-8B: 36 layers, 8 KV heads, head_dim
128, bf16, the engine's block size) on --src-device, its layers in one allocation as the worker keeps them, and
registers it with a CudaIpcEngine as one region; this process maps it and reads, for each --blocks size, that many
scattered blocks of every layer into its own cache on --dst-device (random block ids on both sides, as an allocator
hands them out: one range per block per layer, merged where ids run on, all layers in one read), exactly as the
KV-migration actor's reads do. Reported per size: the median and best
seconds of --repeat reads after --warmup, GB/s (1e9 bytes/s of the KV moved), and, for reference, a plain copy of
the same bytes within this process (contiguous, one copy per layer). After the last read the blocks are checked
byte for byte against the child's.

    python -m flotilla.scripts.dev.bench_cuda_ipc --blocks 1,4,16,64,256,1024 --json ipc.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import msgspec
import torch
import uvloop

from flotilla.config import DEFAULT_BLOCK_SIZE
from flotilla.kernels.attention import kv_cache_shape
from flotilla.scripts.dev.bench_shapes import SHAPES
from flotilla.transport.kv_transfer import kv_block_table
from flotilla.transport.data_plane import EndpointInfo, RegionInfo

EXPORTER = r"""
import sys, msgspec, torch
from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine
layers, blocks, device, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
shape = msgspec.json.decode(sys.argv[5])
torch.manual_seed(seed)
cache = torch.randint(0, 256, (layers, blocks, *shape), dtype=torch.uint8, device=device)
engine = CudaIpcEngine(host="127.0.0.1")
region = engine.register("kv", cache)
torch.cuda.synchronize()
print(msgspec.json.encode([engine.endpoint_info(), region]).decode(), flush=True)
sys.stdin.readline()
engine.close()
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    qwen = SHAPES["qwen3-8b"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=qwen["num_hidden_layers"])
    p.add_argument("--kv-heads", type=int, default=qwen["num_key_value_heads"])
    p.add_argument("--head-dim", type=int, default=qwen["head_dim"])
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--element-bytes", type=int, default=2, help="bytes per KV element (bf16: 2)")
    p.add_argument("--cache-blocks", type=int, default=4096, help="blocks in each side's cache")
    p.add_argument("--blocks", default="1,4,16,64,256,1024", help="transfer sizes, blocks of every layer")
    p.add_argument("--src-device", default="cuda:0")
    p.add_argument("--dst-device", default="cuda:0")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


async def bench(args: argparse.Namespace, endpoint: EndpointInfo, region: RegionInfo, block_bytes: int
                ) -> tuple[list[dict[str, Any]], torch.Tensor, list[int], list[int]]:
    """The rows, this side's cache [layers, blocks, block_bytes], and the last transfer's (source, destination)
    block ids."""
    from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine

    dst = torch.zeros(args.layers, args.cache_blocks, block_bytes, dtype=torch.uint8, device=args.dst_device)
    engine = CudaIpcEngine()
    mine = engine.register("kv", dst)
    engine.connect(endpoint)
    layer_offsets = [layer * args.cache_blocks * block_bytes for layer in range(args.layers)]
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for n in [int(x) for x in args.blocks.split(",")]:
        src_ids = torch.randperm(args.cache_blocks, generator=gen)[:n].tolist()
        dst_ids = torch.randperm(args.cache_blocks, generator=gen)[:n].tolist()

        async def once() -> float:
            t0 = time.perf_counter()
            ranges = kv_block_table(list(zip(src_ids, dst_ids)), layer_offsets, layer_offsets, block_bytes)
            await engine.read(region, ranges, mine)
            return time.perf_counter() - t0

        for _ in range(args.warmup):
            await once()
        seconds = [await once() for _ in range(args.repeat)]
        moved = n * block_bytes * args.layers
        # reference: the same bytes as one contiguous copy per layer within this process
        a = torch.empty(n * block_bytes, dtype=torch.uint8, device=args.dst_device)
        b = torch.empty_like(a)
        copies = []
        for _ in range(args.warmup + args.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.layers):
                b.copy_(a)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        copy_s = statistics.median(copies[args.warmup:])
        med = statistics.median(seconds)
        rows.append({"blocks": n, "bytes": moved, "median_s": med, "best_s": min(seconds),
                     "gb_s": moved / med / 1e9, "copy_gb_s": moved / copy_s / 1e9})
        print(f"{n:6d} blocks x {args.layers} layers  {moved / 2**20:9.1f} MiB  median {med * 1e3:8.3f} ms  "
              f"{rows[-1]['gb_s']:7.1f} GB/s   (in-process copy {rows[-1]['copy_gb_s']:7.1f} GB/s)", flush=True)
    engine.close()
    return rows, dst, src_ids, dst_ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = kv_cache_shape(1, args.block_size, args.kv_heads, args.head_dim)[1:]
    block_bytes = int(torch.Size(shape).numel()) * args.element_bytes
    child = subprocess.Popen([sys.executable, "-c", EXPORTER, str(args.layers), str(args.cache_blocks),
                              args.src_device, str(args.seed), json.dumps([block_bytes])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            raise SystemExit(f"bench_cuda_ipc: the exporting process ended ({child.wait()})")
        endpoint, region = msgspec.json.decode(line, type=tuple[EndpointInfo, RegionInfo])
        # uvloop, as the engine's actors run: its timers wake sub-millisecond polls at once, where asyncio's default
        # loop sleeps at least a millisecond (epoll's resolution) and a read would be timed to the next whole ms
        rows, dst, src_ids, dst_ids = uvloop.run(bench(args, endpoint, region, block_bytes))
        # check the last transfer: reread the child's blocks the same way into a fresh buffer and compare
        from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine

        with CudaIpcEngine() as engine:
            engine.connect(endpoint)
            whole = torch.empty_like(dst)
            uvloop.run(engine.read(region, [(0, 0, region.length)], engine.register("whole", whole)))
            for layer in range(args.layers):
                if not torch.equal(dst[layer][dst_ids], whole[layer][src_ids]):
                    raise SystemExit(f"bench_cuda_ipc: layer {layer}'s blocks differ from the exporter's")
        print("every block of the last transfer equals its source", flush=True)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(60)
    if args.json:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(args.dst_device),
                "command": " ".join(sys.argv), "block_bytes": block_bytes, "layers": args.layers}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
