"""FlashInfer paged attention (CUDA): batch decode and batch prefill/append over flotilla's KV layout.

flotilla's per-layer cache `[num_blocks, 2, block_size, num_kv_heads, head_dim]` is exactly FlashInfer's
"NHD" paged layout, so the cache is handed over as is. FlashInfer plans a step once on the host (page
table in CSR form: indptr / indices / last_page_len) and every layer reuses the plan; the plan is made
at the first layer of a step (the metadata object changes per step) from the metadata's host copies,
so planning never waits on the device. Pure-decode steps use the decode kernel; any step with a longer query
(prefill chunks, mixed batches) uses the causal prefill kernel.

Decode runs FlashInfer's tensor-core kernel (its prefill kernel, the query heads of a KV group as rows of one tile)
for every group size, as vLLM does: the CUDA-core decode kernel reads the KV cache more slowly at GQA groups of 4
and more, and its outputs differ from the tensor-core kernel's (flashinfer issue #703), so a model's greedy tokens
would depend on its head counts.

An FP8 (e4m3) cache is planned with kv_data_type float8_e4m3fn (the query stays in the model's dtype) and run
with k_scale / v_scale, which FlashInfer folds into the softmax scale and the output; the store quantizes
(kernels/attention/fp8_kv.py) and writes the bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from flotilla import envs
from flotilla.kernels.attention.fp8_kv import is_fp8, quantize_kv
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.staging import pinned

WORKSPACE_BYTES = 256 * 2**20
"""FlashInfer's scratch space per device (split-k partial results, plan info), at least: a CUDA-graph decode of
many sequences needs more (decode_workspace_bytes), which reserve_workspace makes room for."""


def decode_workspace_bytes(max_batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The scratch FlashInfer's tensor-core decode asks of the workspace when planned for CUDA graphs at `max_batch`
    sequences: it plans as a prefill (scheduler.cuh's PrefillPlan) whose split-KV partial outputs and their
    log-sum-exps take num_qo_heads x padded_batch x cta_tile_q rows of head_dim + 1 floats, padded_batch being the
    query tiles a graph may need (one per sequence, the group's rows packed) or, if more, the CTAs of two per SM
    per KV head. It grows with the batch (335 MB at 1,024 sequences of Qwen3-8B's heads, past WORKSPACE_BYTES)."""
    group = num_qo_heads // num_kv_heads
    cta_tile_q = 128 if group > 64 and head_dim < 256 else 64 if group > 16 else 16  # (FA2DetermineCtaTileQ, sm80+)
    tiles = -(-max_batch * group // cta_tile_q) + max_batch - 1
    padded_batch = max(2 * num_sms // num_kv_heads, tiles)
    return num_qo_heads * padded_batch * cta_tile_q * (head_dim + 1) * 4 + 2 * 16  # (+ the two allocations' alignment)


def importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class FlashInferAttention:
    """One instance per process; wrappers and workspace per device, one plan per step."""

    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer  # optional dependency: only imported when this backend is chosen

        self._fi = flashinfer
        self._wrappers: dict[torch.device, tuple[object, object]] = {}
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._planned: AttentionMetadata | None = None
        self._active: object | None = None
        self._plan_copied: torch.cuda.Event | None = None

    def reserve_workspace(self, device: torch.device, nbytes: int) -> None:
        """Make the device's workspace at least `nbytes` (never below WORKSPACE_BYTES). Call it before the first
        step (the memory profile then counts it) and before graph wrappers are made: those keep the buffer they were
        made with; the per-step wrappers are made again over the new one."""
        current = self._workspaces.get(device)
        if current is not None and current.numel() >= nbytes:
            return
        with torch.inference_mode(False):  # (see _wrappers_for)
            self._workspaces[device] = torch.empty(max(WORKSPACE_BYTES, nbytes), dtype=torch.uint8, device=device)
        self._wrappers.pop(device, None)

    def _wrappers_for(self, device: torch.device) -> tuple[object, object]:
        """(decode wrapper, prefill wrapper) of a device. Their buffers are made as normal tensors even under
        inference mode: the process shares them, and a plan writes into them in place, which torch refuses for an
        inference tensor outside inference mode (a caller without it after one with it)."""
        if device not in self._wrappers:
            with torch.inference_mode(False):
                if device not in self._workspaces:
                    self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                workspace = self._workspaces[device]
                decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
                prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._wrappers[device] = (decode, prefill)
        return self._wrappers[device]

    def _plan(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        host = meta.host
        if host is None:
            raise ValueError("the flashinfer backend needs AttentionMetadata built with host copies (from_lists)")
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        kv_indptr, kv_indices, last_page_len = host.paged_kv(block_size)
        decode, prefill = self._wrappers_for(query.device)
        common = dict(num_qo_heads=query.shape[1], num_kv_heads=num_kv_heads, page_size=block_size,
                      q_data_type=query.dtype, kv_data_type=kv_cache.dtype, sm_scale=scale)
        indptr, indices, last = (pinned(a) for a in (kv_indptr, kv_indices, last_page_len))
        self._before_plan()
        if meta.max_query_len == 1:
            decode.plan(indptr, indices, last, head_dim=query.shape[2], **common)
            self._active = decode
        else:
            qo_indptr = torch.from_numpy(host.query_start_loc.astype(np.int32))
            prefill.plan(qo_indptr, indptr, indices, last, head_dim_qk=query.shape[2], causal=True, **common)
            self._active = prefill
        self._after_plan(meta)

    # A plan fills a pinned host buffer of the wrapper and queues its copy to the device. With steps
    # launched ahead of the device (the overlapped step loop) the next plan could overwrite that buffer
    # before the copy ran: wait until the previous plan's copy has run (the device has started the
    # previous step, so this almost never waits).

    def _before_plan(self) -> None:
        if self._plan_copied is not None:
            self._plan_copied.synchronize()

    def _after_plan(self, meta: AttentionMetadata) -> None:
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        self._planned = meta

    # ---- CUDA graphs: a fixed-batch decode wrapper per captured size, planned outside the graph ------------

    def graph_decode_wrapper(self, device: torch.device, indptr: torch.Tensor, indices: torch.Tensor,
                             last_page_len: torch.Tensor) -> object:
        """A decode wrapper whose page-table buffers are fixed (len(last_page_len) = its batch size), so a
        captured graph reads whatever the next plan() writes into them."""
        self._wrappers_for(device)
        workspace = self._workspaces[device]
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)

    def plan_graph(self, wrapper: object, meta: AttentionMetadata, indptr: np.ndarray, indices: torch.Tensor,
                   last_page_len: np.ndarray, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype, scale: float, kv_dtype: torch.dtype | None = None) -> None:
        """Plan a graph wrapper for the next replay and make `meta`'s layers use it; dtype is the query's,
        kv_dtype the cache's (default: the same). `indices` must already be on the device, in the wrapper's own
        indices buffer: FlashInfer copies host indices with a blocking copy (it waits for the device), and a
        copy of its buffer onto itself is a no-op."""
        if indices.device.type != "cuda":
            raise ValueError("plan_graph takes the page indices already on the device (the wrapper's buffer)")
        self._before_plan()
        fast = envs.FLOTILLA_FLASHINFER_FAST_PLAN and fast_plan_graph(wrapper, indptr, last_page_len, page_size,
                                                                       num_qo_heads, num_kv_heads, head_dim)
        if not fast:
            wrapper.plan(pinned(indptr), indices, pinned(last_page_len),
                         num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                         q_data_type=dtype, kv_data_type=kv_dtype or dtype, sm_scale=scale)
        self._active = wrapper
        self._after_plan(meta)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, Hq, D] attention of every new token over its sequence's paged context (causal), into `out` when
        given (contiguous); k_scale and v_scale dequantize an FP8 cache."""
        if self._planned is not meta:
            self._plan(query, kv_cache, meta, scale)
        if is_fp8(kv_cache.dtype):
            return self._active.run(query, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out)
        return self._active.run(query, kv_cache, out=out)

    @staticmethod
    def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write the new tokens' K/V to their slots with one indexed copy each (no host sync; no -1 slots);
        an FP8 cache gets key / k_scale and value / v_scale, copied as bytes (index_copy_ has no e4m3 kernel)."""
        num_blocks, _, block_size = kv_cache.shape[:3]
        flat = kv_cache.view(num_blocks * 2 * block_size, *kv_cache.shape[3:])
        k_rows = (slot_mapping // block_size) * (2 * block_size) + slot_mapping % block_size
        key, value = quantize_kv(key, k_scale, kv_cache.dtype), quantize_kv(value, v_scale, kv_cache.dtype)
        if is_fp8(kv_cache.dtype):
            flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
        flat.index_copy_(0, k_rows, key)
        flat.index_copy_(0, k_rows + block_size, value)


def fast_plan_graph(wrapper: object, indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                    num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Re-plan a CUDA-graph tensor-core decode wrapper that plan() has planned once (at capture), doing only what
    changes between replays: the page-table copies and FlashInfer's C++ scheduler. plan() also recomputes the
    sequence lengths and their maximum with per-element tensor iteration, resolves dtypes and modules, and copies
    the indices buffer onto itself, host work that is a large part of a big batch's decode launch. vLLM
    (fast_plan_decode) and SGLang (fast_decode_plan) do the same. Written against flashinfer 0.6 (decode.py's
    plan, tensor-core branch, fa2 backend); returns False, and the caller takes plan(), for anything else: another
    version, the CUDA-core kernel, the fa3 backend FlashInfer may pick for an FP8 cache, a wrapper not planned
    yet. tests/test_kernels_flashinfer.py checks both give the same plan."""
    module = getattr(wrapper, "_cached_module", None)
    if (module is None or not getattr(wrapper, "use_tensor_cores", False) or not wrapper.is_cuda_graph_enabled
            or getattr(wrapper, "_backend", None) != "fa2" or not _FLASHINFER_0_6):
        return False
    from flashinfer.utils import _get_range_buf

    batch = len(last_page_len)
    host = pinned(np.concatenate((indptr.astype(np.int32), last_page_len.astype(np.int32))))
    indptr_host, last_host = host[:batch + 1], host[batch + 1:]
    wrapper._paged_kv_indptr_buf.copy_(indptr_host, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf.copy_(last_host, non_blocking=True)
    pages = np.diff(indptr)
    kv_lens = torch.from_numpy((np.maximum(pages - 1, 0) * page_size + last_page_len).astype(np.int32))
    args = [wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            _get_range_buf(batch + 1, "cpu"), indptr_host, kv_lens, batch, batch, num_qo_heads, num_kv_heads,
            page_size, True, head_dim, head_dim, False, -1]
    args += [-1, False, 0]  # fa2's fixed_split_size, disable_split_kv, num_colocated_ctas
    wrapper._plan_info = module.plan(*args)
    wrapper._max_kv_len = int(kv_lens.max())
    return True


def _flashinfer_version() -> str:
    try:
        from importlib.metadata import version
        return version("flashinfer-python")
    except Exception:
        return ""


_FLASHINFER_0_6 = _flashinfer_version().startswith("0.6.")

_SHARED: FlashInferAttention | None = None


def shared() -> FlashInferAttention:
    """The process's one instance (its plan is per step, shared by every layer and by the CUDA graphs)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = FlashInferAttention()
    return _SHARED
