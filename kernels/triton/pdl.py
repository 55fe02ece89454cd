"""Programmatic dependent launch (PDL) for the small kernels of a batch-1 decode step: on by default on Hopper and
later (FLOTILLA_PDL=0 turns it off).

A batch-1 decode step is hundreds of launches of a few microseconds each inside one CUDA graph: the device idles
between them, and every kernel also pays its ramp before its first load. With PDL (Hopper and later) a kernel may be
launched while the one before it is still running: it waits (griddepcontrol.wait) for that kernel's completion and
memory before touching anything it may have written, and may read what no kernel writes (weights) before that, as
CUTLASS's Hopper GEMM with weight prefetch and TensorRT-LLM's low-latency kernels do. The kernels here let their
successor launch as soon as they start (griddepcontrol.launch_dependents: the successor still waits for them to
finish before reading their output).

The rules every kernel launched with `launch_pdl` keeps (else it races): every program waits (`wait_prior`) before
its first load of anything another kernel of the step writes (activations, caches, counters, routing) and before its
first store (the caching allocator may hand it memory its predecessor still reads). Read before the wait are only
what no kernel of the chain writes: weights, constant tables (RoPE's cos/sin), and the step's metadata (positions,
KV slots, context lengths, block tables), which is in place before the chain's first kernel starts: the host copies
it (a graph's static inputs) or a kernel without PDL writes it, and a kernel that does not trigger its dependents
lets the next launch only once it has finished, so no kernel of the chain starts before then. A kernel that never
waits would let the next one overtake its predecessor, so the wait is unconditional.

CUDA graphs keep the launches' programmatic edges (CUDA 12.3+). On the CPU (triton's interpreter, which has no
griddepcontrol) the flag is never on.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flotilla import envs

PDL = envs.FLOTILLA_PDL
"""Whether the batch-1 kernels launch with PDL (the device must be sm_90 or later). Read once at import, since every
launch asks; tests patch this constant."""


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """A launch's PDL keywords: {"USE_GDC": the kernels' constexpr, "launch_pdl": the launch option}, both on only
    on a CUDA device of compute capability 9 or more, unless FLOTILLA_PDL=0."""
    on = PDL and device.type == "cuda" and _capable(device.index if device.index is not None else
                                                    torch.cuda.current_device())  # fmt: skip
    return {"USE_GDC": on, "launch_pdl": on}


@triton.jit
def launch_next(USE_GDC: tl.constexpr):
    """Let the next kernel in the stream launch now (it still waits for this one before reading its output)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior(USE_GDC: tl.constexpr):
    """Wait for the kernel before this one to finish and its memory to be visible (a no-op without PDL)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
