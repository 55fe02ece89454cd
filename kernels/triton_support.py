"""Whether flotilla's triton kernels can run in this process, asked by every kernel family's backend choice."""

from __future__ import annotations

import importlib.util

import torch

from flotilla import envs


def triton_usable() -> bool:
    """Triton is installed and can run here: a CUDA device, or triton's CPU interpreter (TRITON_INTERPRET=1, which
    must be set before the kernels' modules are first imported). Does not import triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or envs.TRITON_INTERPRET
