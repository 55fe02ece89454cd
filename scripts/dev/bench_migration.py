"""KV migration bandwidth between two devices over the torch_dist backend (NCCL between GPUs, gloo on CPU).

A prefill KV cache (random bytes) on --src-device, a decode KV cache (zeros, plus spare blocks) on --dst-device,
at a real model's KV shape (default Qwen3-8B: 36 layers, 8 KV heads, head_dim 128, bf16, the engine's default
block size). A batch of --prompts prompts of --prompt-tokens tokens each becomes one migration per prompt
(random, scattered block ids on both sides, as an allocator hands them out), moved by:

  actor   the real path: a prefill and a decode KVMigrationActor (actors/kv_migration.py) in this process over
          the two caches, MigrateKVCmd per prompt -> KVEndpointRequest / KVSendRequest over ZeroMQ ->
          TorchDistEngine.send_blocks / recv_blocks in rounds of kv_staging_blocks -> MigrationDoneEvent;
          timed from the first command sent to the last MigrationDone received;
  engine  TorchDistEngine.send_blocks / recv_blocks called directly, as the actors call them (one migration
          per prompt, one after another: the decode actor moves one peer's migrations one at a time);
  raw     the same pair's process groups sending round-sized contiguous buffers back to back (NCCL's / gloo's
          own rate with no pack, unpack or protocol: what the rounds could reach);
  copy    a plain peer copy src -> dst of every layer's cache (torch copy_, GPU0 -> GPU1 over NVLink), the
          same bytes: the reference the others are compared with.

After the last repetition of actor and engine the decode cache is checked bit for bit: every migrated block
equals its source block and every other block is still zero. GB/s are 1e9 bytes per second of the migrated
bytes (KV of every layer of every prompt). Both ends run in this one process (two event-loop tasks, threads
for the packs and unpacks), where a deployment runs them in two: the rounds, packs and waits are the same code.

    # on a machine with two GPUs (Qwen3-8B, 16 prompts x 4096 tokens = 9.7 GB per repetition)
    python -m flotilla.scripts.dev.bench_migration --round-blocks 64,256 --json migration.json
    # a CPU smoke run (gloo)
    python -m flotilla.scripts.dev.bench_migration --device cpu --layers 2 --blocks 64 --json /tmp/m.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import logging
import math
import shlex
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import uvloop

from flotilla.actors import worker as worker_module
from flotilla.actors.base import RuntimeOptions
from flotilla.actors.runtime import Runtime
from flotilla.actors.topology import ActorSpec, Topology
from flotilla.config import DEFAULT_BLOCK_SIZE, DisaggConfig, EngineConfig
from flotilla.kernels.attention import kv_cache_shape
from flotilla.scripts.dev.bench_shapes import SHAPES
from flotilla.server.cli import HelpFormatter
from flotilla.transport import kv_transfer, kv_transfer_torch
from flotilla.transport.channels import Inbox, Outbox
from flotilla.transport.kv_transfer import create_kv_transfer_engine, kv_block_bytes
from flotilla.transport.kv_transfer_torch import TorchDistEngine
from flotilla.transport.messages import BlocksReleasedEvent, KVReadyEvent, MigrateKVCmd, MigrationDoneEvent

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}
PATHS = ("actor", "engine", "raw", "copy")


class BenchError(Exception):
    """A migration failed or landed wrong bytes: the run measured nothing trustworthy."""


@dataclass
class Setup:
    src: list[torch.Tensor]
    """Prefill caches, one per layer."""
    dst: list[torch.Tensor]
    """Decode caches, one per layer (zeroed before each repetition)."""
    prompts: list[tuple[list[int], list[int]]]
    """One migration per prompt: (src block ids, dst block ids)."""
    block_bytes: int
    """Bytes of one block of one layer."""

    @property
    def migrated_bytes(self) -> int:
        return sum(len(s) for s, _ in self.prompts) * len(self.src) * self.block_bytes

    def sync(self) -> None:
        for device in {self.src[0].device, self.dst[0].device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def zero_dst(self) -> None:
        for d in self.dst:
            d.zero_()
        self.sync()

    def check_landed(self) -> None:
        """Every migrated block is its source's bytes; every other decode block is still zero."""
        device = self.dst[0].device
        src_ids = torch.tensor([b for s, _ in self.prompts for b in s], dtype=torch.long)
        dst_ids = torch.tensor([b for _, d in self.prompts for b in d], dtype=torch.long)
        untouched = torch.ones(self.dst[0].shape[0], dtype=torch.bool)
        untouched[dst_ids] = False
        untouched = untouched.to(device)
        for layer, (s, d) in enumerate(zip(self.src, self.dst)):
            want = s.view(torch.uint8).index_select(0, src_ids.to(s.device)).to(device)
            got = d.view(torch.uint8).index_select(0, dst_ids.to(device))
            if not torch.equal(got, want):
                bad = (got != want).flatten(1).any(1).nonzero().flatten()[:8].tolist()
                raise BenchError(f"layer {layer}: migrated blocks #{bad} differ from their source blocks")
            if d.view(torch.uint8)[untouched].any():
                raise BenchError(f"layer {layer}: a block that no migration names was written")


def build_setup(args: argparse.Namespace) -> Setup:
    torch.manual_seed(args.seed)
    per_prompt = math.ceil(args.prompt_tokens / args.block_size)
    total = args.blocks if args.blocks else args.prompts * per_prompt
    if total < args.prompts:
        raise SystemExit(f"bench_migration: --blocks {total} is fewer than --prompts {args.prompts}")
    dtype = DTYPES[args.dtype]
    shape = kv_cache_shape(1, args.block_size, args.kv_heads, args.head_dim)[1:]
    src_blocks, dst_blocks = total + 1, total + 1 + args.spare_blocks
    src, dst = [], []
    for _ in range(args.layers):
        s = torch.empty((src_blocks, *shape), dtype=dtype, device=args.src_device)
        s.view(torch.uint8).random_(0, 256)  # random bytes, whatever the dtype (NaN patterns included)
        src.append(s)
        dst.append(torch.zeros((dst_blocks, *shape), dtype=dtype, device=args.dst_device))
    gen = torch.Generator().manual_seed(args.seed)
    src_ids = torch.randperm(src_blocks, generator=gen)[:total].tolist()
    dst_ids = torch.randperm(dst_blocks, generator=gen)[:total].tolist()
    bounds = [round(i * total / args.prompts) for i in range(args.prompts + 1)]
    prompts = [(src_ids[a:b], dst_ids[a:b]) for a, b in itertools.pairwise(bounds)]
    setup = Setup(src=src, dst=dst, prompts=prompts, block_bytes=kv_block_bytes(src[0]))
    setup.sync()
    return setup


def _row(path: str, seconds: list[float], moved: int, round_blocks: int | None, **extra: Any) -> dict[str, Any]:
    best, median = min(seconds), statistics.median(seconds)
    return {"path": path, "round_blocks": round_blocks, "bytes": moved, "seconds": [round(s, 6) for s in seconds],
            "gbps_best": round(moved / best / 1e9, 4), "gbps_median": round(moved / median / 1e9, 4), **extra}


# ---- copy: a plain peer copy of the same bytes ------------------------------------------------------------


def bench_copy(setup: Setup, repeat: int, warmup: int) -> dict[str, Any]:
    n = setup.src[0].shape[0]
    moved = sum(s.numel() * s.element_size() for s in setup.src)
    times = []
    for i in range(warmup + repeat):
        setup.sync()
        t0 = time.perf_counter()
        for s, d in zip(setup.src, setup.dst):
            d[:n].copy_(s, non_blocking=True)
        setup.sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    extra = {}
    a, b = setup.src[0].device, setup.dst[0].device
    if a.type == "cuda" and b.type == "cuda" and a != b:
        extra["peer_access"] = torch.cuda.can_device_access_peer(a, b)
    return _row("copy", times, moved, None, **extra)


# ---- engine and raw: two TorchDistEngines, called as the actors call them --------------------------------


async def _pair(setup: Setup, timeout_s: float) -> tuple[TorchDistEngine, TorchDistEngine, list, list]:
    pe = create_kv_transfer_engine("torch_dist", host="127.0.0.1", timeout_s=timeout_s)
    de = create_kv_transfer_engine("torch_dist", host="127.0.0.1", timeout_s=timeout_s)
    assert isinstance(pe, TorchDistEngine) and isinstance(de, TorchDistEngine)
    p_regions = [pe.register(f"kv.layer{i}", c) for i, c in enumerate(setup.src)]
    d_regions = [de.register(f"kv.layer{i}", c) for i, c in enumerate(setup.dst)]
    ep = pe.listen("decode")
    await asyncio.gather(pe.accept("decode"), asyncio.to_thread(de.connect, ep))
    return pe, de, p_regions, d_regions


async def bench_engine(setup: Setup, rounds: list[int], repeat: int, warmup: int, timeout_s: float,
                       raw: bool) -> list[dict[str, Any]]:
    pe, de, p_regions, d_regions = await _pair(setup, timeout_s)
    p_names, d_names = [r.name for r in p_regions], [r.name for r in d_regions]
    bb = setup.block_bytes
    rows = []
    try:
        for rb in rounds:
            times = []
            for i in range(warmup + repeat):
                setup.zero_dst()
                moved = 0
                t0 = time.perf_counter()
                for src_ids, dst_ids in setup.prompts:
                    _, got = await asyncio.gather(
                        pe.send_blocks("decode", p_names, src_ids, bb, rb),
                        de.recv_blocks(p_regions[0], d_names, list(zip(src_ids, dst_ids)), bb, rb))
                    moved += got
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            if moved != setup.migrated_bytes:
                raise BenchError(f"engine: received {moved} bytes, expected {setup.migrated_bytes}")
            setup.check_landed()
            rows.append(_row("engine", times, moved, rb, bit_exact=True))
        if raw:
            send_group = pe._serving["decode"].group
            recv_group = de._peers[pe.engine_id].group
            for rb in rounds:
                rows.append(await _bench_raw(setup, send_group, recv_group, rb, repeat, warmup))
    finally:
        pe.close()
        de.close()
    return rows


async def _bench_raw(setup: Setup, send_group: dist.ProcessGroup, recv_group: dist.ProcessGroup, rb: int,
                     repeat: int, warmup: int) -> dict[str, Any]:
    """Round-sized contiguous buffers over the pair's own groups, every round posted at once."""
    total = setup.migrated_bytes
    round_bytes = rb * len(setup.src) * setup.block_bytes
    sizes = [min(round_bytes, total - start) for start in range(0, total, round_bytes)]
    sbuf = torch.empty(round_bytes, dtype=torch.uint8, device=setup.src[0].device)
    rbuf = torch.empty(round_bytes, dtype=torch.uint8, device=setup.dst[0].device)

    def side(group: dist.ProcessGroup, buf: torch.Tensor, send: bool) -> None:
        works = [group.send([buf[:n]], 1, 0) if send else group.recv([buf[:n]], 0, 0) for n in sizes]
        for w in works:
            w.wait()
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)

    times = []
    for i in range(warmup + repeat):
        setup.sync()
        t0 = time.perf_counter()
        await asyncio.gather(asyncio.to_thread(side, send_group, sbuf, True),
                             asyncio.to_thread(side, recv_group, rbuf, False))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _row("raw", times, total, rb)


# ---- actor: the KV-migration actors, end to end ---------------------------------------------------------


async def bench_actor(setup: Setup, rb: int, repeat: int, warmup: int, timeout_s: float) -> dict[str, Any]:
    for name, caches in (("bench-pw", setup.src), ("bench-dw", setup.dst)):
        worker_module._LOCAL_RUNNERS[(name, 0)] = types.SimpleNamespace(kv_caches=caches, state_pools=[],
                                                                        num_state_slots=0)

    def config(workers: str) -> dict[str, Any]:
        engine = EngineConfig(disagg=DisaggConfig(kv_transfer_backend="torch_dist", kv_transfer_timeout_s=timeout_s,
                                                  kv_staging_blocks=rb))
        return {"engine": engine.to_dict(), "scheduler": "sched", "workers": workers}

    topo = Topology(name="bench-kvm", placement="inline", clients=["sched"],
                    options=RuntimeOptions(ready_timeout_s=timeout_s),
                    actors=[ActorSpec(name="p_kv", kind="kv_migration", config=config("bench-pw")),
                            ActorSpec(name="d_kv", kind="kv_migration", config=config("bench-dw"))])
    rt = Runtime(topo)
    await rt.start()
    inbox = Inbox(rt.zmq, rt.endpoints.of("sched"), (MigrationDoneEvent,))
    out = Outbox(rt.zmq, rt.endpoints.of("d_kv"))
    src_kv = rt.endpoints.of("p_kv")
    announce = Outbox(rt.zmq, src_kv)  # as a prefill scheduler does: its KV-migration rank serves these only
    times = []
    try:
        for i in range(warmup + repeat):
            setup.zero_dst()
            cmds = [MigrateKVCmd(transfer_id=f"r{i}-p{k}", src_engine="bench-prefill", src_kv=[src_kv],
                                 src_block_ids=np.asarray(s, np.int32), dst_block_ids=np.asarray(d, np.int32))
                    for k, (s, d) in enumerate(setup.prompts)]
            for cmd in cmds:  # (before the clock: the prefill scheduler announces a transfer as its prompt ends)
                await announce.send(KVReadyEvent(transfer_id=cmd.transfer_id, block_ids=cmd.src_block_ids,
                                                 num_tokens=0, first_token=0, src_engine="bench-prefill"))
            t0 = time.perf_counter()
            for cmd in cmds:
                await out.send(cmd)
            done = [await asyncio.wait_for(inbox.recv(), timeout_s * len(cmds) + 30) for _ in cmds]
            elapsed = time.perf_counter() - t0
            for cmd in cmds:
                await announce.send(BlocksReleasedEvent(transfer_id=cmd.transfer_id))
            errors = [d.error for d in done if d.error]
            if errors:
                raise BenchError(f"actor: {len(errors)} migrations failed, first: {errors[0]}")
            # the bytes actually landed are checked below; MigrationDone's count is reported as it comes
            reported = sum(d.num_bytes for d in done)
            if i >= warmup:
                times.append(elapsed)
        setup.check_landed()
    finally:
        inbox.close()
        out.close()
        announce.close()
        await rt.stop()
        for name in ("bench-pw", "bench-dw"):
            worker_module._LOCAL_RUNNERS.pop((name, 0), None)
    return _row("actor", times, setup.migrated_bytes, rb, bit_exact=True, reported_bytes=reported)


# ---- the run ----------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, setup: Setup, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    if "copy" in args.paths:
        rows.append(bench_copy(setup, args.repeat, args.warmup))
        log(_line(rows[-1]))
    for poll in [None, *args.poll_caps]:  # None: the backend's own completion polling
        with _polling(poll):
            if "engine" in args.paths or ("raw" in args.paths and poll is None):
                got = await bench_engine(setup, args.round_blocks, args.repeat, args.warmup, args.timeout,
                                         raw="raw" in args.paths and poll is None)
                for r in got:
                    if r["path"] in args.paths:
                        rows.append(_polled(r, poll, args.device == "cuda"))
                        log(_line(rows[-1]))
            if "actor" in args.paths:
                for rb in args.round_blocks:
                    rows.append(_polled(await bench_actor(setup, rb, args.repeat, args.warmup, args.timeout), poll,
                                       args.device == "cuda"))
                    log(_line(rows[-1]))
    copy = next((r for r in rows if r["path"] == "copy"), None)
    if copy is not None:
        for r in rows:
            r["vs_copy"] = round(r["gbps_median"] / copy["gbps_median"], 3)
    return rows


@contextlib.contextmanager
def _polling(cap: float | None) -> Iterator[None]:
    """Completion polling of the KV backends (transport/kv_transfer.poll_until: sleeps doubling from POLL_MIN_S to
    POLL_MAX_S, or to kv_transfer_torch.GPU_POLL_MAX_S for NCCL work) capped at `cap` seconds while the block runs;
    None leaves it as it is."""
    if cap is None:
        yield
        return
    saved = kv_transfer.POLL_MIN_S, kv_transfer.POLL_MAX_S, kv_transfer_torch.GPU_POLL_MAX_S
    kv_transfer.POLL_MIN_S, kv_transfer.POLL_MAX_S = min(saved[0], cap), cap
    kv_transfer_torch.GPU_POLL_MAX_S = cap
    try:
        yield
    finally:
        kv_transfer.POLL_MIN_S, kv_transfer.POLL_MAX_S, kv_transfer_torch.GPU_POLL_MAX_S = saved


def _polled(row: dict[str, Any], cap: float | None, gpu: bool) -> dict[str, Any]:
    """The row with the completion-polling cap its run had (the NCCL path has its own, shorter default)."""
    if row["path"] in ("engine", "actor"):
        default = kv_transfer_torch.GPU_POLL_MAX_S if gpu else kv_transfer.POLL_MAX_S
        row["poll_max_s"] = default if cap is None else cap
    return row


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _line(r: dict[str, Any]) -> str:
    rb = f" rounds of {r['round_blocks']} blocks" if r["round_blocks"] else ""
    if "poll_max_s" in r:
        rb += f", polls <= {r['poll_max_s'] * 1e3:g} ms"
    return (f"{r['path']:>6}{rb}: {r['bytes'] / 1e9:.3f} GB in {statistics.median(r['seconds']) * 1e3:.1f} ms "
            f"(median of {len(r['seconds'])}) = {r['gbps_median']:.1f} GB/s, best {r['gbps_best']:.1f} GB/s")


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _csv_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers expected, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be > 0, got {text!r}")
    return values


def _paths(text: str) -> list[str]:
    paths = [p.strip() for p in text.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        raise argparse.ArgumentTypeError(f"paths are {', '.join(PATHS)}, comma-separated; got {text!r}")
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    qwen = SHAPES["qwen3-8b"]
    p = argparse.ArgumentParser(prog="bench_migration", description=__doc__, formatter_class=HelpFormatter)
    where = p.add_argument_group("devices")
    where.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cuda: prefill cache on cuda:0, decode cache on cuda:1, NCCL; cpu: both in host memory, "
                            "gloo")
    where.add_argument("--src-device", default=None, help="the prefill cache's device (default: cuda:0 or cpu)")
    where.add_argument("--dst-device", default=None, help="the decode cache's device (default: cuda:1 or cpu)")
    shape = p.add_argument_group("KV shape (default: Qwen3-8B's)")
    shape.add_argument("--layers", type=int, default=qwen["num_hidden_layers"], help="KV cache layers")
    shape.add_argument("--kv-heads", type=int, default=qwen["num_key_value_heads"], help="KV heads per layer")
    shape.add_argument("--head-dim", type=int, default=qwen["head_dim"], help="head dimension")
    shape.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV block (the engine's default for these layers)")
    shape.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="KV cache element type")
    work = p.add_argument_group("workload")
    work.add_argument("--prompts", type=int, default=16, help="prompts migrated per repetition (one MigrateKVCmd each)")
    work.add_argument("--prompt-tokens", type=int, default=4096,
                      help="tokens per prompt (its blocks: this / --block-size, rounded up)")
    work.add_argument("--blocks", type=int, default=0,
                      help="total blocks over all prompts instead of --prompts x --prompt-tokens (0: from those)")
    work.add_argument("--spare-blocks", type=int, default=64,
                      help="extra decode-cache blocks no migration names (checked to stay zero)")
    work.add_argument("--round-blocks", type=_csv_ints, default=str(DisaggConfig().kv_staging_blocks),
                      help="blocks per send round (kv_staging_blocks), comma-separated: one row each for actor, "
                           "engine and raw")
    work.add_argument("--poll-caps", type=_csv_floats, default="",
                      help="also run engine and actor with the backend's completion polling capped at each of these "
                           "seconds (comma-separated; its sleeps otherwise double from 0.1 ms up to 5 ms, so a "
                           "round can wait up to twice its transfer time before the next one starts)")
    work.add_argument("--seed", type=int, default=0, help="seed of the cache bytes and block ids")
    run_group = p.add_argument_group("run")
    run_group.add_argument("--paths", type=_paths, default=",".join(PATHS),
                           help=f"what to measure, comma-separated, from {', '.join(PATHS)} (see above)")
    run_group.add_argument("--repeat", type=int, default=3, help="timed repetitions per row (median and best reported)")
    run_group.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    run_group.add_argument("--timeout", type=float, default=60.0,
                           help="kv_transfer_timeout_s: a migration (or pair set-up) not done in this long fails, s")
    run_group.add_argument("--json", default=None, help="write the settings and every row to this file")
    args = p.parse_args(argv)
    if args.src_device is None:
        args.src_device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.dst_device is None:
        args.dst_device = "cuda:1" if args.device == "cuda" else "cpu"
    if min(args.layers, args.kv_heads, args.head_dim, args.block_size, args.prompts, args.prompt_tokens,
           args.repeat) < 1 or min(args.warmup, args.blocks, args.spare_blocks) < 0:
        p.error("shape, --prompts, --prompt-tokens and --repeat must be >= 1; --warmup, --blocks, --spare-blocks >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for d in (args.src_device, args.dst_device):
        if d.startswith("cuda") and torch.device(d).index is not None \
                and torch.device(d).index >= torch.cuda.device_count():
            print(f"bench_migration: no {d} here ({torch.cuda.device_count()} CUDA devices)", file=sys.stderr)
            return 1
    setup = build_setup(args)
    total = setup.migrated_bytes
    print(f"{len(setup.prompts)} migrations, {sum(len(s) for s, _ in setup.prompts)} blocks x {args.layers} layers x "
          f"{setup.block_bytes} B = {total / 1e9:.3f} GB, {args.src_device} -> {args.dst_device}", flush=True)
    try:
        rows = uvloop.run(run(args, setup, lambda s: print(s, flush=True)))
    except BenchError as e:
        print(f"bench_migration: {e}", file=sys.stderr)
        return 1
    names = {d: torch.cuda.get_device_name(d) for d in (args.src_device, args.dst_device) if d.startswith("cuda")}
    report = {
        "command": shlex.join(sys.orig_argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "nccl": _nccl_version() if names else None,
        "devices": {"src": args.src_device, "dst": args.dst_device, "names": names},
        "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "block_size": args.block_size, "dtype": args.dtype, "block_bytes": setup.block_bytes},
        "workload": {"prompts": len(setup.prompts), "blocks": sum(len(s) for s, _ in setup.prompts),
                     "bytes": total, "round_blocks": args.round_blocks},
        "settings": {"repeat": args.repeat, "warmup": args.warmup, "timeout_s": args.timeout},
        "results": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
