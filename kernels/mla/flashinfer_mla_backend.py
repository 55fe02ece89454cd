"""MLA through FlashInfer's BatchMLAPagedAttentionWrapper (`--attention-backend flashinfer` on an MLA model).

FlashInfer's MLA kernels take the compressed cache as two page tensors, the latent [pages, page_size, 512] and the
roped key part [pages, page_size, 64]: the two column ranges of kernels/mla's [blocks, block_size, 576] rows, passed
as strided views, so nothing is copied. They serve decode, prefill chunks over a cached prefix and mixed steps alike
(causal, the new tokens being the last of each sequence); the store is triton_mla's. The wrapper is planned once per step from the step's host
metadata (no device sync), by the first layer that attends, and the other layers reuse the plan through the step's
AttentionMetadata.backend_state. One wrapper (and its 128 MiB workspace) per device.

Limits: a bf16 or fp16 cache (an FP8 one is refused: use the triton MLA backend), decode steps eager (no CUDA graph).
On CPU the page tables and views are checked against a stand-in with FlashInfer's contract.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import torch

from flotilla.kernels.attention.fp8_kv import is_fp8
from flotilla.kernels.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace per wrapper (its examples use 128 MiB)."""

_wrappers: dict[tuple[torch.device, int], object] = {}
"""One planned wrapper per (device, flashinfer module): the module is a stand-in in the CPU tests."""


def import_flashinfer() -> ModuleType | None:
    """flashinfer, when it imports and has the MLA wrapper; else None."""
    try:
        module = importlib.import_module("flashinfer")
    except (ImportError, OSError, RuntimeError):
        return None
    return module if hasattr(getattr(module, "mla", None), "BatchMLAPagedAttentionWrapper") else None


def flashinfer_mla_usable() -> bool:
    return torch.cuda.is_available() and import_flashinfer() is not None


def page_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's plan inputs from the step's host metadata, int32 CPU tensors (kv_indices pinned): qo_indptr
    [B+1], kv_indptr [B+1], kv_indices [pages in use], kv_len_arr [B]."""
    host = meta.host
    if host is None:
        raise ValueError("the flashinfer MLA backend plans from the step's host metadata, which this step lacks")
    kv_indptr, indices, _ = host.paged_kv(meta.block_size)
    kv_indices = torch.from_numpy(indices)
    if torch.cuda.is_available():
        kv_indices = kv_indices.pin_memory()  # its copy to the device then does not wait for the device
    return (torch.from_numpy(host.query_start_loc.astype(np.int32)), torch.from_numpy(kv_indptr), kv_indices,
            torch.from_numpy(host.seq_lens.astype(np.int32)))  # fmt: skip


def _wrapper(device: torch.device, flashinfer: ModuleType) -> object:
    key = (device, id(flashinfer))
    wrapper = _wrappers.get(key)
    if wrapper is None:
        with torch.inference_mode(False):  # shared by the process, planned in place from any mode
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            wrapper = _wrappers[key] = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    return wrapper


def paged_mla(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_scale: float = 1.0, *, flashinfer: ModuleType | None = None) -> torch.Tensor:
    """torch_ref.paged_mla's contract: q_latent [T, H, r], q_pe [T, H, rope] -> [T, H, r]. `flashinfer` stands in
    for the package (tests pass a torch stand-in on CPU)."""
    if is_fp8(kv_cache.dtype):
        raise ValueError("the flashinfer MLA backend reads a bf16 / fp16 cache, not FP8 (use the triton MLA backend)")
    kv_lora_rank = q_latent.shape[-1]
    if q_latent.shape[0] == 0:
        return torch.empty_like(q_latent)
    wrapper = meta.backend_state.get("flashinfer_mla")
    if wrapper is None:  # the step's first layer plans for all of them
        fi = flashinfer or import_flashinfer()
        if fi is None:
            raise RuntimeError("the flashinfer MLA backend needs the flashinfer package")
        wrapper = _wrapper(q_latent.device, fi)
        qo_indptr, kv_indptr, kv_indices, kv_lens = page_tables(meta)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, q_latent.shape[1], kv_lora_rank, q_pe.shape[-1],
                     meta.block_size, True, scale, q_latent.dtype, kv_cache.dtype)  # fmt: skip
        meta.backend_state["flashinfer_mla"] = wrapper
    return wrapper.run(q_latent, q_pe, kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:])

