"""The batching policy alone on a benchmark's requests: what the scheduler would plan for a cache of a given size,
with no model and no GPU.

BatchScheduler (actors/batching.py) plans every step against a stand-in worker that samples one fixed token when a
sequence reaches the end of its tokens and returns each step's result as the engine's worker does, steps in flight
included. What comes out is the plan's shape: steps, prompt steps, preemptions, and the prompt tokens computed
against the prompts' own (more means chunks computed again after a preemption). Where a GPU run's step trace shows
a schedule's waste, this reproduces it in a second and tells whether a policy change removes it.

    python -m flotilla.scripts.dev.bench_schedule --workload long16 --kv-tokens 363824
    python -m flotilla.scripts.dev.bench_schedule --workload mixed --kv-tokens 363824 --max-num-batched-tokens 16384

--kv-tokens is the cache size the engine reports at start (`kv_capacity=`); the workloads are bench_offline's, with
prefix caching as there (off for long16 and mixed, on for nano).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque

import numpy as np

from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.config import SchedulerConfig, batch_defaults
from flotilla.sampling_params import SamplingParams
from flotilla.scripts.dev import bench_workload as wl
from flotilla.server.cli import HelpFormatter
from flotilla.transport.messages import StepPlan, StepResult, TokenizedRequest

WORKLOADS = {"long16": (wl.long16_workload, False), "mixed": (wl.long_mixed_workload, False),
             "nano": (lambda divisor: wl.nano_workload(256), True)}
"""name -> (the workload for a length divisor, prefix caching on)."""
DEFAULTS = SchedulerConfig()
LARGE_GPU = batch_defaults(80 * 2**30, "", offline=True, hybrid=False)
"""The offline engine's batch limits on a GPU of 70 GiB or more (what bench_offline runs on an H100 or H200)."""


class StandInWorker:
    """Computes nothing: tracks each sequence's tokens and samples token 0 where a row reaches their end."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}  # rid -> [tokens known, tokens computed]

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_rids:
            self.seqs.pop(rid, None)
        for ns in plan.new_seqs:
            self.seqs[ns.rid] = [len(ns.token_ids), ns.num_computed_tokens]
        sampled = []
        for rid, n in zip(plan.rids, plan.num_new_tokens.tolist() if plan.rids else [], strict=True):
            s = self.seqs[rid]
            s[1] += n
            if s[1] >= s[0]:
                s[0] += 1
                sampled.append(rid)
        return StepResult(step=plan.step, rids=sampled, token_ids=np.zeros(len(sampled), np.int32))


def simulate(workload: wl.Workload, kv_tokens: int, block_size: int, config: SchedulerConfig,
             prefix_caching: bool, max_model_len: int) -> dict:
    blocks = BlockManager(kv_tokens // block_size, block_size, enable_prefix_caching=prefix_caching)
    sched = BatchScheduler(config, blocks, max_model_len=max_model_len)
    worker = StandInWorker()
    for i, (prompt, out) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        sched.add(TokenizedRequest(rid=f"r{i}", prompt_ids=np.asarray(prompt, np.int32), eos_token_ids=[],
                                   sampling=SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)))
    inflight: deque[StepPlan] = deque()
    steps = prompt_steps = prompt_tokens = 0
    start = time.perf_counter()
    while True:
        while len(inflight) < config.max_steps_in_flight and (plan := sched.schedule()) is not None:
            inflight.append(plan)
        if not inflight:
            break
        plan = inflight.popleft()
        counts = plan.num_new_tokens.tolist() if plan.rids else []
        chunks = [n for n in counts if n > 1]  # (a decode row is one token)
        steps += 1
        prompt_steps += bool(chunks)
        prompt_tokens += sum(chunks)
        sched.update(worker.execute(plan))
    if sched.seqs:
        raise RuntimeError(f"{len(sched.seqs)} requests never finished")
    return {"requests": len(workload), "prompt_tokens": workload.input_tokens,
            "prompt_tokens_computed": prompt_tokens, "output_tokens": workload.output_tokens, "steps": steps,
            "prompt_steps": prompt_steps, "preemptions": sched.num_preemptions,
            "scheduler_s": round(time.perf_counter() - start, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flotilla bench schedule", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="long16", help="bench_offline's workload")
    p.add_argument("--kv-tokens", type=int, required=True, help="KV cache size, tokens (the engine's kv_capacity)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=LARGE_GPU["max_num_seqs"],
                   help="as the engine's flag (default: the offline engine's on an H100 or H200)")
    p.add_argument("--max-num-batched-tokens", type=int, default=LARGE_GPU["max_num_batched_tokens"],
                   help="as the engine's flag (default: the offline engine's on an H100 or H200)")
    p.add_argument("--max-steps-in-flight", type=int, default=DEFAULTS.max_steps_in_flight,
                   help="as the engine's flag")
    p.add_argument("--max-model-len", type=int, default=40960, help="as the engine's flag (bench_offline's default)")
    p.add_argument("--length-divisor", type=int, default=1, help="divide prompt and output lengths (long16, mixed)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    make, prefix = WORKLOADS[args.workload]
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_steps_in_flight=args.max_steps_in_flight)
    result = {"workload": args.workload, "kv_tokens": args.kv_tokens, "block_size": args.block_size,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              **simulate(make(args.length_divisor), args.kv_tokens, args.block_size, config, prefix,
                         args.max_model_len)}
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
