"""Where a decode step's time goes: the worker's ModelRunner alone (no actors), host vs device time.

For each batch size: fill B sequences with a prompt, then time N decode steps end to end (wall) and
the forward window on the device's timeline (CUDA events around the module's forward, or around the
graph replay with its input copies and attention plan). A forward window much longer than the GPU's
work means the host could not launch kernels fast enough (eager); wall minus the window is the step's
work outside the forward (metadata, sampling, copies). Then the same steps again as the worker runs
them, overlapped (step k+1 launched before step k's tokens are waited for): overlapped_step_ms, and
launch_host_ms, the host time to stage and launch one step; when it is below the device's step time
the device never waits for the host.

    python -m flotilla.scripts.profile_step --model qwen3-8b --batch 1,64 --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from typing import Any

import numpy as np
import torch

from flotilla.actors.model_runner import ModelRunner
from flotilla.config import EngineConfig
from flotilla.sampling_params import SamplingParams
from flotilla.scripts.bench_shapes import SHAPES, shape_dir
from flotilla.transport.messages import NewSequence, StepPlan


def decode_plans(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> tuple[StepPlan, list[StepPlan]]:
    bs = runner.block_size
    per_seq = -(-(prompt_len + 2 * steps + 1) // bs)  # room for the timed pass and the overlapped pass
    sp = SamplingParams(temperature=0.0, max_tokens=2 * steps + 1, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = min(10000, runner.hf_config.vocab_size)
    new = [NewSequence(rid=f"s{i}", token_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
                       num_computed_tokens=0, block_ids=np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32),
                       sampling=sp) for i in range(batch)]
    rids = [n.rid for n in new]
    prefill = StepPlan(step=0, new_seqs=new, rids=rids, num_new_tokens=np.full(batch, prompt_len, np.int32))
    zeros = np.zeros(batch, np.int32)
    decodes = [StepPlan(step=s + 1, rids=rids, num_new_tokens=np.ones(batch, np.int32), new_block_counts=zeros,
                        new_block_ids=np.zeros(0, np.int32)) for s in range(steps)]
    return prefill, decodes


def profile(runner: ModelRunner, batch: int, prompt_len: int, steps: int, torch_profile: bool = False,
            host_profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """One batch size: decode steps one at a time, then overlapped. torch_profile: kernels of the overlapped pass;
    host_profile: collects the overlapped pass's host functions (warm: no compilation in it)."""
    prefill, decodes = decode_plans(runner, batch, prompt_len, steps)
    runner.execute(prefill)
    forward_ms: list[float] = []
    # the decode forward is a CUDA-graph replay when graphs are captured, the module's forward otherwise
    owner, attr = (runner.graphs, "run") if runner.graphs is not None else (runner.model, "forward")
    original = getattr(owner, attr)

    def timed_forward(*args, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original(*args, **kw)
        end.record()
        forward_ms.append((start, end))
        return out

    setattr(owner, attr, timed_forward)
    for plan in decodes[:3]:  # warm-up
        runner.execute(plan)
    forward_ms.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for plan in decodes[3:]:
        runner.execute(plan)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000 / (steps - 3)
    setattr(owner, attr, original)
    gpu_forward = sum(s.elapsed_time(e) for s, e in forward_ms) / len(forward_ms)
    # the worker's overlapped loop: step k+1 is launched before step k's tokens are waited for
    launch_s = 0.0
    overlapped = decodes_for_overlap(decodes)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    torch.cuda.synchronize()
    if torch_profile:
        prof.start()
    if host_profile is not None:
        host_profile.enable()
    t0 = time.perf_counter()
    for k, plan in enumerate(overlapped):
        t1 = time.perf_counter()
        runner.launch(plan)
        launch_s += time.perf_counter() - t1
        if k:
            runner.finish_oldest()
    runner.finish_oldest()
    torch.cuda.synchronize()
    overlap_wall = (time.perf_counter() - t0) * 1000 / len(overlapped)
    if host_profile is not None:
        host_profile.disable()
    extra = {}
    if torch_profile:
        prof.stop()
        extra = kernel_table(prof, len(overlapped))
    runner.execute(StepPlan(step=10**6, finished_rids=[f"s{i}" for i in range(batch)]))
    return {**extra, "batch": batch, "step_ms": round(wall, 3), "forward_window_ms": round(gpu_forward, 3),
            "outside_forward_ms": round(wall - gpu_forward, 3), "tok_per_s": round(batch * 1000 / wall, 1),
            "overlapped_step_ms": round(overlap_wall, 3), "launch_host_ms": round(launch_s * 1000 / len(overlapped), 3),
            "overlapped_tok_per_s": round(batch * 1000 / overlap_wall, 1)}


def kernel_table(prof, steps: int, top: int = 15) -> dict[str, Any]:
    """Device time per step by kernel (from a torch.profiler run over `steps` steps): the busiest kernels and
    the device's busy time per step (the sum of every kernel's time)."""
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda r: -r[1])
    busy = sum(r[1] for r in rows) / steps / 1000
    return {"device_busy_ms": round(busy, 3),
            "kernels": [{"name": k[:90], "us_per_step": round(t / steps, 1), "calls_per_step": round(c / steps, 1)}
                        for k, t, c in rows[:top]]}


def profile_prefill(runner: ModelRunner, tokens: int, per_seq: int) -> dict[str, Any]:
    """One eager prefill step of `tokens` prompt tokens (sequences of `per_seq`): wall time and its kernels."""
    n = max(1, tokens // per_seq)
    prefill, _ = decode_plans(runner, n, per_seq, 0)
    runner.execute(prefill)  # warm-up (and kernel compilation)
    runner.execute(StepPlan(step=10**6, finished_rids=prefill.rids))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.execute(prefill)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000
    runner.execute(StepPlan(step=10**6 + 1, finished_rids=prefill.rids))
    return {"prefill_tokens": n * per_seq, "prefill_seqs": n, "step_ms_profiled": round(wall, 3),
            **kernel_table(prof, 1)}


def decodes_for_overlap(decodes: list[StepPlan]) -> list[StepPlan]:
    """The same decode plans again under fresh step numbers, for a second, overlapped, pass."""
    import msgspec
    base = decodes[-1].step + 1
    return [msgspec.structs.replace(p, step=base + i) for i, p in enumerate(decodes[3:])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"a built-in shape ({', '.join(SHAPES)}) or an HF folder")
    p.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    p.add_argument("--attention-backend", default="auto", help="force an attention backend")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--torch-profile", action="store_true",
                   help="profile the overlapped pass with torch.profiler: device busy time per step and the top kernels "
                        "(the profiler's own host cost slows the host side: read the wall times from a run without it)")
    p.add_argument("--prefill", default="",
                   help="also time one eager prefill step: TOKENS[xPER_SEQ] (e.g. 8192x512), with its kernels")
    p.add_argument("--cprofile", action="store_true",
                   help="also print the host functions that cost the most in the overlapped pass (per batch size)")
    args = p.parse_args(argv)
    dummy = args.model in SHAPES
    config = EngineConfig.from_options(
        model=str(shape_dir(args.model)) if dummy else args.model, dtype="bfloat16",
        load_format="dummy" if dummy else "auto", skip_tokenizer_init=True, kv_cache_blocks=8192, block_size=16,
        attention_backend=args.attention_backend, device="cuda", enforce_eager=args.enforce_eager)
    runner = ModelRunner(config, progress=False)
    rows = []
    for b in args.batch.split(","):
        host = cProfile.Profile() if args.cprofile else None
        rows.append(profile(runner, int(b), args.prompt_len, args.steps, args.torch_profile, host))
        if host is not None:  # the overlapped pass only: what the host does per step, without compilation
            print(f"== host functions over {args.steps - 3} overlapped steps at batch {b} (divide by the steps)")
            pstats.Stats(host).sort_stats("tottime").print_stats(30)
            pstats.Stats(host).sort_stats("cumtime").print_stats(r"flotilla|flashinfer", 30)
    if args.prefill:
        tokens, _, per_seq = args.prefill.partition("x")
        rows.append(profile_prefill(runner, int(tokens), int(per_seq or 512)))
    for r in rows:
        print(json.dumps({"model": args.model, "attention": runner.model.attention_backend_name,
                          "cuda_graphs": runner.graphs is not None, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
