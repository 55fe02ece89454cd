"""One rank of tests/test_parallel.py: `python helpers_tp_rank.py RANK WORLD INIT_METHOD DIR`.

Joins a gloo group, builds the tensor-parallel layers of models/parallel.py from the whole tensors in
DIR/weights.safetensors (each layer slicing its own part), runs them on DIR's inputs, and saves what this
rank computed to DIR/rank{RANK}.safetensors for the test to compare with the unsharded computation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from flotilla.models.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    destroy_tensor_parallel,
    init_tensor_parallel,
    vocab_parallel_logits,
)


def main(rank: int, world: int, init_method: str, folder: Path) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world, init_method, torch.device("cpu"), timeout_s=60)
    w = load_file(str(folder / "weights.safetensors"))
    out: dict[str, torch.Tensor] = {}
    hidden, head_dim = w["x"].shape[1], int(w["head_dim"])

    for name in ("qkv_split", "qkv_replicated"):  # 2 kv heads over 2 ranks; 1 kv head shared by both
        num_heads, num_kv = w[f"{name}.q"].shape[0] // head_dim, w[f"{name}.k"].shape[0] // head_dim
        qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv, bias=True)
        for part in ("q", "k", "v"):
            qkv.load(qkv.weight, w[f"{name}.{part}"], (f"{name}.{part}", "qkv.weight"), part)
            qkv.load(qkv.bias, w[f"{name}.{part}_bias"], (f"{name}.{part}_bias", "qkv.bias"), part)
        out[name] = qkv(w["x"])

    # an MLP: column-parallel gate/up -> SiLU-and-mul -> row-parallel down (with a bias, added once)
    inter = w["gate"].shape[0]
    gate_up = MergedColumnParallelLinear(hidden, inter, ("gate", "up"), bias=False)
    gate_up.load(gate_up.weight, w["gate"], ("gate", "gate_up.weight"), "gate")
    gate_up.load(gate_up.weight, w["up"], ("up", "gate_up.weight"), "up")
    down = RowParallelLinear(inter, hidden, bias=True)
    down.load(down.weight, w["down"], ("down", "down.weight"))
    down.load(down.bias, w["down_bias"], ("down_bias", "down.bias"))
    g, u = gate_up(w["x"]).chunk(2, dim=-1)
    out["mlp"] = down(F.silu(g) * u)

    embed = VocabParallelEmbedding(*w["embed"].shape)  # a vocabulary that does not split evenly
    embed.load(embed.weight, w["embed"], ("embed", "embed.weight"))
    out["embedded"] = embed(w["ids"])
    out["logits"] = vocab_parallel_logits(w["x"], embed)

    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / f"rank{rank}.safetensors"))
    destroy_tensor_parallel()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
