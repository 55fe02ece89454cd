"""One rank of tests/test_deepseek_tp.py: `python helpers_deepseek_tp_rank.py RANK WORLD INIT_METHOD OUT DIR...`.

Joins a gloo group, loads each tiny DeepSeek-V3 checkpoint DIR through the loader (each layer slicing its
part), decodes the prompts of `decode_greedy` and saves the logits to OUT/rank{RANK}_{i}.safetensors (i: the
DIR's index) for the test to compare with the one-rank model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from helpers_tiny_models import PagedRunner, random_tokens
from safetensors.torch import save_file

from flotilla.models.loader import load_model
from flotilla.models.parallel import destroy_tensor_parallel, init_tensor_parallel

PROMPT_LENGTHS = (5, 13, 8)
STEPS = 8


def decode_greedy(model: torch.nn.Module) -> torch.Tensor:
    """float32 [steps, len(PROMPT_LENGTHS), vocab]: the last-position logits of each step of a batch of
    sequences decoded greedily together (the prompts' prefill first, then one token each per step)."""
    runner = PagedRunner(model, block_size=4)
    batch = [(i, random_tokens(n, seed=30 + i)) for i, n in enumerate(PROMPT_LENGTHS)]
    steps = []
    for _ in range(STEPS):
        last = torch.stack([logits[-1] for logits in runner.step(batch)])
        steps.append(last)
        batch = [(i, [int(t)]) for i, t in enumerate(last.argmax(dim=-1))]
    return torch.stack(steps)


def load(model_dir: Path) -> torch.nn.Module:
    kwargs = {"attention_backend": "torch", "moe_backend": "torch", "fp8_backend": "torch"}
    return load_model(model_dir, progress=False, model_kwargs=kwargs).module.eval()


def main(rank: int, world: int, init_method: str, out: Path, model_dirs: list[Path]) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world, init_method, torch.device("cpu"), timeout_s=60)
    for i, model_dir in enumerate(model_dirs):
        save_file({"logits": decode_greedy(load(model_dir))}, str(out / f"rank{rank}_{i}.safetensors"))
    destroy_tensor_parallel()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), [Path(p) for p in sys.argv[5:]])
