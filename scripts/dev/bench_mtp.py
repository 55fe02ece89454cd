"""MTP speculative decoding's mechanics at batch 1: tokens per verify step, and the time per output token against
plain decoding, at forced acceptance.

With random weights the MTP layer's drafts are nearly always wrong, so acceptance says nothing about a trained
checkpoint. What can be measured is the machinery: here the speculator's drafts are replaced (its draft hook, in
the worker's process: the engine runs inline) by the tokens plain decoding gave next, so every draft is accepted
and every verify step should yield num_speculative_tokens + 1 tokens. The speedup is then the most speculation
can give on this engine and GPU; a trained MTP layer's acceptance rate scales it down. The outputs should be plain
decoding's tokens. In bfloat16 on a GPU a verify step's kernels (several query tokens per sequence, other GEMM
tiles) may round differently from a decode step's and flip a near-tied argmax; from there on the oracle knows no
next tokens, the model's own drafts are used, and the record says where the tokens first differed
(`first_difference`, null when they never did) so that its acceptance numbers are read for what they are.

One request, `--decode-in` random prompt tokens, `--decode-out` greedy output tokens (bench_offline's decode1),
timed on the second of two identical runs. Models: a folder with an MTP layer, or the built-in
`deepseek-v3-4l-mtp` (DeepSeek-V3's shapes, 4 layers and its MTP layer, FP8 random weights, on the device).

    python -m flotilla.scripts.dev.bench_mtp --model deepseek-v3-4l-mtp --num-speculative-tokens 1,2,3 --json $OUT/mtp.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flotilla import LLM, SamplingParams
from flotilla.scripts.dev.bench_shapes import SHAPE_NAMES, shape_config, shape_dir


def engine_options(args: argparse.Namespace, num_spec: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {"device": args.device, "skip_tokenizer_init": True, "enable_prefix_caching": False}
    if shape_config(args.model) is not None:  # bench_offline's peer settings
        options.update(model=str(shape_dir(args.model)), load_format="dummy", dtype="bfloat16", max_model_len=4096)
    else:
        options.update(model=args.model, dtype=args.dtype)
    if args.kv_cache_blocks:
        options["kv_cache_blocks"] = args.kv_cache_blocks
    if args.max_steps_in_flight:
        options["max_steps_in_flight"] = args.max_steps_in_flight
    if num_spec is not None:
        options["speculative_config"] = {"method": "mtp", "num_speculative_tokens": num_spec}
    return options


def decode_twice(llm: LLM, prompt: list[int], out_len: int,
                 before_timed: Callable[[], None] | None = None) -> tuple[list[int], float]:
    """The second run's tokens and seconds (the first warms up; before_timed() runs between them)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)
    for run in range(2):
        if run == 1 and before_timed is not None:
            before_timed()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        elapsed = time.perf_counter() - t0
    return list(out), elapsed


def oracle(prompt: list[int], continuation: list[int]):
    """A draft hook giving, for the benchmark's one request, the tokens plain decoding produced next (the model's
    own drafts for a sequence that left plain decoding's path, or for any other request)."""
    full = prompt + continuation

    def hook(tokens: np.ndarray, n: int, drafts: Callable[[], list[int]]) -> list[int]:
        seq = tokens.tolist()
        if seq != full[: len(seq)]:
            return drafts()
        want = full[len(seq): len(seq) + n]
        # (the model's drafts only past plain decoding's end: asking for them makes the step wait for its drafting)
        return want if len(want) == n else want + drafts()[len(want):]

    return hook


def device_oracle(prompt: list[int], continuation: list[int], device: Any):
    """The same on the device (MTPSpeculator.device_draft_hook), for a runner that launches steps planned ahead: the
    host does not know a step's tokens when the next one drafts. Past plain decoding's end the drafts are 0."""
    import torch

    full = torch.tensor(prompt + continuation + [0] * 8, dtype=torch.int64, device=device)

    def hook(seqs: list, at: torch.Tensor, k: int) -> torch.Tensor:
        pos = (at[:, None] + 2 + torch.arange(k, device=device)[None, :]).clamp(max=len(full) - 1)
        return full[pos]

    return hook


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first output position where the tokens differ, None when they are the same."""
    diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return diff if diff is not None or len(got) == len(want) else min(len(got), len(want))


class StepTimer:
    """Times the worker's speculating steps (MTPSpeculator.step and the runner's finish of each, device waits
    included): what a step costs inside the worker, against the wall time per step, whose rest is the scheduler's
    planning, the messages between the actors and the engine's loop (a step of decodes sends its result before it
    drafts; with steps planned ahead the worker launches the next one before it finishes this one)."""

    def __init__(self, runner: Any) -> None:
        self.steps: list[tuple[float, float]] = []  # (began, seconds) of each launch
        self.finishes: list[tuple[float, float]] = []
        self.chained: list[float] = []  # when each verify chained on the step before (launched before it finished)
        self.since = 0.0
        runner.spec.step = self._timed(runner.spec.step, self.steps)
        runner.finish_oldest = self._timed(runner.finish_oldest, self.finishes)
        graphs = runner.spec.graphs
        if graphs is not None:
            verify = graphs.verify

            def counted(*a: Any, **kw: Any) -> Any:
                drafts = kw.get("drafts", a[3] if len(a) > 3 else None)
                if drafts is not None and drafts[3]:
                    self.chained.append(time.perf_counter())
                return verify(*a, **kw)
            graphs.verify = counted

    @staticmethod
    def _timed(call: Callable[..., Any], into: list[tuple[float, float]]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                into.append((t0, time.perf_counter() - t0))
        return timed

    def clear(self) -> None:
        """Count from now: a step that began before (the previous run's last, still drafting when that run's last
        result came in) is left out."""
        self.since = time.perf_counter()

    def counted(self) -> tuple[int, float, int]:
        """(steps launched since `clear`, seconds in their launches and finishes, how many of them chained)."""
        steps = [s for t, s in self.steps if t >= self.since]
        return (len(steps), sum(steps) + sum(s for t, s in self.finishes if t >= self.since),
                sum(t >= self.since for t in self.chained))


def run_mtp(args: argparse.Namespace, num_spec: int, prompt: list[int], plain: list[int]) -> dict[str, Any]:
    with LLM(placement="inline", **engine_options(args, num_spec)) as llm:
        actors = llm.client.runtime.actors
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        runner = actors["worker/0"].runner
        spec = runner.spec
        if spec.defer:  # steps planned ahead: drafts forced where the device makes them
            spec.device_draft_hook = device_oracle(prompt, plain, runner.device)
        else:
            spec.draft_hook = oracle(prompt, plain)
        graphs, ahead = spec.graphs is not None, spec.defer  # the uniform steps' CUDA graphs (actors/spec_graphs.py)
        timer = StepTimer(runner)
        del spec, runner  # (a reference held past the engine's close would keep its graphs and KV cache on the device)
        core = actors["scheduler/0"].core
        drafts0, accepted0 = core.spec_draft_tokens, core.spec_accepted_tokens
        tokens, elapsed = decode_twice(llm, prompt, args.decode_out, before_timed=timer.clear)
        # decode_twice ran the request twice: the counters moved by two runs' worth
        drafts, accepted = (core.spec_draft_tokens - drafts0) / 2, (core.spec_accepted_tokens - accepted0) / 2
    diff = first_difference(tokens, plain)
    if diff is not None:
        print(f"warning: with {num_spec} speculative tokens the greedy output left plain decoding's at output token "
              f"{diff} of {len(plain)}; past it no draft was forced", file=sys.stderr, flush=True)
    verify_steps = len(tokens) - 1 - accepted  # the prefill gave the first token; each verify step accepted + 1
    return {"num_speculative_tokens": num_spec, "cuda_graphs": graphs, "steps_ahead": ahead, "first_difference": diff,
            "tok_per_s": round(len(tokens) / elapsed, 1),
            "ms_per_token": round(1000 * elapsed / len(tokens), 3),
            "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
            "tokens_per_verify_step": round((len(tokens) - 1) / verify_steps, 3) if verify_steps else None,
            **step_split(*timer.counted(), elapsed)}


def step_split(steps: int, seconds: float, chained: int, elapsed: float) -> dict[str, Any]:
    """Per step of the timed run (its prefill included): the wall time, the time inside the worker's step (launch and
    finish), and the rest (the scheduler's planning and the round trip between the actors), in ms; and the steps
    launched chained on the one before (steps planned ahead)."""
    if not steps:
        return {"steps": 0}
    wall, inside = 1000 * elapsed / steps, 1000 * seconds / steps
    return {"steps": steps, "chained_steps": chained, "step_wall_ms": round(wall, 3),
            "step_in_worker_ms": round(inside, 3), "step_outside_worker_ms": round(wall - inside, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_mtp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a folder with an MTP layer, or a built-in shape ({SHAPE_NAMES})")
    p.add_argument("--num-speculative-tokens", default="1,2,3", help="comma-separated draft counts to measure")
    p.add_argument("--decode-in", type=int, default=128, help="prompt tokens")
    p.add_argument("--decode-out", type=int, default=256, help="output tokens")
    p.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [0, vocab)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompt")
    p.add_argument("--device", default="auto", help="engine device (auto: CUDA when there is one)")
    p.add_argument("--dtype", default="auto", help="model dtype for a folder (a built-in shape runs bfloat16)")
    p.add_argument("--kv-cache-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument("--max-steps-in-flight", type=int, default=None,
                   help="max_steps_in_flight (1: no speculating step planned ahead; default: the engine's)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(args.vocab) for _ in range(args.decode_in)]
    with LLM(**engine_options(args, None)) as llm:  # plain decoding as users get it (its default placement)
        plain, elapsed = decode_twice(llm, prompt, args.decode_out)
    result: dict[str, Any] = {"model": args.model, "decode_in": args.decode_in, "decode_out": args.decode_out,
                              "plain_tok_per_s": round(len(plain) / elapsed, 1),
                              "plain_ms_per_token": round(1000 * elapsed / len(plain), 3), "mtp": []}
    for n in (int(x) for x in args.num_speculative_tokens.split(",")):
        run = run_mtp(args, n, prompt, plain)
        run["speedup"] = round(run["tok_per_s"] / result["plain_tok_per_s"], 3)
        result["mtp"].append(run)
        print(json.dumps(run), flush=True)
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
