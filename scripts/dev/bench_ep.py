"""Expert-parallel all-to-all of one MoE layer: kernels/moe/expert_parallel.py's dispatch and combine, timed (or,
with --all2all-backend allgather_reducescatter, kernels/moe/ep_allgather.py's gather and reduce).

--world-size processes, one expert-parallel rank each (cuda:RANK over NCCL, or host memory over gloo with
--device cpu), rendezvous on a free TCP port of 127.0.0.1. Every rank routes its own --tokens tokens (random
logits, softmax top-k, the k weights renormalised to sum to 1; a fixed seed per rank and token count;
--skew S adds S to the logits of the first --skew-experts experts, the hot experts of an unbalanced batch),
then times dispatch -> identity "experts" (each received row times the weights of its slots on that rank) ->
combine, as the engine's ExpertParallelExperts runs them, without the expert GEMMs: what is left is the
all-to-all's cost (the split sizes' all-to-all, its host sync, the rows' and routing's all-to-alls, the gather
and the partial sums' add). Each iteration starts after a barrier; CUDA events time it on a GPU,
time.perf_counter on CPU.

Per token count, rank 0 prints one JSON line: dispatch_ms, combine_ms and layer_ms are each the mean over
--iters, maxed over the ranks (they wait for each other in every all-to-all, so the slowest rank is the layer's
time); bytes_per_rank is the hidden rows a rank sends, dispatch's (one per token and rank owning one of its
experts) plus combine's (one per row it received), x hidden x element size, for the rank sending most
(remote_bytes_per_rank: less the rows a rank sends to itself; the routing and split sizes are not counted), and
gbps is bytes_per_rank / layer_ms. rank_imbalance is the max over ranks / mean of the (token, expert) slots each
rank's experts computed (its load); expert_imbalance the max over experts / mean of every rank's routed slots
per expert (1.0 when nothing was routed). slot_rows_ratio is the rows a dispatch sending one row per slot (top-k
rows per token) would send over the rows sent. per_rank has each rank's own numbers. The first line is an "env"
record.

With --all2all-backend allgather_reducescatter the layer is GatheredTokenExperts (every rank runs --tokens rows,
an idle rank zero rows padded to them): dispatch_ms is its gather (the rows' and routing's all-gathers), combine_ms
its reduce (the reduce-scatter), the identity experts in between scale each gathered row by the weights of this
rank's slots of it; bytes_per_rank counts the rows gathered and the partial sums reduced (ep x rows each, own ones
included), rows_sent and rows_received ep x rows each.

Correctness, every run: with identity experts and weights summing to 1, combine must give back each rank's
input hidden states (to the dtype's rounding) and each rank's received rows must be the slots routed to its
experts; otherwise the run fails (exit status 1), as it does when any rank fails or --timeout-s passes.
FLOTILLA_BENCH_EP_FAULT=RANK:raise|hang|corrupt makes that rank fail or hang before its first collective, or
hand combine a wrong row (for tests of those failures).

    # 8 GPUs of one host, DeepSeek-V3's MoE shape (256 experts, top-8, hidden 7168, bf16)
    python -m flotilla.scripts.dev.bench_ep --world-size 8 --json ep.json
    # with hot experts
    python -m flotilla.scripts.dev.bench_ep --world-size 8 --skew 4 --json ep_skew.json
    # a CPU smoke run (gloo)
    python -m flotilla.scripts.dev.bench_ep --device cpu --world-size 2 --experts 8 --top-k 2 --hidden 32 \\
        --dtype float32 --tokens 0,1,5 --iters 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from flotilla import envs
from flotilla.kernels.moe import MoEBackend
from flotilla.kernels.moe.ep_allgather import GatheredTokenExperts
from flotilla.kernels.moe.expert_parallel import (
    Dispatched,
    ExpertPlacement,
    combine,
    dispatch,
)
from flotilla.server.cli import HelpFormatter

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}
"""(rtol, atol) of the identity check: k weighted rows, each rounded to the dtype, summed to one row."""
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FAULT_ENV = "FLOTILLA_BENCH_EP_FAULT"


class BenchError(Exception):
    """A rank got wrong rows back or failed: the run measured nothing trustworthy."""


# ---- one rank ---------------------------------------------------------------------------------------------


def routing(args: argparse.Namespace, rank: int, tokens: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's hidden [T, H] and routing (weights float32 [T, k] summing to 1, ids int32 [T, k]) for `tokens`,
    from a seed of its own (--seed, the rank, the token count)."""
    if args.idle_ranks and rank >= args.world_size - args.idle_ranks:
        tokens = 0
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + tokens)
    logits = torch.randn(tokens, args.experts, generator=g)
    if args.skew:
        logits[:, :args.skew_experts] += args.skew
    top, ids = torch.topk(logits, args.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    hidden = torch.randn(tokens, args.hidden, generator=g).to(DTYPES[args.dtype])
    return hidden.to(device), weights.to(device), ids.to(torch.int32).to(device)


def check_identity(out: torch.Tensor, hidden: torch.Tensor, rank: int, tokens: int) -> None:
    """combine's result with identity experts and weights summing to 1 must be the input: else BenchError."""
    if out.shape != hidden.shape or out.dtype != hidden.dtype:
        raise BenchError(f"rank {rank}, {tokens} tokens: combine gave {tuple(out.shape)} {out.dtype}, expected "
                         f"{tuple(hidden.shape)} {hidden.dtype}")
    rtol, atol = TOLERANCE[hidden.dtype]
    bad = ~torch.isclose(out.float(), hidden.float(), rtol=rtol, atol=atol)
    if bad.any():
        rows = bad.any(1).nonzero().flatten()[:8].tolist()
        err = (out.float() - hidden.float()).abs().max().item()
        raise BenchError(f"rank {rank}, {tokens} tokens: combine(dispatch(x)) with identity experts is not x in "
                         f"rows {rows} (max abs error {err:.3g}, rtol {rtol}, atol {atol})")


def _fault(rank: int) -> str | None:
    spec = envs.FLOTILLA_BENCH_EP_FAULT
    if not spec:
        return None
    who, _, kind = spec.partition(":")
    return kind if int(who) == rank else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _identity_share(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    local_ids: torch.Tensor, masked: bool = True) -> torch.Tensor:
    """Identity experts' part of each gathered row: the row times the weights of this rank's slots of it."""
    return (rows.float() * (weights * (local_ids >= 0)).sum(1, keepdim=True)).to(rows.dtype)


def _time_phases(args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device,
                 barrier_ids: list[int] | None, first, second) -> tuple[list[float], list[float], Any, Any]:
    """Warm up, then time --iters runs of first() (dispatch, or gather) and second(its result) (the identity
    experts and combine, or reduce), each run after a barrier; CUDA events on a GPU, perf_counter on CPU.
    (ms of first per timed run, ms of second per timed run, the last run's first result, its second result)."""
    cuda = device.type == "cuda"
    disp: list[float] = []
    comb: list[float] = []
    a = b = None
    for i in range(args.warmup + args.iters):
        dist.barrier(group=group, device_ids=barrier_ids)
        _sync(device)
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
        t0 = time.perf_counter()
        a = first()
        if cuda:
            events[1].record()
        t1 = time.perf_counter()
        b = second(a)
        if cuda:
            events[2].record()
            events[2].synchronize()
            d_ms, c_ms = events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])
        else:
            d_ms, c_ms = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        if i >= args.warmup:
            disp.append(d_ms)
            comb.append(c_ms)
    return disp, comb, a, b


def _numbers(rank: int, tokens: int, disp: list[float], comb: list[float], **counts: Any) -> dict[str, Any]:
    """One rank's record for one token count: the times' means (and the fastest layer) and its counts."""
    layer = [d + c for d, c in zip(disp, comb, strict=True)]
    return {"rank": rank, "tokens": tokens, "dispatch_ms": statistics.fmean(disp), "combine_ms": statistics.fmean(comb),
            "layer_ms": statistics.fmean(layer), "layer_ms_min": min(layer), **counts}


def measure_gathered(args: argparse.Namespace, rank: int, tokens: int, group: dist.ProcessGroup,
                     device: torch.device, barrier_ids: list[int] | None) -> dict[str, Any]:  # fmt: skip
    """measure() for GatheredTokenExperts: gather + identity share + reduce."""
    placement = ExpertPlacement(args.experts, args.world_size, rank, device)
    layer = GatheredTokenExperts(placement, group, MoEBackend(name="identity", fused_experts=_identity_share))
    hidden, weights, ids = routing(args, rank, tokens, device)
    padded = tokens if args.idle_ranks < args.world_size else 0
    corrupt = _fault(rank) == "corrupt"

    def reduce(gathered) -> torch.Tensor:
        if gathered is None:  # every rank agreed on no rows
            return hidden[:0]
        part = _identity_share(gathered[0], hidden, hidden, gathered[1], gathered[2])
        if corrupt and part.shape[0]:
            part[0] += 1
        return layer.reduce(part, hidden.shape[0])

    disp, comb, _, out = _time_phases(args, group, device, barrier_ids,
                                      lambda: layer.gather(hidden, weights, ids, padded), reduce)
    try:
        check_identity(out, hidden, rank, tokens)
        error = None
    except BenchError as e:
        error = str(e)
    row_bytes = args.hidden * hidden.element_size()
    ep = args.world_size
    return _numbers(rank, hidden.shape[0], disp, comb, rows_sent=ep * padded, rows_received=ep * padded,
                    slots_computed=int(placement.local_expert_load.sum()), slot_rows=ids.numel(),
                    bytes=2 * ep * padded * row_bytes, remote_bytes=2 * (ep - 1) * padded * row_bytes,
                    local_expert_load=placement.local_expert_load.tolist(), error=error)


def measure(args: argparse.Namespace, rank: int, tokens: int, group: dist.ProcessGroup, device: torch.device,
            barrier_ids: list[int] | None) -> dict[str, Any]:
    """Warm up, time --iters layers of dispatch + identity experts + combine, check the last one: this rank's
    numbers for one token count."""
    if args.all2all_backend == "allgather_reducescatter":
        return measure_gathered(args, rank, tokens, group, device, barrier_ids)
    placement = ExpertPlacement(args.experts, args.world_size, rank, device)
    hidden, weights, ids = routing(args, rank, tokens, device)
    corrupt = _fault(rank) == "corrupt"

    def combined(sent: Dispatched) -> torch.Tensor:
        expert_out = _identity_share(sent.hidden, hidden, hidden, sent.weights, sent.local_ids)
        if corrupt and expert_out.shape[0]:
            expert_out[0] += 1
        return combine(expert_out, sent, group)

    disp, comb, sent, out = _time_phases(args, group, device, barrier_ids,
                                         lambda: dispatch(hidden, weights, ids, placement, group), combined)
    received = sum(sent.recv_splits)
    slots = int((sent.local_ids >= 0).sum())
    try:  # reported after every rank's numbers are gathered, so that every rank fails with every rank's reason
        check_identity(out, hidden, rank, tokens)
        if slots != int(placement.local_expert_load.sum()):
            raise BenchError(f"rank {rank}: received {slots} slots, its experts' load counts "
                             f"{int(placement.local_expert_load.sum())}")
        error = None
    except BenchError as e:
        error = str(e)
    row_bytes = args.hidden * hidden.element_size()
    sent_rows = sum(sent.send_splits)
    remote = sent_rows - sent.send_splits[rank] + received - sent.recv_splits[rank]
    return _numbers(rank, hidden.shape[0], disp, comb, rows_sent=sent_rows, rows_received=received,
                    slots_computed=slots, slot_rows=ids.numel(), bytes=(sent_rows + received) * row_bytes,
                    remote_bytes=remote * row_bytes, local_expert_load=placement.local_expert_load.tolist(),
                    error=error)


def _sig(x: float) -> float:
    """x to 4 significant digits (a toy run's few bytes stay above zero)."""
    return float(f"{x:.4g}")


def aggregate(args: argparse.Namespace, tokens: int, ranks: list[dict[str, Any]], backend: str) -> dict[str, Any]:
    """Rank 0's record for one token count from every rank's numbers."""
    layer_ms = max(r["layer_ms"] for r in ranks)
    work = [r["slots_computed"] for r in ranks]
    load = [n for r in ranks for n in r["local_expert_load"]]  # rank order = expert order (contiguous placement)

    def imbalance(xs: list[int]) -> float:
        mean = statistics.fmean(xs) if xs else 0.0
        return max(xs) / mean if mean > 0 else 1.0

    busiest = max(r["bytes"] for r in ranks)
    remote = max(r["remote_bytes"] for r in ranks)
    sent, slot_rows = sum(r["rows_sent"] for r in ranks), sum(r["slot_rows"] for r in ranks)
    per_rank = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("local_expert_load", "error")}
                for r in ranks]
    return {"bench": "ep_all_to_all", "world_size": args.world_size, "tokens_per_rank": tokens,
            "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "dtype": args.dtype,
            "skew": args.skew, "idle_ranks": args.idle_ranks, "iters": args.iters,
            "dispatch_ms": round(max(r["dispatch_ms"] for r in ranks), 4),
            "combine_ms": round(max(r["combine_ms"] for r in ranks), 4), "layer_ms": round(layer_ms, 4),
            "bytes_per_rank": busiest, "remote_bytes_per_rank": remote,
            "gbps": _sig(busiest / layer_ms / 1e6) if layer_ms > 0 else 0.0,
            "remote_gbps": _sig(remote / layer_ms / 1e6) if layer_ms > 0 else 0.0,
            "rank_imbalance": round(imbalance(work), 4), "expert_imbalance": round(imbalance(load), 4),
            "slot_rows_ratio": round(slot_rows / sent, 4) if sent else 1.0,
            "backend": backend, "all2all_backend": args.all2all_backend, "per_rank": per_rank}


def rank_main(rank: int, args: argparse.Namespace, init_method: str, result: str) -> None:
    """One expert-parallel rank (torch.multiprocessing entry point): every token count, rank 0 writing the
    records to `result`."""
    os.environ.update(CHILD_ENV)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if _fault(rank) == "raise":
        raise BenchError(f"rank {rank}: failing on purpose ({FAULT_ENV})")
    if _fault(rank) == "hang":
        time.sleep(10 * args.timeout_s)
    dist.init_process_group(backend, init_method=init_method, world_size=args.world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=args.timeout_s),
                            **({"device_id": device} if cuda else {}))
    group = dist.group.WORLD
    try:
        records = [env_record(args, backend, device)] if rank == 0 else []
        for tokens in args.tokens:
            mine = measure(args, rank, tokens, group, device, [rank] if cuda else None)
            every: list[Any] = [None] * args.world_size
            dist.all_gather_object(every, mine, group=group)
            errors = [r["error"] for r in every if r["error"]]
            if errors:
                raise BenchError("; ".join(errors))
            if rank == 0:
                records.append(aggregate(args, tokens, every, backend))
        if rank == 0:
            Path(result).write_text(json.dumps(records))
        dist.barrier(group=group, device_ids=[rank] if cuda else None)
    finally:
        dist.destroy_process_group()


def env_record(args: argparse.Namespace, backend: str, device: torch.device) -> dict[str, Any]:
    rec: dict[str, Any] = {"bench": "env", "command": None,  # the launcher's, filled in by launch()
                           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "torch": torch.__version__, "backend": backend, "device": args.device,
                           "world_size": args.world_size, "cpu_threads_per_rank": torch.get_num_threads(),
                           "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        rec["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        rec["gpus"] = [torch.cuda.get_device_name(i) for i in range(args.world_size)]
        rec["env"] = {k: os.environ.get(k) for k in CHILD_ENV}
    return rec


# ---- the launcher ---------------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every rank; their records (env first), or BenchError if a rank failed or the run timed out."""
    from flotilla.transport.endpoints import free_tcp_port

    init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
    with tempfile.TemporaryDirectory(prefix="bench_ep.") as folder:
        result = str(Path(folder) / "records.json")
        ctx = mp.start_processes(rank_main, args=(args, init_method, result), nprocs=args.world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout_s
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())), grace_period=5):
                if time.monotonic() >= deadline:
                    raise BenchError(f"the ranks did not finish within --timeout-s {args.timeout_s:g}")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise BenchError(f"rank {e.error_index} failed: {str(e).strip()[-3000:]}") from None
        finally:
            for p in ctx.processes:  # only ours, and only those still running (timeout / failure)
                if p.is_alive():
                    p.kill()
                    p.join()
        if not os.path.exists(result):
            raise BenchError("rank 0 finished without writing its records")
        records = json.loads(Path(result).read_text())
    records[0]["command"] = shlex.join(sys.orig_argv)
    return records


def _line(r: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in r.items() if k != "per_rank"})


def _csv_counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 0, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="bench_ep", description=__doc__, formatter_class=HelpFormatter)
    where = p.add_argument_group("ranks")
    where.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu",
                       help="cuda: rank r on cuda:r over NCCL; cpu: every rank in host memory over gloo")
    where.add_argument("--world-size", type=int, default=None,
                       help="expert-parallel ranks, one process each (default: every visible GPU, or 2 on cpu)")
    shape = p.add_argument_group("MoE shape (default: DeepSeek-V3's)")
    shape.add_argument("--experts", type=int, default=256, help="routed experts (a multiple of --world-size)")
    shape.add_argument("--top-k", type=int, default=8, help="experts per token")
    shape.add_argument("--hidden", type=int, default=7168, help="hidden size: the width of a dispatched row")
    shape.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="activation element type")
    shape.add_argument("--all2all-backend", choices=["all_to_all", "allgather_reducescatter"], default="all_to_all",
                       help="how tokens reach their experts: the engine's all2all_backend (see above)")
    work = p.add_argument_group("workload")
    work.add_argument("--tokens", type=_csv_counts, default="1,16,64,256",
                      help="tokens per rank, comma-separated (0 allowed: an idle rank's empty batch): one record each")
    work.add_argument("--idle-ranks", type=int, default=0,
                      help="the last this-many ranks route no tokens whatever --tokens says (idle data-parallel "
                           "ranks, which still take part in every all-to-all)")
    work.add_argument("--skew", type=float, default=0.0,
                      help="added to the router logits of the first --skew-experts experts (hot experts: expert "
                           "and rank imbalance); 0 is uniform random routing")
    work.add_argument("--skew-experts", type=int, default=None, help="experts --skew favours (default: --top-k)")
    work.add_argument("--seed", type=int, default=0, help="routing and hidden-state seed (mixed with rank and tokens)")
    run_group = p.add_argument_group("run")
    run_group.add_argument("--iters", type=int, default=20, help="timed layers per token count (the mean reported)")
    run_group.add_argument("--warmup", type=int, default=3, help="untimed layers before them")
    run_group.add_argument("--timeout-s", type=float, default=300.0,
                           help="the whole run (and each collective) must finish within this many seconds, or every "
                                "rank is killed and the exit status is 1")
    run_group.add_argument("--json", default=None, help="write the env record and every token count's record here")
    args = p.parse_args(argv)
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.skew_experts is None:
        args.skew_experts = args.top_k
    if args.world_size < 1 or min(args.experts, args.top_k, args.hidden, args.iters, args.skew_experts) < 1 \
            or args.warmup < 0 or args.timeout_s <= 0:
        p.error("--world-size, --experts, --top-k, --hidden, --iters, --skew-experts must be >= 1, --warmup >= 0, "
                "--timeout-s > 0")
    if args.experts % args.world_size:
        p.error(f"--experts {args.experts} must be a multiple of --world-size {args.world_size} (ExpertPlacement "
                "splits the experts evenly)")
    if args.top_k > args.experts or args.skew_experts > args.experts:
        p.error("--top-k and --skew-experts cannot exceed --experts")
    if not 0 <= args.idle_ranks <= args.world_size:
        p.error("--idle-ranks must be between 0 and --world-size")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        p.error(f"--world-size {args.world_size} needs that many GPUs; {torch.cuda.device_count()} visible")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        records = launch(args)
    except BenchError as e:
        print(f"bench_ep: {e}", file=sys.stderr)
        return 1
    for r in records:
        print(_line(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
