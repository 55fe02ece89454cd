"""Programmatic dependent launch (PDL) for the small kernels of a batch-1 decode step: on by default on Hopper and
later (FLOTILLA_PDL=0 turns it off).

A batch-1 decode step of Qwen3-30B-A3B is ~530 launches of a few microseconds each inside one CUDA graph; on an H200
the device sat idle 0.29 ms of its 3.39 ms between them (profile_step's gaps, docs/performance.md, seventeenth
session), and every kernel also pays its ramp before its first load. With PDL (Hopper and later) a kernel may be
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

Measured on an H200 (docs/performance.md, eighteenth session): Qwen3-30B-A3B's batch-1 decode 292.8 -> 329.8 tok/s
(three runs each, the same call), its nano workload's decode steps unchanged; DeepSeek-V3-4L's batch 1 unchanged
(703.6 against 704.2: its MLA and FP8 kernels do not take part). CUDA graphs keep the launches' programmatic edges
(CUDA 12.3+). On the CPU (triton's interpreter, which has no griddepcontrol) the flag is never on.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL = os.environ.get("FLOTILLA_PDL", "1") != "0"
"""Whether the batch-1 kernels launch with PDL (unless FLOTILLA_PDL=0 at import; the device must be sm_90 or later)."""


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


METADATA_BEFORE_WAIT = tl.constexpr(os.environ.get("FLOTILLA_PDL_METADATA", "1") != "0")
"""Whether the kernels that read the step's metadata (kernels/triton/attention.py's decode and merge, the q/k norm +
RoPE + store) read it before their wait (FLOTILLA_PDL_METADATA=0 at import: after it, as before 2026-12-02; for A/B
runs). On an H200 (nineteenth session) Qwen3-30B-A3B's batch-1 decode: 353.4 tok/s after the wait against 356.7 and
358.1 before it (four runs each, interleaved in one call); 346.1 against 351.6 in the call before (three runs)."""


@triton.jit
def wait_before_metadata(USE_GDC: tl.constexpr):
    """A kernel's wait where it reads the step's metadata after it (FLOTILLA_PDL_METADATA=0)."""
    if USE_GDC and not METADATA_BEFORE_WAIT:
        tl.extra.cuda.gdc_wait()


@triton.jit
def wait_after_metadata(USE_GDC: tl.constexpr):
    """A kernel's wait where it reads the step's metadata before it (the default): call both, metadata between."""
    if USE_GDC and METADATA_BEFORE_WAIT:
        tl.extra.cuda.gdc_wait()
