"""Offline throughput: the nano-vllm workload and batch-1 decode, through the real engine (LLM API).

  nano:    N requests, prompt and output lengths uniform in [min_len, max_len] (random token ids,
           ignore_eos, fixed seed) — nano-vllm's bench.py workload (256 x 100..1024 on a GPU).
  decode1: one request, 128 prompt tokens, 256 output tokens: per-token latency at batch 1.

    python -m flotilla.scripts.bench_offline --workload nano --num-requests 256 --min-len 100 --max-len 1024
    python -m flotilla.scripts.bench_offline --workload decode1 --json out.json

Any engine option can be given as a flag (see --help); the model defaults to the embedded one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from flotilla.llm import LLM
from flotilla.sampling_params import SamplingParams
from flotilla.server.cli import add_engine_arguments, engine_config_from_args


def nano_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(outputs), "ignore_eos must make every output its full length"
    prompt_tokens = sum(map(len, prompts))
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": generated,
            "seconds": elapsed, "output_tok_per_s": generated / elapsed,
            "total_tok_per_s": (generated + prompt_tokens) / elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder; default: the embedded default model")
    p.add_argument("--workload", choices=["nano", "decode1"], default="nano", help="which workload")
    p.add_argument("--num-requests", type=int, default=256, help="nano: number of requests")
    p.add_argument("--min-len", type=int, default=100, help="nano: shortest prompt / output, tokens")
    p.add_argument("--max-len", type=int, default=1024, help="nano: longest prompt / output, tokens")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload generator")
    p.add_argument("--json", default=None, help="write the result to this file too")
    add_engine_arguments(p)
    args = p.parse_args(argv)
    config = engine_config_from_args(args, args.model)
    t0 = time.perf_counter()
    with LLM(config=config) as llm:
        start_s = time.perf_counter() - t0
        worker = llm.client.ready_detail.get("worker/0", {})
        vocab = llm.client.runtime.actors["worker/0"].runner.hf_config.vocab_size if llm.client.runtime.actors else 32000
        if args.workload == "nano":
            prompts, outputs = nano_workload(args.num_requests, args.min_len, args.max_len, vocab, args.workload_seed)
        else:
            prompts, outputs = nano_workload(1, 128, 128, vocab, args.workload_seed)
            outputs = [256]
        result = run(llm, prompts, outputs)
    result.update({"workload": args.workload, "engine_start_s": start_s, "model_load_s": float(worker.get("load_s", 0)),
                   "device": worker.get("device", "?"), "dtype": worker.get("dtype", "?"),
                   "model": worker.get("model", "?"), "kv_tokens": int(worker.get("kv_tokens", 0))})
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
