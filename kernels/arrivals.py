"""Arrival counters for kernels whose last program to finish a piece of work completes it (a "last arriver"
reduction): the K splits of the FP8 GEMM's output tiles (kernels/quant/fp8_triton.py), the top-k slots of a token
in the FP8 experts' down pass (kernels/moe/triton_experts.py). Each program adds 1 to its piece's counter with an
atomic of release and acquire semantics; the one that sees the count reach the total reads everyone's partials,
writes the result and sets the counter back to 0. So a second launch is saved, and the result is the same whatever
order the programs ran in (the last one sums in a fixed order).

The counters are one int32 buffer per device, zeros between kernels: the kernels that use them run one after
another on the device's one compute stream (the engine has one per device), and each leaves its counters at 0.
"""

from __future__ import annotations

import torch

MAX_ARRIVAL_COUNTERS = 1 << 16
"""Counters per device (256 KiB); a kernel that needs more does its reduction in a second launch."""
_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's MAX_ARRIVAL_COUNTERS zeros, made on first use outside a CUDA graph capture (None during a
    capture until then: the caller then reduces in a second launch, as it would without counters)."""
    counters = _counters.get(device)
    if counters is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counters = _counters[device] = torch.zeros(MAX_ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return counters
