"""One rank of tests/test_expert_parallel.py: `python helpers_ep_rank.py RANK WORLD INIT_METHOD DIR [MODE]`.

MODE all_to_all (the default) runs ExpertParallelExperts; allgather_reducescatter runs GatheredTokenExperts
(kernels/moe/ep_allgather.py), each step inside ep_tokens(the most tokens any rank has that step, plus the
step's number modulo 2: some steps pad beyond every rank's batch).

Joins a gloo group, keeps its experts' rows of the whole stacked weights in DIR/inputs.safetensors, and runs
the expert-parallel layer (kernels/moe/expert_parallel.py) on this rank's tokens and routing of every step
there (`step{S}.rank{R}.x`, `.topk_weights`, `.topk_ids`; a step may give a rank no tokens). Saves each step's
output and the placement's load counters to DIR/rank{RANK}.safetensors for the test to compare with one
process running every expert.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from flotilla.kernels.moe import get_moe_backend
from flotilla.kernels.moe.ep_allgather import GatheredTokenExperts, ep_tokens
from flotilla.kernels.moe.expert_parallel import ExpertParallelExperts, ExpertPlacement


def main(rank: int, world: int, init_method: str, folder: Path, mode: str = "all_to_all") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=60))
    inputs = load_file(str(folder / "inputs.safetensors"))
    placement = ExpertPlacement(inputs["w13"].shape[0], world, rank)
    gathered = mode == "allgather_reducescatter"
    layer = (GatheredTokenExperts if gathered else ExpertParallelExperts)(placement, dist.group.WORLD,
                                                                          get_moe_backend("torch"))
    w13, w2 = placement.local_slice(inputs["w13"]), placement.local_slice(inputs["w2"])
    out: dict[str, torch.Tensor] = {}
    step = 0
    while f"step{step}.rank{rank}.x" in inputs:
        p = f"step{step}.rank{rank}"
        most = max(inputs[f"step{step}.rank{r}.x"].shape[0] for r in range(world))
        with ep_tokens(most + step % 2 if gathered else 0):
            out[f"step{step}.out"] = layer(inputs[f"{p}.x"], w13, w2, inputs[f"{p}.topk_weights"],
                                           inputs[f"{p}.topk_ids"])
        out[f"step{step}.expert_load"] = placement.expert_load.clone()
        out[f"step{step}.local_expert_load"] = placement.local_expert_load.clone()
        step += 1
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / f"rank{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), *sys.argv[5:])
