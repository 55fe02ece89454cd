"""The worker's side of data parallelism x expert parallelism (actors/data_parallel.py tells the whole story):
a data-parallel rank's device, its place in the expert-parallel group, and the expert-parallel layers' empty
step and token counts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import msgspec
import numpy as np
import torch
from torch import nn

from flotilla.actors.cuda_graphs import DecodeGraphs, decodes_only
from flotilla.config import EngineConfig
from flotilla.kernels.moe.ep_allgather import ep_tokens
from flotilla.models.parallel import (
    expert_parallel_over_tensor_parallel,
    agree_on_rows,
    ep_gathers_tokens,
    gather_tokens_over_expert_parallel,
    init_data_parallel_world,
    init_expert_parallel,
)
from flotilla.models.qwen3_moe import StackedExperts
from flotilla.transport.messages import StepPlan


def dp_tp_rank(instance: int, tp_size: int) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of worker instance `instance`."""
    return divmod(instance, tp_size)


def ep_graphs_enabled(config: EngineConfig) -> bool:
    """Whether an expert-parallel engine's ranks capture decode graphs: not with the all-to-all, which reads its
    split sizes on the host; when the experts gather tokens (static shapes) with ep_cuda_graphs, and under TP x EP
    (masked routing over shared tokens, no collective of its own) with tp_cuda_graphs."""
    par = config.parallel
    if par.gathers_tokens:
        return config.worker.ep_cuda_graphs
    return par.enable_expert_parallel and par.data_parallel_size == 1 and config.worker.tp_cuda_graphs


def rank_config(config: EngineConfig, dp_rank: int) -> EngineConfig:
    """The config a data-parallel rank's runner gets: on CUDA its own GPUs, from (first GPU) + dp_rank * tp on;
    eager under expert parallelism unless ep_graphs_enabled."""
    worker = config.worker
    if config.parallel.expert_parallel_size > 1 and not worker.enforce_eager and not ep_graphs_enabled(config):
        worker = msgspec.structs.replace(worker, enforce_eager=True)
    device = "cuda" if worker.device == "auto" and torch.cuda.is_available() else worker.device
    if config.parallel.data_parallel_size > 1 and device.startswith("cuda") and not config.parallel.ranks_share_device:
        first = int(device.partition(":")[2] or 0) + dp_rank * config.parallel.tensor_parallel_size
        worker = msgspec.structs.replace(worker, device=f"cuda:{first}")
    return config if worker is config.worker else msgspec.structs.replace(config, worker=worker)


def join_expert_parallel(config: EngineConfig, dp_rank: int, init_method: str | None, tp_rank: int = 0) -> None:
    """Before the model is built: join the engine's expert-parallel group, so the MoE layers keep only this rank's
    experts; on CPU share the host's cores between the ranks. The group is the data-parallel ranks (one
    tensor-parallel rank each), or with one data-parallel rank the tensor-parallel group (which the runner joins),
    or with both every rank of the engine: one world at `init_method` whose tensor-parallel sub-groups the runner
    then uses (models/parallel.py init_data_parallel_world)."""
    dp_size, tp_size = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
    size = dp_size * tp_size
    device = torch.device(config.worker.device if config.worker.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and size > 1:  # more threads than cores per rank would only thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    ep = config.parallel.expert_parallel_size
    if ep == 1:
        return
    if dp_size == 1:  # TP x EP: the tensor-parallel ranks hold the same tokens
        expert_parallel_over_tensor_parallel()
        return
    if init_method is None:
        raise ValueError("enable_expert_parallel needs the ranks' rendezvous address (ep_init_method)")
    shared = config.parallel.ranks_share_device
    if device.type == "cuda":
        # rank_config gave the DP rank's first GPU (the one GPU, when the ranks share it)
        device = torch.device("cuda", (device.index or 0) + (0 if shared else tp_rank))
        torch.cuda.set_device(device)
    if tp_size == 1:
        init_expert_parallel(dp_rank, ep, init_method, device, share_device=shared)
    else:
        init_data_parallel_world(dp_rank, dp_size, tp_rank, tp_size, init_method, device, share_device=shared)
    if config.parallel.gathers_tokens:
        gather_tokens_over_expert_parallel()


def expert_parallel_layers(model: nn.Module) -> list[StackedExperts]:
    """The model's MoE layers whose experts are spread over an expert-parallel group (of data-parallel or of
    tensor-parallel ranks), in forward order."""
    return [m for m in model.modules() if isinstance(m, StackedExperts) and m.ep_experts is not None]


def mtp_expert_layers(model: nn.Module) -> list[StackedExperts]:
    """The expert-parallel layers of the model's multi-token-prediction layers (DeepSeek-V3's), in forward order;
    none without them."""
    mtp = getattr(getattr(model, "model", None), "mtp_layers", None)
    return expert_parallel_layers(mtp) if mtp is not None else []


@contextlib.contextmanager
def step_rows(plan: StepPlan, graphs: DecodeGraphs | None) -> Iterator[int | None]:
    """Where the experts gather every rank's tokens (all2all_backend allgather_reducescatter): agree with the other
    ranks on the step's rows and run the step inside ep_tokens(them), yielding the runner's graph_size; elsewhere
    yield None (the runner chooses). Every rank calls it once per step, real or empty, in step order, as the
    lockstep pairs them. A speculating step's passes (the main model's, the MTP layer's) each take at most the
    step's tokens, so the agreed rows hold every pass.

    With decode graphs (`graphs`: every rank captured the same sizes): when every rank's step is a decode batch a
    graph holds, or empty, each busy rank replays the graph of the size that holds the largest batch and the MoE
    layers exchange that many rows; otherwise every rank runs eager and they exchange the most tokens any rank has
    (an eager step's collectives pair with a replayed graph's: the same calls in the same order)."""
    if not ep_gathers_tokens():
        yield None
        return
    rows = int(plan.num_new_tokens.sum()) if plan.rids else 0
    graphable = graphs is not None and (not plan.rids or (decodes_only(plan) and graphs.fits(rows)))
    most, someone_eager = agree_on_rows(rows, eager=not graphable)
    size = graphs.padded_size(most) if graphs is not None and not someone_eager and most else 0
    with ep_tokens(size or most):
        yield size


@torch.inference_mode()
def empty_forward(layers: list[StackedExperts], mtp_layers: list[StackedExperts] | None = None,
                  mtp_passes: int = 0) -> None:  # fmt: skip
    """An idle rank's step: every expert-parallel layer's all-to-alls, in order, with no tokens. With MTP speculation
    a busy rank's step runs the main model once and the MTP layer `mtp_passes` times (the verify pass's and every
    draft's), so `layers` is then the main model's layers and the MTP layer's follow that many times."""
    mtp = {id(m) for m in mtp_layers or ()}
    for layer in layers:
        if id(layer) not in mtp:
            layer.empty_step()
    for _ in range(mtp_passes):
        for layer in mtp_layers or ():
            layer.empty_step()


@torch.inference_mode()
def expert_tokens(layers: list[StackedExperts]) -> np.ndarray:
    """int64 [layers, experts]: tokens this rank routed to each expert since start, per MoE layer (under TP x EP
    every tensor-parallel rank routes every token of its data-parallel rank: TP rank 0's counts are all)."""
    return torch.stack([layer.expert_tokens for layer in layers]).cpu().numpy()


def placement_detail(layers: list[StackedExperts]) -> dict[str, str]:
    """This rank's experts for the ready handshake (every layer has the same contiguous placement); none
    without expert parallelism."""
    if not layers:
        return {}
    p = layers[0].placement
    assert p is not None
    return {"ep": f"{p.ep_rank}/{p.ep_size}",
            "experts": f"{p.first_local_expert}-{p.first_local_expert + p.num_local_experts - 1}/{p.num_experts}"}
