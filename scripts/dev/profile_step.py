"""Where a decode step's time goes: the worker's ModelRunner alone (no actors), host vs device time.

For each batch size: fill B sequences with a prompt, then time N decode steps end to end (wall) and
the forward window on the device's timeline (CUDA events around the module's forward, or around the
graph replay with its input copies and attention plan). A forward window much longer than the GPU's
work means the host could not launch kernels fast enough (eager); wall minus the window is the step's
work outside the forward (metadata, sampling, copies). Then the same steps again as the worker runs
them, overlapped (step k+1 launched before step k's tokens are waited for): overlapped_step_ms, and
launch_host_ms, the host time to stage and launch one step; when it is below the device's step time
the device never waits for the host. Optionally one eager prefill step (--prefill) and one chunked-prefill
step against its decode and prefill halves (--mixed: the nano workloads' prompt steps are such steps).

    python -m flotilla.scripts.dev.profile_step --model qwen3-8b --batch 1,64 --steps 50
    python -m flotilla.scripts.dev.profile_step --model qwen3-0.6b --batch 256 --mixed 256x1000+8192x512
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from typing import Any

import msgspec
import numpy as np
import torch

from flotilla.actors.model_runner import ModelRunner
from flotilla.config import EngineConfig
from flotilla.sampling_params import SamplingParams
from flotilla.scripts.dev.bench_shapes import SHAPE_NAMES, shape_config, shape_dir
from flotilla.transport.messages import NewSequence, StepPlan


def decode_plans(runner: ModelRunner, batch: int, prompt_len: int, steps: int, first_step: int = 0,
                 prefix: str = "s", chunk_tokens: int = 0) -> tuple[list[StepPlan], list[StepPlan]]:
    """The prefill steps of `batch` prompts (chunk_tokens > 0: steps of at most that many tokens, a prompt split
    across steps where it must, as the scheduler's token budget would; else one step), then `steps` decode steps
    of all of them."""
    bs = runner.block_size
    per_seq = -(-(prompt_len + 2 * steps + 1) // bs)  # room for the timed pass and the overlapped pass
    sp = SamplingParams(temperature=0.0, max_tokens=2 * steps + 1, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = min(10000, runner.hf_config.vocab_size)
    new = [NewSequence(rid=f"{prefix}{i}", token_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
                       num_computed_tokens=0, block_ids=np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32),
                       sampling=sp) for i in range(batch)]
    rids = [n.rid for n in new]
    budget = chunk_tokens if chunk_tokens > 0 else batch * prompt_len
    prefills: list[StepPlan] = []
    i = done = 0  # the next prompt, and how much of it earlier steps took
    while i < batch:
        rows: list[int] = []
        chunks: list[int] = []
        first_chunks: list[NewSequence] = []
        left = budget
        while i < batch and left > 0:
            n = min(prompt_len - done, left)
            if not done:
                first_chunks.append(new[i])
            rows.append(i)
            chunks.append(n)
            left -= n
            i, done = (i + 1, 0) if done + n == prompt_len else (i, done + n)
        prefills.append(StepPlan(step=first_step + len(prefills), new_seqs=first_chunks, rids=[rids[r] for r in rows],
                                 num_new_tokens=np.array(chunks, np.int32)))
    zeros = np.zeros(batch, np.int32)
    first = first_step + len(prefills)
    decodes = [StepPlan(step=first + s, rids=rids, num_new_tokens=np.ones(batch, np.int32),
                        new_block_counts=zeros, new_block_ids=np.zeros(0, np.int32)) for s in range(steps)]
    return prefills, decodes


def profile(runner: ModelRunner, batch: int, prompt_len: int, steps: int, torch_profile: bool = False,
            host_profile: cProfile.Profile | None = None, host_breakdown: bool = False,
            chunk_tokens: int = 0) -> dict[str, Any]:
    """One batch size: decode steps one at a time, then overlapped. torch_profile: kernels of the overlapped pass;
    host_profile: collects the overlapped pass's host functions (warm: no compilation in it); chunk_tokens: the
    prompts' prefill steps' token budget (0: one step)."""
    prefills, decodes = decode_plans(runner, batch, prompt_len, steps, chunk_tokens=chunk_tokens)
    for plan in prefills:
        runner.execute(plan)
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
    overlapped = decodes_for_overlap(decodes)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    torch.cuda.synchronize()
    if torch_profile:
        prof.start()
    if host_profile is not None:
        host_profile.enable()
    t0 = time.perf_counter()
    with HostTimers([("replay", torch.cuda.CUDAGraph, "replay")]) as replay:  # of the launch: cudaGraphLaunch
        launch_s = run_overlapped(runner, overlapped)
    torch.cuda.synchronize()
    overlap_wall = (time.perf_counter() - t0) * 1000 / len(overlapped)
    if host_profile is not None:
        host_profile.disable()
    extra = {}
    if torch_profile:
        prof.stop()
        extra = {**kernel_table(prof, len(overlapped)), "gaps": device_gaps(prof, len(overlapped))}
    runner.execute(StepPlan(step=10**6, finished_rids=[f"s{i}" for i in range(batch)]))
    if host_breakdown:  # the overlapped pass once more, its launches' parts timed (host ms per step)
        prefills2, decodes2 = decode_plans(runner, batch, prompt_len, steps, first_step=10**6 + 1, prefix="h",
                                           chunk_tokens=chunk_tokens)
        for plan in prefills2:
            runner.execute(plan)
        overlapped2 = decodes_for_overlap(decodes2)
        with HostTimers(host_breakdown_targets(runner)) as timers:
            launch2 = run_overlapped(runner, overlapped2)
        torch.cuda.synchronize()
        n = len(overlapped2)
        extra["host_breakdown_ms"] = {"launch": round(launch2 * 1000 / n, 4),
                                      **{k: round(v * 1000 / n, 4) for k, v in timers.seconds.items()}}
        runner.execute(StepPlan(step=2 * 10**6, finished_rids=[f"h{i}" for i in range(batch)]))
    return {**extra, "batch": batch, "step_ms": round(wall, 3), "forward_window_ms": round(gpu_forward, 3),
            "outside_forward_ms": round(wall - gpu_forward, 3), "tok_per_s": round(batch * 1000 / wall, 1),
            "overlapped_step_ms": round(overlap_wall, 3), "launch_host_ms": round(launch_s * 1000 / len(overlapped), 3),
            "replay_host_ms": round(replay.seconds["replay"] * 1000 / len(overlapped), 3),
            "overlapped_tok_per_s": round(batch * 1000 / overlap_wall, 1)}


def run_overlapped(runner: ModelRunner, plans: list[StepPlan]) -> float:
    """Run `plans` as the worker's overlapped loop does (step k+1 launched before step k is finished); returns the
    host seconds spent launching."""
    launch_s = 0.0
    for k, plan in enumerate(plans):
        t = time.perf_counter()
        runner.launch(plan)
        launch_s += time.perf_counter() - t
        if k:
            runner.finish_oldest()
    runner.finish_oldest()
    return launch_s


def host_breakdown_targets(runner: ModelRunner) -> list[tuple[str, Any, str]]:
    """(label, owner, attribute) of the parts of a decode step's launch that --host-breakdown times."""
    import flotilla.actors.cuda_graphs as cg
    import flotilla.actors.model_runner as mr
    import flotilla.kernels.sampling as sampling

    targets = [("input_ids", runner, "_input_ids"), ("decode_by_graph", runner, "_decode_by_graph"),
               ("graph_upload", cg, "upload"), ("graph_plan", runner.graphs, "_plan"),
               ("graph_replay", torch.cuda.CUDAGraph, "replay"), ("apply_patch", mr, "apply_patch"),
               ("compute_logits", runner.model, "compute_logits"), ("sample", runner, "_sample"),
               ("greedy_argmax", sampling, "greedy_argmax"), ("pending_launch", mr.PendingStep, "launch")]
    return [t for t in targets if t[1] is not None and hasattr(t[1], t[2])]


class HostTimers:
    """Host seconds per labelled callable while installed (nested ones count in their callers too)."""

    _MISSING = object()

    def __init__(self, targets: list[tuple[str, Any, str]]) -> None:
        self.targets, self.seconds, self.saved = targets, {t[0]: 0.0 for t in targets}, []

    def __enter__(self) -> HostTimers:
        for label, owner, attr in self.targets:
            own = vars(owner).get(attr, self._MISSING)
            original = getattr(owner, attr)  # (a classmethod comes bound to its class)

            def timed(*args, _f=original, _label=label, **kw):
                t = time.perf_counter()
                try:
                    return _f(*args, **kw)
                finally:
                    self.seconds[_label] += time.perf_counter() - t

            setattr(owner, attr, staticmethod(timed) if isinstance(own, classmethod) else timed)
            self.saved.append((owner, attr, own))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, own in reversed(self.saved):
            if own is self._MISSING:  # an instance's method: drop the instance attribute that shadowed it
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


def graph_launch_calibration(sizes: tuple[int, ...] = (16, 64, 256, 1024), reps: int = 50) -> dict[str, Any]:
    """This host's cudaGraphLaunch cost against the graph's length: host ms per replay of a captured chain of N
    one-element kernels, each replay waited for (so the launch never queues behind the device)."""
    x = torch.zeros(1, device="cuda")
    out = {}
    for n in sizes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        host = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            graph.replay()
            host += time.perf_counter() - t
            torch.cuda.synchronize()
        out[str(n)] = round(host * 1000 / reps, 4)
    return {"graph_launch_host_ms_by_kernels": out}


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


def device_gaps(prof, steps: int, top: int = 8) -> dict[str, Any]:
    """Where the device sat idle over a profiled run of `steps` steps: every device activity (kernels, copies,
    memsets) in time order; idle time per step between them, by the pair of activities around the gap (the
    busiest pairs), and the copies' own time per step (kernel_table counts them too)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    idle: dict[tuple[str, str], list[float]] = {}
    # the time each activity moved the timeline's end forward (its end past every earlier end, from its start or
    # from that end): with programmatic dependent launch kernels overlap, and their own durations (which include
    # their wait for the kernel before) add up to more than the span; these add up to the span less the idle time
    advance: dict[str, float] = {spans[0][2]: spans[0][1] - spans[0][0]}
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            idle.setdefault((last[:40], name[:40]), []).append(start - end)
        if stop >= end:
            advance[name] = advance.get(name, 0.0) + stop - max(start, end)
            end, last = stop, name
    pairs = sorted(idle.items(), key=lambda kv: -sum(kv[1]))
    copies = sum(stop - start for start, stop, name in spans if name.startswith("Memcpy") or name.startswith("Memset"))
    return {"device_span_ms": round((spans[-1][1] - spans[0][0]) / steps / 1000, 3),
            "idle_ms": round(sum(map(sum, idle.values())) / steps / 1000, 3),
            "copies_ms": round(copies / steps / 1000, 3),
            "idle_by_pair": [{"after": a, "before": b, "us_per_step": round(sum(g) / steps, 1),
                              "per_step": round(len(g) / steps, 1)} for (a, b), g in pairs[:top]],
            "span_by_kernel": [{"name": k[:60], "us_per_step": round(t / steps, 1)}
                               for k, t in sorted(advance.items(), key=lambda kv: -kv[1])[:2 * top]]}


def profile_prefill(runner: ModelRunner, tokens: int, per_seq: int) -> dict[str, Any]:
    """One eager prefill step of `tokens` prompt tokens (sequences of `per_seq`): wall time and its kernels."""
    n = max(1, tokens // per_seq)
    (prefill,), _ = decode_plans(runner, n, per_seq, 0)  # (one step: no chunk budget)
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
            **kernel_table(prof, 1), "gaps": device_gaps(prof, 1)}


def mixed_plans(runner: ModelRunner, decodes: int, context: int, tokens: int,
                per_seq: int) -> tuple[list[StepPlan], StepPlan, StepPlan, StepPlan]:
    """Plans for one chunked-prefill step as the scheduler makes them: `decodes` running sequences with `context`
    tokens cached each decode one token, and new prompts of `per_seq` tokens (`tokens` in all) run whole.
    Returns (setup: the running sequences' prompts, in steps of at most 16,384 tokens; mixed: that step;
    decode_only and prefill_only: its two halves alone, as the setup leaves the cache, for comparison)."""
    bs = runner.block_size
    n = max(1, tokens // per_seq)
    rng = np.random.default_rng(1)
    vocab = min(10000, runner.hf_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    next_block = 0

    def seq(rid: str, length: int, room: int) -> NewSequence:
        nonlocal next_block
        blocks = -(-(length + room) // bs)
        ids = np.arange(next_block, next_block + blocks, dtype=np.int32)
        next_block += blocks
        return NewSequence(rid=rid, token_ids=rng.integers(0, vocab, length, dtype=np.int32), num_computed_tokens=0,
                           block_ids=ids, sampling=sp)

    running = [seq(f"d{i}", context, 2) for i in range(decodes)]
    prompts = [seq(f"p{i}", per_seq, 1) for i in range(n)]
    if next_block > runner.num_blocks:
        raise ValueError(f"the mixed step needs {next_block} KV blocks; the runner has {runner.num_blocks}")
    per_step = max(1, 16384 // max(context, 1))
    setup = [StepPlan(step=k, new_seqs=running[i:i + per_step], rids=[r.rid for r in running[i:i + per_step]],
                      num_new_tokens=np.full(len(running[i:i + per_step]), context, np.int32))
             for k, i in enumerate(range(0, decodes, per_step))]
    base = len(setup)
    none = np.zeros(0, np.int32)

    def step(k: int, run: list[NewSequence], new: list[NewSequence]) -> StepPlan:
        return StepPlan(step=base + k, new_seqs=new, rids=[r.rid for r in run] + [p.rid for p in new],
                        num_new_tokens=np.array([1] * len(run) + [per_seq] * len(new), np.int32),
                        new_block_counts=np.zeros(len(run) + len(new), np.int32), new_block_ids=none)

    return setup, step(0, running, prompts), step(1, running, []), step(2, [], prompts)


def profile_mixed(runner: ModelRunner, decodes: int, context: int, tokens: int, per_seq: int) -> dict[str, Any]:
    """One chunked-prefill step (decodes + whole prompts) against its decode and prefill halves run alone: wall
    time and kernels of each. A mixed step much slower than its halves together points at the attention call
    that serves both kinds of rows (or at the mixed step running eagerly while decodes replay a graph)."""
    setup, mixed, decode_only, prefill_only = mixed_plans(runner, decodes, context, tokens, per_seq)
    out: dict[str, Any] = {"mixed_decodes": decodes, "mixed_context": context, "mixed_prefill_tokens":
                           int(prefill_only.num_new_tokens.sum())}
    for plan in setup:
        runner.execute(plan)
    prompt_rids = [r for r in mixed.rids if r.startswith("p")]
    for name, plan in (("mixed", mixed), ("decode_only", decode_only), ("prefill_only", prefill_only)):
        for attempt in ("warm", "timed"):  # the first run compiles / plans; the second is measured
            if plan.new_seqs:  # run the prompts again from scratch: forget them first
                runner.execute(StepPlan(step=plan.step + 10**6, finished_rids=prompt_rids))
            # decode rows recompute the same position each time (num_computed is reset below), so every run of
            # a plan does the same work
            saved = {r: runner.seqs[r].num_computed for r in plan.rids if r in runner.seqs}
            kw: dict[str, Any] = {}
            if attempt == "timed":
                kw = {"activities": [torch.profiler.ProfilerActivity.CPU]}
                if runner.device.type == "cuda":
                    kw["activities"].append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                prof = torch.profiler.profile(**kw)
                prof.start()
            t0 = time.perf_counter()
            result = runner.execute(msgspec.structs.replace(plan, step=plan.step + (0 if attempt == "warm" else 10**5)))
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1000
            if result.error is not None:
                raise RuntimeError(f"{name}: {result.error}")
            for r, c in saved.items():
                s = runner.seqs[r]
                s.num_computed, s.length, s.host_length = c, c + 1, c + 1
            if attempt == "timed":
                prof.stop()
                table = kernel_table(prof, 1, top=8) if runner.device.type == "cuda" else {}
                out[name] = {"step_ms": round(wall, 3), "sampled": len(result.rids), **table}
    return out


def decodes_for_overlap(decodes: list[StepPlan]) -> list[StepPlan]:
    """The same decode plans again under fresh step numbers, for a second, overlapped, pass."""
    base = decodes[-1].step + 1
    return [msgspec.structs.replace(p, step=base + i) for i, p in enumerate(decodes[3:])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help=f"a built-in shape ({SHAPE_NAMES}) or an HF folder")
    p.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    p.add_argument("--prefill-chunk", type=int, default=16384,
                   help="the prompts are prefilled in steps of at most this many tokens, as under the engine's "
                        "max_num_batched_tokens (16 prompts of 32,000 tokens in one step would need tens of GB of "
                        "activations); 0: all in one step (default 16384)")
    p.add_argument("--attention-backend", default="auto", help="force an attention backend")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-blocks", type=int, default=24576, help="KV blocks (--mixed needs room)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the engine's, which is 64 for FlashMLA's DeepSeek shapes; "
                        "16 made those fall back to the triton MLA kernels)")
    p.add_argument("--torch-profile", action="store_true",
                   help="profile the overlapped pass with torch.profiler: device busy time per step and the top kernels "
                        "(the profiler's own host cost slows the host side: read the wall times from a run without it)")
    p.add_argument("--prefill", default="",
                   help="also time one eager prefill step: TOKENS[xPER_SEQ] (e.g. 8192x512), with its kernels")
    p.add_argument("--mixed", default="",
                   help="also time one chunked-prefill step against its halves: DECODESxCONTEXT+TOKENSxPER_SEQ (e.g. "
                        "256x1000+8192x512: 256 decodes at 1,000 tokens of context with 16 new 512-token prompts)")
    p.add_argument("--host-breakdown", action="store_true",
                   help="also time the parts of each overlapped step's launch on the host (input ids, graph upload, "
                        "plan and replay, logits, sampling, the result's copy): host ms per step")
    p.add_argument("--launch-calibration", action="store_true",
                   help="also time cudaGraphLaunch on this host for chains of 16-1,024 trivial kernels")
    p.add_argument("--cprofile", action="store_true",
                   help="also print the host functions that cost the most in the overlapped pass (per batch size)")
    args = p.parse_args(argv)
    dummy = shape_config(args.model) is not None
    config = EngineConfig.from_options(
        model=str(shape_dir(args.model)) if dummy else args.model, dtype="bfloat16",
        load_format="dummy" if dummy else "auto", skip_tokenizer_init=True, kv_cache_blocks=args.kv_cache_blocks,
        block_size=args.block_size,
        attention_backend=args.attention_backend, device="cuda", enforce_eager=args.enforce_eager)
    runner = ModelRunner(config, progress=False)
    rows = []
    for b in args.batch.split(","):
        host = cProfile.Profile() if args.cprofile else None
        rows.append(profile(runner, int(b), args.prompt_len, args.steps, args.torch_profile, host, args.host_breakdown,
                            args.prefill_chunk))
        if host is not None:  # the overlapped pass only: what the host does per step, without compilation
            print(f"== host functions over {args.steps - 3} overlapped steps at batch {b} (divide by the steps)")
            pstats.Stats(host).sort_stats("tottime").print_stats(30)
            pstats.Stats(host).sort_stats("cumtime").print_stats(r"flotilla|flashinfer", 30)
    if args.prefill:
        tokens, _, per_seq = args.prefill.partition("x")
        rows.append(profile_prefill(runner, int(tokens), int(per_seq or 512)))
    if args.mixed:
        dec, _, pre = args.mixed.partition("+")
        (d, c), (t, ps) = (map(int, part.split("x")) for part in (dec, pre))
        rows.append(profile_mixed(runner, d, c, t, ps))
    if args.launch_calibration:
        rows.append(graph_launch_calibration())
    for r in rows:
        print(json.dumps({"model": args.model, "attention": runner.model.attention_backend_name,
                          "cuda_graphs": runner.graphs is not None, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
