"""Collectives of the parallel groups, staged through host memory when the group's ranks share one GPU.

NCCL refuses two ranks on one device, so ranks that share a GPU (ParallelConfig.ranks_share_device) join their
groups over gloo, and gloo's own CUDA support covers only some collectives: `staged` copies CUDA tensors to the host,
runs the collective there and copies the results back. Slow, and never inside a CUDA graph; it exists so the
tensor- and expert-parallel code paths can run their GPU kernels on a machine with one GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_THROUGH_HOST = False


def stage_through_host(on: bool) -> None:
    """Whether this process's collectives move CUDA tensors through host memory (set when its groups are joined)."""
    global _THROUGH_HOST
    _THROUGH_HOST = on


def through_host() -> bool:
    return _THROUGH_HOST


def staged(collective: Callable[..., Any], *tensors: torch.Tensor) -> None:
    """collective(*tensors) (a torch.distributed call writing some of them in place); with ranks sharing a GPU, on
    host copies of the CUDA ones, each copied back after."""
    if not _THROUGH_HOST or not any(t.is_cuda for t in tensors):
        collective(*tensors)
        return
    host = [t.cpu() for t in tensors]
    collective(*host)
    for t, h in zip(tensors, host, strict=True):
        t.copy_(h)
