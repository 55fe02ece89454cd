"""Control-plane micro-benchmark: StepPlan messages/s and StepPlan -> StepResult round-trip latency.

The message is a realistic decode step: 256 running sequences (rids, per-sequence token counts, a
new block for some) plus 2 new 1,000-token prompts; the answer is a StepResult with 256 sampled
tokens. Measured over inproc:// (both ends in one process), ipc:// and tcp:// on 127.0.0.1 (the peer
in a separate process), through the same Encoder/Decoder and sockets the actors use.

    flotilla bench transport [--messages 20000] [--round-trips 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import uvloop

from flotilla.sampling_params import SamplingParams
from flotilla.server.cli import HelpFormatter
from flotilla.transport import endpoints as ep
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.messages import NewSequence, StepPlan, StepResult


def step_plan(step: int, batch: int = 256, new: int = 2, prompt_len: int = 1000) -> StepPlan:
    """A decode step of ``batch`` running sequences plus ``new`` fresh prompts."""
    rng = np.random.default_rng(step)
    new_seqs = [NewSequence(rid=f"new-{step}-{i}", token_ids=rng.integers(0, 150_000, prompt_len, dtype=np.int32),
                            num_computed_tokens=0, block_ids=np.arange(prompt_len // 16 + 1, dtype=np.int32),
                            sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=512)) for i in range(new)]
    counts = (rng.random(batch) < 1 / 16).astype(np.int32)
    return StepPlan(step=step, new_seqs=new_seqs, rids=[f"cmpl-{i:08d}" for i in range(batch)],
                    num_new_tokens=np.ones(batch, np.int32), new_block_counts=counts,
                    new_block_ids=np.arange(int(counts.sum()), dtype=np.int32))


def step_result(plan: StepPlan) -> StepResult:
    return StepResult(step=plan.step, rids=plan.rids, token_ids=np.zeros(len(plan.rids), np.int32))


async def _peer(inbox_addr: str, reply_addr: str) -> None:
    """The peer process: its own zmq context, then the same loop as the in-process peer."""
    ctx = new_context()
    await _peer_inproc(ctx, inbox_addr, reply_addr)
    ctx.term()


async def _measure(scheme: str, n_messages: int, n_round_trips: int) -> dict[str, float]:
    ctx = new_context()
    run_dir = ep.new_run_dir()
    if scheme == "inproc":
        peer_in, mine = ep.inproc("bench", "peer"), ep.inproc("bench", "me")
    elif scheme == "ipc":
        peer_in, mine = ep.ipc(run_dir, "peer"), ep.ipc(run_dir, "me")
    else:
        peer_in, mine = ep.tcp("127.0.0.1", ep.free_tcp_port()), ep.tcp("127.0.0.1", ep.free_tcp_port())
    replies = Inbox(ctx, mine, (StepResult,))
    proc = None
    if scheme == "inproc":
        peer_ctx_task = asyncio.create_task(_peer_inproc(ctx, peer_in, mine))
    else:
        proc = subprocess.Popen([sys.executable, "-m", "flotilla.scripts.dev.bench_transport", "--peer", peer_in, mine])
    out = Outbox(ctx, peer_in)
    plans = [step_plan(i) for i in range(16)]
    payload_bytes = sum(len(memoryview(f).cast("B")) for f in out.encoder.encode(plans[0]))
    # warm up and make sure the peer is there
    await out.send(plans[0])
    await replies.recv()
    # latency: one in flight
    lat = []
    for i in range(n_round_trips):
        t0 = time.perf_counter_ns()
        await out.send(plans[i % 16])
        await replies.recv()
        lat.append((time.perf_counter_ns() - t0) / 1000)
    # throughput: many in flight; count replies so the peer's decode + encode is included
    t0 = time.perf_counter()
    drain = asyncio.create_task(_drain(replies, n_messages))
    for i in range(n_messages):
        await out.send(plans[i % 16])
    await drain
    elapsed = time.perf_counter() - t0
    await out.send(StepPlan(step=-1))
    await replies.recv()
    if proc is not None:
        proc.wait(timeout=10)
    else:
        await peer_ctx_task
    out.close()
    replies.close()
    ctx.term()
    lat.sort()
    return {"transport": scheme, "message_bytes": payload_bytes, "messages_per_s": n_messages / elapsed,
            "rtt_p50_us": statistics.median(lat), "rtt_p99_us": lat[int(0.99 * (len(lat) - 1))]}


async def _peer_inproc(ctx, inbox_addr: str, reply_addr: str) -> None:
    """Answer every StepPlan with a StepResult; a StepPlan with step < 0 ends the run."""
    inbox, out = Inbox(ctx, inbox_addr, (StepPlan,)), Outbox(ctx, reply_addr)
    while True:
        plan = await inbox.recv()
        await out.send(step_result(plan))
        if plan.step < 0:
            break
    inbox.close()
    out.close()


async def _drain(inbox: Inbox, n: int) -> None:
    for _ in range(n):
        await inbox.recv()


async def _send_recv_costs(n: int, reps: int = 7) -> list[dict[str, float | str]]:
    """us per send + receive of one message in one event loop over inproc, through the channels (their
    no-wait path first) and through zmq.asyncio's futures alone (the channels' path when they must wait): what the
    channels' fast path saves per message (transport/channels.py). Median of `reps` runs of n, interleaved."""
    ctx = new_context()
    rows = []
    small = StepResult(step=1, rids=["a"], token_ids=np.array([5], dtype=np.int32))
    for i, (label, msg, kind) in enumerate((("StepResult, 1 token", small, StepResult),
                                            ("StepPlan, 256 sequences", step_plan(1), StepPlan))):
        inbox, out = Inbox(ctx, f"inproc://send-recv-{i}", (kind,)), Outbox(ctx, f"inproc://send-recv-{i}")

        async def channels() -> None:
            for _ in range(n):
                await out.send(msg)
                await inbox.recv()

        async def asyncio_only() -> None:
            for _ in range(n):
                await out.sock.send_multipart(out.encoder.encode(msg), copy=False)
                inbox._decode(await inbox.sock.recv_multipart(copy=False))

        times: dict[str, list[float]] = {"channels": [], "zmq_asyncio": []}
        for _ in range(reps):
            for name, run in (("channels", channels), ("zmq_asyncio", asyncio_only)):
                t0 = time.perf_counter()
                await run()
                times[name].append((time.perf_counter() - t0) * 1e6 / n)
        rows.append({"message": label, **{f"{k}_us": round(sorted(v)[reps // 2], 1) for k, v in times.items()}})
        inbox.close()
        out.close()
    end_context(ctx)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flotilla bench transport", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--messages", type=int, default=20_000, help="StepPlans sent for the throughput figure")
    p.add_argument("--round-trips", type=int, default=2_000, help="round trips for the latency figure")
    p.add_argument("--transports", default="inproc,ipc,tcp", help="comma-separated: inproc, ipc, tcp")
    p.add_argument("--send-recv", action="store_true",
                   help="also time one send + receive in one loop through the channels against zmq.asyncio alone")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--peer", nargs=2, metavar=("INBOX", "REPLY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        uvloop.run(_peer(*args.peer))
        return 0
    results = []
    for scheme in args.transports.split(","):
        r = uvloop.run(_measure(scheme, args.messages, args.round_trips))
        results.append(r)
        print(f"{r['transport']:>6}: {r['message_bytes']:,} B StepPlan, {r['messages_per_s']:,.0f} msg/s, "
              f"round trip p50 {r['rtt_p50_us']:.0f} us, p99 {r['rtt_p99_us']:.0f} us", flush=True)
    if args.send_recv:
        for r in uvloop.run(_send_recv_costs(3000)):
            results.append(r)
            print(f"send + receive, {r['message']}: {r['channels_us']} us through the channels, "
                  f"{r['zmq_asyncio_us']} us through zmq.asyncio alone", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
