"""Host -> device copies that never make the host wait for the device.

A copy from pageable host memory makes the CUDA driver synchronise; one from pinned memory is only
queued. torch's pinned-host allocator keeps each block until the copy that reads it has run, so the
host array may be reused at once. Used by every per-step upload (the runner's inputs, the sampler's
options, flashinfer's plans, the CUDA graphs' static inputs).
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned host copy of `array` (for APIs that take host tensors and copy them to the device)."""
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def staged(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as the host tensor of a copy to `device` that the host need not wait for: pinned for CUDA."""
    return pinned(array) if device.type == "cuda" else torch.from_numpy(np.ascontiguousarray(array))


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`; queued through pinned memory on CUDA, a plain copy elsewhere."""
    return staged(array, device).to(device, non_blocking=device.type == "cuda")
