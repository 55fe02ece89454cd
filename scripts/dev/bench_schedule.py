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

With --roofline SHAPE (a dense model of bench_shapes) each planned step is also costed at the kernels' rates: its
GEMMs at --gemm-tflops or its weights' bytes at --weights-tbps, whichever takes longer, plus its prompt chunks'
causal attention at --attention-tflops and its decode rows' KV at --kv-read-tbps. The sum (roofline_s) is what the
plan costs if every kernel ran at those rates and nothing else took time: the floor a GPU run of that schedule is
held to, and what a policy change saves before any GPU measures it. The default rates are an H200's, measured
(docs/benchmarks.md, "Long contexts").

    python -m flotilla.scripts.dev.bench_schedule --workload mixed --kv-tokens 357744 --roofline qwen3-8b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.config import SchedulerConfig, batch_defaults
from flotilla.sampling_params import SamplingParams
from flotilla.scripts.dev import bench_workload as wl
from flotilla.scripts.dev.bench_shapes import SHAPES
from flotilla.server.cli import HelpFormatter
from flotilla.transport.messages import StepPlan, StepResult, TokenizedRequest

WORKLOADS = {"long16": (wl.long16_workload, False), "mixed": (wl.long_mixed_workload, False),
             "nano": (lambda divisor: wl.nano_workload(256), True)}
"""name -> (the workload for a length divisor, prefix caching on)."""
DEFAULTS = SchedulerConfig()
LARGE_GPU = batch_defaults(80 * 2**30, "", offline=True, hybrid=False)
"""The offline engine's batch limits on a GPU of 70 GiB or more (what bench_offline runs on an H100 or H200)."""


def dense_shapes() -> list[str]:
    """The bench_shapes models Roofline costs: dense GQA decoders, every layer full attention."""
    return [n for n, c in SHAPES.items() if c.get("architectures") in (["Qwen3ForCausalLM"], ["LlamaForCausalLM"])]


@dataclass(frozen=True, slots=True)
class Roofline:
    """A dense GQA model's work per step, costed at given kernel rates (bf16 weights; bf16 or FP8 KV)."""

    gemm_flops_per_token: float
    """2 x the parameters of the decoder layers."""
    lm_head_flops: float
    """Per sampled row."""
    weight_bytes: float
    """The layers' and the LM head's, read once per step."""
    attention_flops: float
    """Per (query, key) pair: QK^T and PV over every head and layer."""
    kv_bytes_per_token: float
    gemm_tflops: float = 735.0
    attention_tflops: float = 466.0
    kv_read_tbps: float = 3.4
    weights_tbps: float = 4.27

    @classmethod
    def for_shape(cls, name: str, kv_value_bytes: int = 2, **rates: float) -> Roofline:
        """The shape's costs; kv_value_bytes 1 for an FP8 cache (half the decode rows' reads)."""
        c = SHAPES[name]
        if name not in dense_shapes():
            raise ValueError(f"--roofline costs dense GQA models only, not {name}")
        h, layers = c["hidden_size"], c["num_hidden_layers"]
        hd = c.get("head_dim", h // c["num_attention_heads"])
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        layer = h * (2 * q + 2 * kv) + 3 * h * c["intermediate_size"]
        head = h * c["vocab_size"]
        return cls(gemm_flops_per_token=2 * layer * layers, lm_head_flops=2 * head,
                   weight_bytes=2 * (layer * layers + head), attention_flops=4 * q * layers,
                   kv_bytes_per_token=2 * kv_value_bytes * kv * layers, **rates)  # fmt: skip

    def step(self, chunks: list[tuple[int, int]], decodes: list[int]) -> tuple[float, float, float]:
        """(GEMM, prompt attention, decode attention) seconds of a step: prompt chunks as (new tokens, cached before
        them), decode rows as their cached tokens; the LM head counted for one row of every sequence (a chunk that does
        not end its prompt samples none: a slight overcount)."""
        tokens = sum(n for n, _ in chunks) + len(decodes)
        flops = tokens * self.gemm_flops_per_token + (len(chunks) + len(decodes)) * self.lm_head_flops
        gemm = max(flops / (self.gemm_tflops * 1e12), self.weight_bytes / (self.weights_tbps * 1e12))
        prompt = sum(n * (c + (n + 1) / 2) for n, c in chunks) * self.attention_flops / (self.attention_tflops * 1e12)
        decode = sum(c + 1 for c in decodes) * self.kv_bytes_per_token / (self.kv_read_tbps * 1e12)
        return gemm, prompt, decode


class StandInWorker:
    """Computes nothing: tracks each sequence's tokens and samples token 0 where a row reaches their end."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}  # rid -> [tokens known, tokens computed]

    def cached_before(self, plan: StepPlan, counts: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """The plan's prompt chunks as (new tokens, tokens cached before them) and its decode rows' cached tokens,
        before it runs."""
        new = {ns.rid: ns.num_computed_tokens for ns in plan.new_seqs}
        chunks, decodes = [], []
        for rid, n in zip(plan.rids, counts, strict=True):
            cached = new[rid] if rid in new else self.seqs[rid][1]
            if n > 1:
                chunks.append((n, cached))
            else:
                decodes.append(cached)
        return chunks, decodes

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
             prefix_caching: bool, max_model_len: int, roofline: Roofline | None = None) -> dict:
    blocks = BlockManager(kv_tokens // block_size, block_size, enable_prefix_caching=prefix_caching)
    sched = BatchScheduler(config, blocks, max_model_len=max_model_len)
    worker = StandInWorker()
    for i, (prompt, out) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        sched.add(TokenizedRequest(rid=f"r{i}", prompt_ids=np.asarray(prompt, np.int32), eos_token_ids=[],
                                   sampling=SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)))
    inflight: deque[StepPlan] = deque()
    steps = prompt_steps = prompt_tokens = 0
    cost = np.zeros(3)  # the roofline's GEMM, prompt attention, decode attention seconds
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
        if roofline is not None:
            cost += roofline.step(*worker.cached_before(plan, counts))
        sched.update(worker.execute(plan))
    if sched.seqs:
        raise RuntimeError(f"{len(sched.seqs)} requests never finished")
    return {"requests": len(workload), "prompt_tokens": workload.input_tokens,
            "prompt_tokens_computed": prompt_tokens, "output_tokens": workload.output_tokens, "steps": steps,
            "prompt_steps": prompt_steps, "preemptions": sched.num_preemptions,
            "scheduler_s": round(time.perf_counter() - start, 3),
            **({} if roofline is None else {"roofline_s": round(float(cost.sum()), 2), **{
                k: round(float(v), 2) for k, v in zip(("gemm_s", "prompt_attention_s", "decode_attention_s"), cost)}})}


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
    r = p.add_argument_group("roofline", "the plan's cost at the kernels' rates (defaults: an H200's, measured)")
    r.add_argument("--roofline", choices=dense_shapes(),
                   default=None, help="a dense model shape (bench_shapes) to cost each step for")
    for flag, field, unit in (("--gemm-tflops", "gemm_tflops", "the linear layers' GEMMs, TFLOP/s"),
                              ("--attention-tflops", "attention_tflops", "prompt chunks' causal attention, TFLOP/s"),
                              ("--kv-read-tbps", "kv_read_tbps", "decode attention's KV reads, TB/s"),
                              ("--weights-tbps", "weights_tbps", "a step's read of the weights, TB/s")):
        r.add_argument(flag, type=float, default=Roofline.__dataclass_fields__[field].default, help=unit)
    r.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the cache's values: bf16 (auto) or FP8, one byte each (--attention-tflops is then the FP8 "
                        "prefill kernel's rate)")
    args = p.parse_args(argv)
    make, prefix = WORKLOADS[args.workload]
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_steps_in_flight=args.max_steps_in_flight)
    roofline = None if args.roofline is None else Roofline.for_shape(
        args.roofline, kv_value_bytes=1 if args.kv_cache_dtype == "fp8" else 2, gemm_tflops=args.gemm_tflops,
        attention_tflops=args.attention_tflops, kv_read_tbps=args.kv_read_tbps, weights_tbps=args.weights_tbps)
    result = {"workload": args.workload, "kv_tokens": args.kv_tokens, "block_size": args.block_size,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              **({} if roofline is None else {"roofline_model": args.roofline, "kv_cache_dtype": args.kv_cache_dtype}),
              **simulate(make(args.length_divisor), args.kv_tokens, args.block_size, config, prefix,
                         args.max_model_len, roofline)}
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
