"""Offline throughput through the real engine (LLM API), on the same workloads as the vLLM peer.

  nano:    nano-vllm's bench.py recipe, as ../shared/gpu/vllm-peer/peer_bench.py runs it: random.seed(0),
           N prompts of randint(100, 1024) random token ids, then N output lengths randint(100, 1024),
           temperature 0.6, ignore_eos. Smaller --min-len/--max-len/--num-requests for toy runs.
  decode1: one request, 128 random prompt tokens, 256 output tokens, greedy: per-token latency at batch 1
           (timed on the second of two identical runs, as the peer does).
  fixed:   --num-requests x --fixed-in / --fixed-out, the decode's own rate and per-GPU figures (wide EP).
  long contexts, ../shared/gpu/vllm-peer/long_ctx.py's workloads with its seeded generators (greedy, ignore_eos;
  `long` runs all four; built-in shapes get its max_model_len 40,960):
  long16:  16 prompts of 32,000 tokens, 256 out each, all at once, prefix caching off.
  long1:   one 32,000-token prompt: prefill time (max_tokens 1, the faster of two runs) and decode ms per token
           (a 257-token run against it), each run another prompt, prefix caching off.
  mixed:   32 prompts of 16,000 tokens (128 out) among 256 of 200 (256 out), shuffled, all at once, prefix caching
           off.
  prefix:  128 requests of a shared 6,000-token prefix + 100 own tokens, 64 out each, prefix caching on (on an
           engine of its own), the prefix cached once first.
  long128: long1 at 128,000 tokens, on a model whose rope scaling reaches 131,072 (`--model qwen3-8b-yarn`: YaRN
           x 4, max_model_len 131,072), prefix caching off.
  --length-divisor N divides their prompt and output lengths, for toy runs.
  structured: --structured-requests prompts of --structured-in random tokens, --structured-out greedy tokens each
           (ignore_eos), all at once: unconstrained, then every other one under a JSON schema; the difference per
           decode step is what the token masks cost (a shape gets a byte-level placeholder tokenizer for them).
  images:  a model that takes images: --image-requests requests, all at once, each one random --image-size square
           image (its own: no encoder cache hit) and --image-text random tokens, --image-out greedy tokens each;
           requests/s and tokens/s (`--model qwen3-vl-30b-a3b`: Qwen3-VL-30B-A3B's shape).

Models: an HF folder, the embedded default model (no --model), or a built-in real shape with random
weights built on the device (`--model qwen3-8b`, `qwen3-0.6b`, `qwen3-30b-a3b`, `deepseek-v3-4l`: the vLLM peer's
configs, load_format=dummy, no tokenizer; and qwen3.5-35b-a3b, qwen3-vl-30b-a3b, deepseek-v4-flash-4l).

`--engine vllm` runs the same workloads through the same code on vLLM's LLM (in vLLM's environment), built from the
same engine config: one generator and one clock for both engines, on any shape.

    python -m flotilla.scripts.dev.bench_offline --model qwen3-8b --workload both --json $OUT/flotilla-qwen3-8b.json
    python -m flotilla.scripts.dev.bench_offline --workload nano --num-requests 32 --min-len 32 --max-len 128
    python -m flotilla.scripts.dev.bench_offline --model qwen3-8b --workload long --gpu-memory-utilization 0.85
    (source /tmp/vp/env.sh && PYTHONPATH=/tmp/flotilla-path:$PYTHONPATH \
       python3 -m flotilla.scripts.dev.bench_offline --engine vllm --model qwen3.5-35b-a3b --workload both)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from flotilla.config import EngineConfig
from flotilla.sampling_params import SamplingParams, StructuredOutputs
from flotilla.scripts.dev import bench_workload as wl
from flotilla.scripts.dev.bench_shapes import (
    QWEN_SPECIAL_TOKENS,
    SHAPE_NAMES,
    shape_config,
    shape_dir,
    write_byte_level_placeholder_tokenizer,
    write_qwen_placeholder_tokenizer,
)
from flotilla.server.cli import HelpFormatter, add_engine_arguments, engine_config_from_args

Engine = Any
"""flotilla's LLM, or VllmEngine: what the workloads call (generate with flotilla's SamplingParams, .config)."""
LONG_MAX_MODEL_LEN = 40960
LONG128_MAX_MODEL_LEN = 131072
"""long_ctx.py's max_model_len (Qwen3-8B's max_position_embeddings), for the long-context workloads on a shape."""
WORKLOADS = {"both": ("nano", "decode1"), "long": ("long16", "long1", "mixed", "prefix")}
LONG_WORKLOADS = (*WORKLOADS["long"], "long128")
"""The long-context workloads: their own max_model_len on a shape, prefix caching as each runs it."""
"""--workload names that stand for several workloads, run in this order."""
PREFIX_CACHED = ("prefix",)
"""Workloads that run with prefix caching on, on an engine of their own; the long-context others force it off."""


def nano_workload(n: int, lo: int = 100, hi: int = 1024, seed: int = 0,
                  vocab: int = 10000) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's recipe, call for call as peer_bench.py does it, so both engines get the same requests."""
    random.seed(seed)
    prompts = [[random.randint(0, vocab) for _ in range(random.randint(lo, hi))] for _ in range(n)]
    outputs = [random.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def timed_generate(llm: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, int]:
    """(seconds, tokens generated, prompt tokens the prefix cache served) of one generate() call."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    short = Counter(o.outputs[0].finish_reason for o, p in zip(outs, params)
                    if len(o.outputs[0].token_ids) < p.max_tokens)
    assert not short, f"ignore_eos must make every output its full length; the short ones ended with {dict(short)}"
    return elapsed, generated, sum(o.num_cached_tokens for o in outs)


def run_nano(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    prompts, outputs = nano_workload(args.num_requests, args.min_len, args.max_len, args.workload_seed, args.vocab)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outputs]
    elapsed, generated, _ = timed_generate(llm, prompts, params)
    prompt_tokens = sum(map(len, prompts))
    return {"nano_workload_seqs": len(prompts), "nano_prompt_tokens": prompt_tokens, "nano_output_tokens": generated,
            "nano_workload_s": round(elapsed, 2), "nano_workload_out_tok_per_s": round(generated / elapsed, 1),
            "nano_workload_total_tok_per_s": round((generated + prompt_tokens) / elapsed, 1)}


def run_decode1(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.workload_seed + 1)
    prompt = [random.randint(0, args.vocab) for _ in range(args.decode_in)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_out)]
    timed_generate(llm, [prompt], params)  # the first run warms up (and fills the prefix cache, if on)
    elapsed, generated, _ = timed_generate(llm, [prompt], params)
    return {"b1_decode_tok_per_s": round(generated / elapsed, 1), "b1_decode_ms_per_token": round(1000 * elapsed / generated, 3)}


def run_fixed(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """--num-requests prompts of --fixed-in random tokens, each --fixed-out greedy tokens (ignore_eos), all at
    once; before them as many other prompts of the same length for one token each, whose time stands for the
    prefill's share, so the rest is the decode's: decode tok/s = requests x (fixed_out - 1) / (full time - prefill
    time). Other prompts, not the same ones: the prefix cache would otherwise serve the full run's prompts from the
    one-token run, and its prefill would cost nothing. Per GPU: over every rank of the engine (tensor x data
    parallel)."""
    rng = random.Random(args.workload_seed + 2)
    prompts, others, warm = ([[rng.randint(0, args.vocab) for _ in range(args.fixed_in)] for _ in range(args.num_requests)]
                             for _ in range(3))  # fmt: skip
    # a first batch of the same shape warms every rank (its first step's costs would otherwise land on the prefill's
    # share, which can then come out longer than the whole run)
    timed_generate(llm, warm, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)] * len(warm))
    prefill_s, _, _ = timed_generate(llm, others, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)]
                                  * len(others))  # fmt: skip
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.fixed_out)] * len(prompts)
    elapsed, generated, _ = timed_generate(llm, prompts, params)
    gpus = llm.config.parallel.tensor_parallel_size * llm.config.parallel.data_parallel_size
    if elapsed <= prefill_s:  # noise larger than the decode's share: no rate rather than an absurd one
        print(f"warning: the full run ({elapsed:.4f} s) took no longer than the prefill-only run ({prefill_s:.4f} s);"
              " raise --fixed-out for a decode rate", file=sys.stderr)
    decode_tok_per_s = len(prompts) * (args.fixed_out - 1) / (elapsed - prefill_s) if elapsed > prefill_s else None
    result = {"fixed_seqs": len(prompts), "fixed_in": args.fixed_in, "fixed_out": args.fixed_out, "gpus": gpus,
              "fixed_s": round(elapsed, 4), "fixed_prefill_s": round(prefill_s, 4),
              "fixed_out_tok_per_s": round(generated / elapsed, 1),
              "fixed_decode_tok_per_s": decode_tok_per_s and round(decode_tok_per_s, 1),
              "fixed_decode_tok_per_s_per_gpu": decode_tok_per_s and round(decode_tok_per_s / gpus, 1)}
    return {**result, **expert_imbalance(llm)}


def run_images(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    from PIL import Image

    from flotilla.models.hf_config import load_hf_config
    from flotilla.models.model_folder import model_dir

    vision = load_hf_config(model_dir(llm.config)).vision
    if vision is None:
        raise SystemExit("bench_offline: the images workload needs a model that takes images")
    work = wl.image_workload(args.image_requests, args.image_size, args.image_text, args.vocab,
                             vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id,
                             seed=args.workload_seed + 3)
    requests = [{"prompt_token_ids": r.prompt_token_ids, "multi_modal_data": {"image": Image.fromarray(r.pixels)}}
                for r in work]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.image_out)
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    # the prompts' tokens with their images': flotilla counts them, vLLM returns the expanded ids
    prompt_tokens = sum(getattr(o, "num_prompt_tokens", 0) or len(o.prompt_token_ids) for o in outs)
    return {"images_requests": len(outs), "images_size": args.image_size, "images_prompt_tokens": prompt_tokens,
            "images_s": round(elapsed, 2), "images_req_per_s": round(len(outs) / elapsed, 2),
            "images_out_tok_per_s": round(generated / elapsed, 1),
            "images_total_tok_per_s": round((generated + prompt_tokens) / elapsed, 1),
            "image_encoder": llm.config.worker.image_encoder}


STRUCTURED_SCHEMA = {
    "type": "object", "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 300, "items": {
        "type": "object", "required": ["id", "name", "score"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"}}}}}}
"""The structured workload's schema: records of three typed fields, at least 300 of them (over 8,000 characters),
so no output of a few hundred tokens completes it and every constrained output runs its full length in both
engines."""


def run_structured(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The cost of structured outputs per decode step: the same batch shape unconstrained, then with every other
    request under STRUCTURED_SCHEMA (after a warm-up of the constrained batch, so the grammar is compiled and cached
    and every path has run); other prompts each time (the prefix cache serves none)."""
    rng = random.Random(args.workload_seed + 3)
    n, out = args.structured_requests, args.structured_out
    warm, plain_prompts, masked_prompts = ([[rng.randint(0, args.vocab) for _ in range(args.structured_in)]
                                            for _ in range(n)] for _ in range(3))  # fmt: skip
    plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out)
    constrained = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out,
                                 structured_outputs=StructuredOutputs(json=json.dumps(STRUCTURED_SCHEMA)))
    mixed = [constrained if i % 2 == 0 else plain for i in range(n)]
    timed_generate(llm, warm, mixed)
    plain_s, _, _ = timed_generate(llm, plain_prompts, [plain] * n)
    masked_s, _, _ = timed_generate(llm, masked_prompts, mixed)
    return {"structured_requests": n, "structured_constrained": (n + 1) // 2, "structured_in": args.structured_in,
            "structured_out": out, "structured_plain_s": round(plain_s, 4), "structured_masked_s": round(masked_s, 4),
            "structured_mask_ms_per_step": round((masked_s - plain_s) / out * 1000, 3),
            "structured_overhead_pct": round(100 * (masked_s / plain_s - 1), 2)}


def _greedy(outputs: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in outputs]


def _rates(name: str, w: wl.Workload, elapsed: float) -> dict[str, Any]:
    return {f"{name}_s": round(elapsed, 2), f"{name}_out_tok_per_s": round(w.output_tokens / elapsed, 1),
            f"{name}_total_tok_per_s": round((w.input_tokens + w.output_tokens) / elapsed, 1)}


def run_long16(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    w = wl.long16_workload(args.length_divisor, args.long_top_id)
    elapsed, _, _ = timed_generate(llm, w.prompts, _greedy(w.output_lens))
    return _rates("long16", w, elapsed)


def run_long1(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    return _one_long_prompt("long1", wl.long1_workload(args.length_divisor, args.long_top_id), llm)


def run_long128(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    return _one_long_prompt("long128", wl.long128_workload(args.length_divisor, args.long_top_id), llm)


def _one_long_prompt(name: str, w: wl.Workload, llm: Engine) -> dict[str, Any]:
    """Prefill: the faster of two one-token runs; decode: what the longer run takes beyond it, per step."""
    (first, second, full), steps = w.prompts, w.output_lens[2] - 1
    prefill_s = min(timed_generate(llm, [p], _greedy([1]))[0] for p in (first, second))
    elapsed, _, _ = timed_generate(llm, [full], _greedy([w.output_lens[2]]))
    return {f"{name}_prompt_tokens": len(full), f"{name}_prefill_s": round(prefill_s, 3),
            f"{name}_decode_ms_per_token": round(1000 * (elapsed - prefill_s) / steps, 3)}


def run_mixed(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    w = wl.long_mixed_workload(args.length_divisor, args.long_top_id)
    elapsed, _, _ = timed_generate(llm, w.prompts, _greedy(w.output_lens))
    return _rates("mixed", w, elapsed)


def run_prefix(llm: Engine, args: argparse.Namespace) -> dict[str, Any]:
    warm, w = wl.prefix_workload(args.length_divisor, args.long_top_id)
    timed_generate(llm, [warm], _greedy([1]))  # caches the shared prefix
    elapsed, _, cached = timed_generate(llm, w.prompts, _greedy(w.output_lens))
    return {**_rates("prefix", w, elapsed), "prefix_cached_tokens": cached}


RUNS: dict[str, tuple[Any, str]] = {
    "nano": (run_nano, "nano_workload_out_tok_per_s"), "decode1": (run_decode1, "b1_decode_tok_per_s"),
    "fixed": (run_fixed, "fixed_decode_tok_per_s"), "long16": (run_long16, "long16_out_tok_per_s"),
    "long1": (run_long1, "long1_decode_ms_per_token"), "mixed": (run_mixed, "mixed_out_tok_per_s"),
    "long128": (run_long128, "long128_decode_ms_per_token"),
    "prefix": (run_prefix, "prefix_out_tok_per_s"), "images": (run_images, "images_out_tok_per_s"),
    "structured": (run_structured, "structured_mask_ms_per_step")}
"""Each workload's run and the figure --repeat takes the median of."""


def expert_imbalance(llm: Engine) -> dict[str, Any]:
    """Under expert parallelism, from the ranks' per-expert token counts since start (they report every half
    second): per MoE layer the busiest expert's tokens over the mean, and the busiest rank's (contiguous
    placement: rank r holds experts [r E / ep, (r + 1) E / ep)) over the mean; each averaged over the layers,
    and the worst layer's. Empty without expert parallelism or before the first report."""
    if isinstance(llm, VllmEngine):
        return {}
    time.sleep(0.6)  # one more report, so the counts include the workload's end
    loads = llm.client.expert_loads.total()
    ep = llm.config.parallel.expert_parallel_size
    if loads is None or ep < 2 or not loads.sum():
        return {}
    loads = loads[loads.sum(axis=1) > 0].astype(float)  # [moe layers, experts], the layers that ran
    experts = loads.max(axis=1) / loads.mean(axis=1)
    per_rank = loads.reshape(len(loads), ep, -1).sum(axis=2)
    ranks = per_rank.max(axis=1) / per_rank.mean(axis=1)
    return {"expert_imbalance_mean": round(float(experts.mean()), 3), "expert_imbalance_max": round(float(experts.max()), 3),
            "rank_imbalance_mean": round(float(ranks.mean()), 3), "rank_imbalance_max": round(float(ranks.max()), 3)}


def repeated(run: Any, llm: Engine, args: argparse.Namespace, key: str) -> dict[str, Any]:
    """`run` --repeat times on the same engine: the run with the median `key`, and every run's `key` (so the
    spread between runs of the same code is measured, not guessed)."""
    runs = [run(llm, args) for _ in range(args.repeat)]
    if len(runs) == 1:
        return runs[0]
    median = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    return {**median, f"{key}_runs": [r[key] for r in runs]}


def engine_config(args: argparse.Namespace, workloads: tuple[str, ...] = ()) -> EngineConfig:
    """The engine for these workloads: a shape gets the peer's settings, the long-context workloads long_ctx.py's
    max_model_len and prefix caching as each of them runs it."""
    long_ctx = any(w in LONG_WORKLOADS for w in workloads)
    if shape_config(args.model) is not None:
        # the peer's settings: bf16, random weights, no tokenizer, max_model_len 4096, no prefix caching
        args.load_format, args.skip_tokenizer_init, args.dtype = "dummy", True, "bfloat16"
        args.max_model_len = args.max_model_len or (LONG128_MAX_MODEL_LEN if "long128" in workloads
                                                    else LONG_MAX_MODEL_LEN if long_ctx else 4096)
        args.enable_prefix_caching = False
    if long_ctx:
        args.enable_prefix_caching = any(w in PREFIX_CACHED for w in workloads)
    model = str(shape_dir(args.model)) if shape_config(args.model) is not None else args.model
    if "structured" in workloads and shape_config(args.model) is not None:  # token masks need a tokenizer's strings
        model, args.skip_tokenizer_init = str(with_tokenizer(Path(model), write_byte_level_placeholder_tokenizer)), False
    # (vLLM picks its own defaults; probing the GPU here would initialize CUDA in this process before it starts)
    return engine_config_from_args(args, model, offline=True, device_defaults=args.engine != "vllm")


def with_tokenizer(folder: Path, write: Any, **options: Any) -> Path:
    """A copy of a shape's folder with a placeholder tokenizer (bench_shapes' `write`, given `options`) beside its
    config."""
    copy = Path(tempfile.gettempdir()) / f"bench-{folder.name}-{write.__name__}"
    copy.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy(f, copy / f.name)
    write(copy, **options)
    return copy


def engine_groups(workload: str) -> list[tuple[str, ...]]:
    """The workloads --workload names, grouped by the engine they run on (prefix caching off, then on)."""
    names = WORKLOADS.get(workload, (workload,))
    groups = [tuple(n for n in names if n not in PREFIX_CACHED), tuple(n for n in names if n in PREFIX_CACHED)]
    return [g for g in groups if g]


def _parallel(config: EngineConfig) -> dict[str, Any]:
    """The run's parallel layout, for the record: sizes, and how expert parallelism moves tokens."""
    par = config.parallel
    out: dict[str, Any] = {"tp": par.tensor_parallel_size, "dp": par.data_parallel_size,
                           "ep": par.expert_parallel_size}
    if par.expert_parallel_size > 1:
        out["all2all"] = "allgather_reducescatter" if par.gathers_tokens else "all_to_all"
    return out


class VllmEngine:
    """vLLM's LLM (run in vLLM's environment) behind the calls the workloads make, so that vLLM runs the very same
    requests through the very same timing code: generate() takes flotilla's SamplingParams (the fields the workloads
    set), .config is the engine config both engines are built from. A model that takes images, asked for them
    (`images`), gets a copy of its folder with a placeholder tokenizer of Qwen's ids, which vLLM's processor needs
    (bench_shapes); asked for text only, it runs as its language model alone (vLLM's language_model_only: no vision
    tower, no encoder profiling), as flotilla runs text."""

    def __init__(self, config: EngineConfig, images: bool = False, options: dict[str, Any] | None = None) -> None:
        import vllm

        self.config, self.version = config, vllm.__version__
        model = Path(config.model.model)
        hf = json.loads((model / "config.json").read_text())
        takes_images = "vision_config" in hf
        if takes_images and images:
            first_special = int(hf.get("image_token_id", 151655)) - QWEN_SPECIAL_TOKENS.index("<|image_pad|>")
            model = with_tokenizer(model, write_qwen_placeholder_tokenizer, first_special=first_special)
        tokenizer = (model / "tokenizer.json").is_file()
        mm = {"limit_mm_per_prompt": {"image": 1}} if takes_images and images else \
            {"language_model_only": True} if takes_images else {}
        self.llm = vllm.LLM(model=str(model), load_format=config.model.load_format, dtype=config.model.dtype,
                            max_model_len=config.model.max_model_len, seed=0,
                            gpu_memory_utilization=config.cache.gpu_memory_utilization,
                            enable_prefix_caching=config.cache.enable_prefix_caching,
                            tensor_parallel_size=config.parallel.tensor_parallel_size,
                            skip_tokenizer_init=not tokenizer, **mm, **(options or {}))

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams], use_tqdm: bool = False) -> list:
        import vllm

        def convert(p: SamplingParams) -> vllm.SamplingParams:
            so = p.structured_outputs
            extra = {}
            if so is not None:  # (the structured workload's: a JSON schema)
                from vllm.sampling_params import StructuredOutputsParams

                extra["structured_outputs"] = StructuredOutputsParams(json=json.loads(so.json))
            return vllm.SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                                       seed=p.seed, **extra)

        return self.llm.generate(prompts, [convert(p) for p in params] if isinstance(params, list) else
                                 convert(params), use_tqdm=use_tqdm)

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.llm


def run_engine(args: argparse.Namespace, workloads: tuple[str, ...], describe: bool) -> dict[str, Any]:
    """Start an engine for these workloads, run each (--repeat times), stop it; describe: also the engine's facts."""
    config = engine_config(args, workloads)
    if args.engine == "vllm":
        return run_vllm(args, config, workloads, describe)
    from flotilla.llm import LLM

    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    with LLM(config=config, placement=args.placement) as llm:
        start_s = time.perf_counter() - t0
        worker = llm.client.ready_detail.get("worker/0", {})
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        if describe:
            result = {"engine": "flotilla", "model": args.model or "default", "placement": llm.placement,
                      "device": worker.get("device"), "dtype": worker.get("dtype"),
                      "attention": worker.get("attention"),
                      "kv_tokens": int(worker.get("kv_tokens", 0)), "engine_start_s": round(start_s, 2),
                      "model_load_s": float(worker.get("load_s", 0)), "cuda_graphs": worker.get("cuda_graphs"),
                      "parallel": _parallel(config), "max_num_seqs": config.scheduler.max_num_seqs,
                      "max_num_batched_tokens": config.scheduler.max_num_batched_tokens}
        if any(w in LONG_WORKLOADS for w in workloads):
            result.update(length_divisor=args.length_divisor,
                          max_model_len=int(llm.client.ready_detail.get("tokenizer/0", {}).get("max_model_len", 0)))
        for name in workloads:
            run, key = RUNS[name]
            result.update(repeated(run, llm, args, key))
    return result


def run_vllm(args: argparse.Namespace, config: EngineConfig, workloads: tuple[str, ...],
             describe: bool) -> dict[str, Any]:
    """run_engine's work on vLLM (VllmEngine), with the same warm-up."""
    import torch

    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    options = json.loads(args.vllm_options)
    with VllmEngine(config, images="images" in workloads, options=options) as llm:
        start_s = time.perf_counter() - t0
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))  # warm-up
        if describe:
            result = {"engine": f"vllm {llm.version}", "model": args.model, "vllm_options": options,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                      "dtype": config.model.dtype, "engine_start_s": round(start_s, 2),
                      "parallel": _parallel(config)}
        if any(w in LONG_WORKLOADS for w in workloads):
            result.update(length_divisor=args.length_divisor, max_model_len=config.model.max_model_len)
        for name in workloads:
            run, key = RUNS[name]
            result.update(repeated(run, llm, args, key))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_offline", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"HF model folder, or a built-in shape with random weights ({SHAPE_NAMES}); "
                        "default: the embedded default model")
    p.add_argument("--workload", choices=["nano", "decode1", "both", "fixed", *LONG_WORKLOADS, "long", "images",
                                          "structured"],
                   default="both",
                   help="which workload(s): both = nano and decode1; fixed = --num-requests x --fixed-in / --fixed-out "
                        "(the decode-heavy wide-EP workload, with the decode's own rate and per-GPU figures); long = "
                        "long16, long1, mixed and prefix (long_ctx.py's long-context workloads), long128 one "
                        "128,000-token prompt (--model qwen3-8b-yarn); structured = the "
                        "cost of JSON-schema token masks per decode step")
    p.add_argument("--num-requests", type=int, default=256, help="nano: number of requests")
    p.add_argument("--min-len", type=int, default=100, help="nano: shortest prompt / output, tokens")
    p.add_argument("--max-len", type=int, default=1024, help="nano: longest prompt / output, tokens")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload generator (peer: 0)")
    p.add_argument("--vocab", type=int, default=None,
                   help="token ids are drawn from [0, vocab]; default: 10000 (peer_bench.py's), the long-context "
                        f"workloads {wl.LONG_CTX_TOP_ID} (long_ctx.py's)")
    p.add_argument("--length-divisor", type=int, default=1,
                   help="long-context workloads: prompt and output lengths divided by this (at least 1 token "
                        "each), for toy runs")
    p.add_argument("--fixed-in", type=int, default=2000, help="fixed: prompt tokens of every request")
    p.add_argument("--fixed-out", type=int, default=256, help="fixed: output tokens of every request")
    p.add_argument("--image-requests", type=int, default=32, help="images: requests, all at once")
    p.add_argument("--image-size", type=int, default=1024, help="images: each image's side, pixels")
    p.add_argument("--image-text", type=int, default=200, help="images: text tokens of each prompt")
    p.add_argument("--image-out", type=int, default=128, help="images: output tokens of each request")
    p.add_argument("--structured-requests", type=int, default=64, help="structured: requests, all at once")
    p.add_argument("--structured-in", type=int, default=128, help="structured: prompt tokens of each request")
    p.add_argument("--structured-out", type=int, default=256, help="structured: output tokens of each request")
    p.add_argument("--decode-in", type=int, default=128, help="decode1: prompt tokens")
    p.add_argument("--decode-out", type=int, default=256, help="decode1: output tokens")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each workload this many times on the same engine and report the median run and all "
                        "runs (with prefix caching on, later nano and prefix runs find their prompts cached)")
    p.add_argument("--placement", choices=["inline", "process"], default=None,
                   help="engine actors in this process (inline) or one process each; default: LLM's (process on a "
                        "GPU, inline on CPU)")
    p.add_argument("--engine", choices=["flotilla", "vllm"], default="flotilla",
                   help="which engine runs the workloads: vllm runs vLLM's LLM on the same requests and timing code "
                        "(in vLLM's environment; a built-in shape, the engine flags that both take: dtype, "
                        "max-model-len, gpu-memory-utilization, tensor-parallel-size)")
    p.add_argument("--vllm-options", default="{}",
                   help="--engine vllm: more keyword arguments for vLLM's LLM, as JSON (e.g. '{\"gdn_prefill_backend\": "
                        "\"triton\"}'); recorded with the result")
    p.add_argument("--json", default=None, help="write the result to this file too")
    add_engine_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.length_divisor < 1:
        p.error("--length-divisor must be at least 1")
    args.long_top_id = wl.LONG_CTX_TOP_ID if args.vocab is None else args.vocab
    args.vocab = 10000 if args.vocab is None else args.vocab
    result: dict[str, Any] = {}
    for workloads in engine_groups(args.workload):
        result.update(run_engine(args, workloads, describe=not result))
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
