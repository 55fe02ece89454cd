"""vLLM on bench_offline's images workload: the same requests (bench_workload.image_workload, the same seed), the same
Qwen3-VL shape with dummy weights, timed as bench_offline times flotilla's; run in vLLM's environment.

vLLM builds its Qwen3-VL processor from the model folder, which needs a tokenizer (and transformers' video processor,
which needs torchvision): the shape's folder is copied with a placeholder tokenizer of Qwen's ids
(bench_shapes.write_qwen_placeholder_tokenizer). The prompts are token ids with one image placeholder each, which
vLLM expands to the image's tokens as flotilla does.

    (source /tmp/vp/env.sh && python3 -m flotilla.scripts.dev.bench_images_vllm --json $OUT/vllm-images.json)
    python3 -m flotilla.scripts.dev.bench_offline --model qwen3-vl-30b-a3b --workload images   # flotilla, the same
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from flotilla.scripts.dev import bench_workload as wl
from flotilla.scripts.dev.bench_shapes import shape_config, shape_dir, write_qwen_placeholder_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-vl-30b-a3b", help="a built-in shape that takes images")
    p.add_argument("--image-requests", type=int, default=32, help="requests, all at once")
    p.add_argument("--image-size", type=int, default=1024, help="each image's side, pixels")
    p.add_argument("--image-text", type=int, default=200, help="text tokens of each prompt")
    p.add_argument("--image-out", type=int, default=128, help="output tokens of each request")
    p.add_argument("--vocab", type=int, default=10000, help="text token ids drawn below this (bench_offline's)")
    p.add_argument("--workload-seed", type=int, default=0, help="bench_offline's --workload-seed")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--json", default=None, help="write the result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = shape_config(args.model)
    if config is None or "vision_config" not in config:
        raise SystemExit(f"bench_images_vllm: {args.model!r} is not a built-in shape that takes images")
    folder = Path(tempfile.gettempdir()) / f"vllm-shape-{args.model}"
    folder.mkdir(exist_ok=True)
    for f in shape_dir(args.model).iterdir():
        shutil.copy(f, folder / f.name)
    write_qwen_placeholder_tokenizer(folder)
    from PIL import Image
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, limit_mm_per_prompt={"image": 1},
              max_num_seqs=max(args.image_requests, 1))
    work = wl.image_workload(args.image_requests, args.image_size, args.image_text, args.vocab,
                             config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"],
                             seed=args.workload_seed + 3)
    requests = [{"prompt_token_ids": r.prompt_token_ids, "multi_modal_data": {"image": Image.fromarray(r.pixels)}}
                for r in work]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.image_out)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # bench_offline's warm-up
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {"engine": f"vllm {vllm.__version__}", "gpu": torch.cuda.get_device_name(0), "model": args.model,
              "command": " ".join(sys.argv), "images_requests": len(outs), "images_size": args.image_size,
              "images_prompt_tokens": prompt_tokens, "images_s": round(elapsed, 2),
              "images_req_per_s": round(len(outs) / elapsed, 2), "images_out_tok_per_s": round(generated / elapsed, 1),
              "images_total_tok_per_s": round((generated + prompt_tokens) / elapsed, 1)}
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
