"""Parallel ranks sharing one GPU against one rank, on a real-shaped checkpoint: the greedy tokens must be the same.

tests/test_shared_device.py checks tensor parallelism and DP x EP with their ranks on one GPU
(`ranks_share_device`) on tiny models; this runs the same comparison at a built-in shape's real layer sizes. The
dummy load format cannot serve here (each rank would fill its own shard with its own random values), so a checkpoint
with random weights is written first (transformers' initialisation, seeded, bf16 safetensors), then one engine
serves it with one rank and one with two ranks on the same device, in float32 so that the ranks' other summation
order cannot flip a greedy token. `--layers` keeps a large shape's first N layers (each at its real size).

    python -m flotilla.scripts.dev.check_shared_device --model qwen3-0.6b --parallel tp2
    python -m flotilla.scripts.dev.check_shared_device --model qwen3-30b-a3b --layers 2 --parallel dp2ep2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flotilla import LLM, SamplingParams
from flotilla.scripts.dev.bench_shapes import SHAPE_NAMES, shape_config

PARALLEL = {
    "tp2": {"placement": "process", "tensor_parallel_size": 2},
    "dp2ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
}
"""--parallel: the two-rank engine's options (ranks_share_device is added on CUDA)."""


def write_checkpoint(config: dict[str, Any], out: Path, seed: int) -> Path:
    """A checkpoint folder of `config` with transformers' random initialisation (seeded), saved in bf16."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def greedy_tokens(model: Path, options: dict[str, Any], prompts: list[dict], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model), skip_tokenizer_init=True, enable_prefix_caching=False, **options) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_shared_device", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"a built-in shape ({SHAPE_NAMES}) or a folder with a config.json")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--parallel", choices=sorted(PARALLEL), default="tp2", help="the two-rank engine")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="the engines' dtype (the checkpoint is bf16)")
    p.add_argument("--prompts", type=int, default=4, help="prompts of 20-200 random token ids")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--engine-options", default="{}",
                   help="JSON of further options for both engines (e.g. kv_cache_blocks, max_model_len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)

    config = shape_config(args.model)
    if config is None:
        folder = Path(args.model)
        if not (folder / "config.json").is_file():
            p.error(f"--model {args.model!r}: neither a built-in shape nor a folder with a config.json")
        config = json.loads((folder / "config.json").read_text())
    if args.layers is not None:
        config = {**config, "num_hidden_layers": args.layers}
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:args.layers]
    t0 = time.perf_counter()
    model = write_checkpoint(config, Path(tempfile.mkdtemp(prefix="flotilla-shared-")) / "model", args.seed)
    written = time.perf_counter() - t0
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, min(config["vocab_size"], 10_000))
                                     for _ in range(rng.randint(20, 200))]} for _ in range(args.prompts)]
    common = {"device": args.device, "dtype": args.dtype, **json.loads(args.engine_options)}
    two = {**PARALLEL[args.parallel], **({"ranks_share_device": True} if args.device.startswith("cuda") else {})}
    want = greedy_tokens(model, common, prompts, args.max_tokens)
    got = greedy_tokens(model, {**common, **two}, prompts, args.max_tokens)
    first_difference = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None) for w, g in zip(want, got)]
    result = {"model": args.model, "layers": config["num_hidden_layers"], "parallel": args.parallel,
              "device": args.device, "dtype": args.dtype, "equal": got == want, "first_difference": first_difference,
              "checkpoint_s": round(written, 1), "tokens": sum(map(len, got))}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
