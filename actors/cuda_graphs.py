"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, then replayed.

A decode step of a small model is bound by the host, not the GPU: eager PyTorch launches ~50 kernels
per layer, each costing ~10-20 us of Python and driver time, far more than the GPU needs for one token.
A graph replays all of them with one launch. Batches are padded up to the next captured size; padded
rows read and write a scratch KV block that the scheduler never hands out, and their outputs are dropped.

What is captured is `model(input_ids, positions, kv_caches, meta)` over static input buffers, then the logits of
every row (into one float32 buffer that all sizes share) and their argmax: a greedy step samples nothing outside the
graph. At batch 1 even a large model's step is bound by the host, so the LM head's launch and the argmax's two
launches belong inside the graph too. Sampling other than greedy runs on the logits after the replay. How attention gets its batch depends on the backend:

- flashinfer: planned on the host before each replay into fixed page-table buffers the graph reads (also
  flashinfer_triton's sizes above its split, kernels/attention.FLASHINFER_DECODE_ABOVE).
- the triton kernels (GQA "triton", MLA "mla_triton") and FlashMLA ("mla_flash_mla"): they read only device
  metadata, so the graph captures them over static seq_lens / block_tables / query_start_loc buffers that each
  replay refills. The triton decode kernels take a number of context splits fixed at capture (sized for
  max_model_len), which is correct for any context length (kernels/triton/attention.py); FlashMLA's scheduler
  metadata is computed inside the captured first layer (kernels/mla/flash_mla_backend.py).

A hybrid model's delta-net layers read each row's recurrent-state slot from a static buffer too; padding rows have
slot -1, which the decode kernels skip (their outputs are zeros).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from flotilla.actors.graph_inputs import StaticInputs
from flotilla.kernels.attention import decodes_with_flashinfer, flashinfer_backend
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.sampling import greedy_argmax
from flotilla.kernels.staging import pinned
from flotilla.models.parallel import ep_step
from flotilla.transport.messages import StepPlan

log = logging.getLogger(__name__)

STATIC_TABLE_BACKENDS = ("triton", "flashinfer_triton", "mla_triton", "mla_flash_mla", "v4_triton")
"""Attention backends (a model's attention_backend_name) whose decode reads only device metadata, so a graph
captures them over static tables; flashinfer is planned on the host instead."""


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond (the padding waste stays small)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    out = [s for s in sizes if s < max_batch]
    return out + [max_batch]


def decodes_only(plan: StepPlan) -> bool:
    """Whether the step gives each of its sequences one new token whose next one it samples (a decode batch a graph
    can run; a prompt's one-token chunk short of its end is not one)."""
    return bool(plan.rids) and plan.every_row_samples and len(plan.rids) == int(plan.num_new_tokens.sum())


def page_tables(size: int, seq_lens: np.ndarray, tables: list[np.ndarray], block_size: int,
                scratch_block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's page tables (indptr, indices, last page lengths) for `size` rows: the real sequences first
    (tables[b] holds at least the pages of seq_lens[b]), then padding rows, one page each, on the scratch block."""
    bs = block_size
    pages = np.ones(size, dtype=np.int64)
    last = np.ones(size, dtype=np.int32)
    n = len(seq_lens)
    pages[:n] = -(-seq_lens // bs)
    last[:n] = seq_lens - (pages[:n] - 1) * bs
    indptr = np.zeros(size + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = np.full(int(indptr[-1]), scratch_block, dtype=np.int32)
    if n:  # one concatenate of views, not a slice assignment per sequence
        real = int(indptr[n])
        indices[:real] = np.concatenate([t[:p] for t, p in zip(tables, pages[:n].tolist())])
    return indptr, indices, last


def static_tables(size: int, seq_lens: np.ndarray, tables: list[np.ndarray], block_size: int,
                  scratch_block: int) -> tuple[np.ndarray, np.ndarray]:
    """(seq_lens [size], block tables [size, pages of the longest sequence]) for the static-table kernels: the
    real sequences first, then padding rows of one token on the scratch block (page_tables' pages, as rows)."""
    indptr, indices, _ = page_tables(size, seq_lens, tables, block_size, scratch_block)
    pages = np.diff(indptr)
    lens = np.ones(size, dtype=np.int32)
    lens[:len(seq_lens)] = seq_lens
    table = np.full((size, int(pages.max())), scratch_block, dtype=np.int32)
    rows = np.repeat(np.arange(size), pages)
    table[rows, np.arange(len(indices)) - indptr[rows]] = indices
    return lens, table


def first_attention(model: torch.nn.Module) -> torch.nn.Module:
    """The first layer's paged attention (a hybrid model's other layers have none)."""
    return next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))


def attention_heads(model: torch.nn.Module) -> dict[str, int]:
    """This rank's query and KV heads (all of them with one rank) and head_dim."""
    attn = first_attention(model)
    return dict(num_qo_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=model.config.head_dim)


def reserve_flashinfer_workspace(model: torch.nn.Module, max_batch: int, device: torch.device) -> None:
    """FlashInfer's workspace made large enough for the decode graphs of up to `max_batch` sequences it will plan
    (their split-KV scratch grows with the batch); called before the memory profile, so that it is counted there."""
    name = model.attention_backend_name
    if name != "flashinfer" and not (name == "flashinfer_triton" and decodes_with_flashinfer(max_batch)):
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    nbytes = flashinfer_backend.decode_workspace_bytes(max_batch, **attention_heads(model), num_sms=sms)
    flashinfer_backend.shared().reserve_workspace(device, nbytes)


class DecodeGraphs:
    """Captured decode forwards, one per batch size of the ladder."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_batch: int, max_blocks_per_seq: int, device: torch.device, state_slots: bool = False) -> None:
        """state_slots: the model keeps recurrent state per sequence (a hybrid model), whose slots each step gives."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = device
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch)
        gmax = self.sizes[-1]
        self.static_tables = model.attention_backend_name in STATIC_TABLE_BACKENDS
        """Attention reads static device tables (the triton kernels), not flashinfer's planned buffers; with
        flashinfer_triton only up to its split (planned_sizes: the sizes FlashInfer decodes)."""
        self.planned_sizes = {size for size in self.sizes if not self.static_tables or (
            model.attention_backend_name == "flashinfer_triton" and decodes_with_flashinfer(size))}
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = StaticInputs(gmax, gmax if self.static_tables else 0, max_blocks_per_seq if self.static_tables
                                   else 0, scratch_block, self.scratch_slot, device, state_slots)  # fmt: skip
        """The graphs' inputs (and the static-table backends' seq_lens and block tables): one copy per step."""
        self.input_ids, self.positions, self.slots = self.inputs.ids, self.inputs.positions, self.inputs.slots
        if self.static_tables:
            self.query_start_loc = torch.arange(gmax + 1, dtype=torch.int32, device=device)
            self.seq_lens, self.block_tables = self.inputs.seq_lens, self.inputs.block_tables
        if self.planned_sizes:
            self.attn = flashinfer_backend.shared()
            self.heads = dict(**attention_heads(model), page_size=block_size,
                              dtype=first_attention(model).o_proj.weight.dtype,
                              kv_dtype=kv_caches[0].dtype, scale=model.config.head_dim ** -0.5)
        if self.planned_sizes:  # flashinfer's page tables, which plan() fills
            i32 = dict(dtype=torch.int32, device=device)
            self.kv_indptr = torch.zeros(gmax + 1, **i32)
            self.kv_indices = torch.zeros(gmax * max_blocks_per_seq, **i32)
            self.kv_last = torch.zeros(gmax, **i32)
        self.wrappers: dict[int, object] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """Per size: the final hidden states [size, hidden] the logits are computed from (held, so no later capture
        in the shared pool takes their memory)."""
        self.logits: torch.Tensor | None = None
        """The last replay's logits [size, vocab] (shared by every size: a replay overwrites them; allocated by the
        first warm-up, at the model's logits width)."""
        self.greedy: dict[int, torch.Tensor] = {}
        """Per size: the argmax of each row's logits, int64 [size]."""
        t0 = time.perf_counter()
        self._capture_all()
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes, time.perf_counter() - t0)

    def _meta(self, size: int) -> AttentionMetadata:
        state = None if self.inputs.state_slots is None else self.inputs.state_slots[:size]
        if size not in self.planned_sizes:  # the kernels read these buffers; max_seq_len sizes their fixed splits
            return AttentionMetadata(query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
                                     block_tables=self.block_tables[:size], slot_mapping=self.slots[:size],
                                     max_query_len=1, max_seq_len=self.max_blocks_per_seq * self.block_size,
                                     block_size=self.block_size, state_slots=state)  # fmt: skip
        # Only slot_mapping and the python ints matter inside the graph; flashinfer reads its own buffers.
        ones = torch.ones(size, dtype=torch.int32, device=self.device)
        return AttentionMetadata(query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.device),
                                 seq_lens=ones, block_tables=ones[:, None], slot_mapping=self.slots[:size],
                                 max_query_len=1, max_seq_len=1, block_size=self.block_size, state_slots=state)

    def page_tables(self, size: int, seq_lens: np.ndarray,
                    tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """page_tables() on this graph set's block size and scratch block."""
        return page_tables(size, seq_lens, tables, self.block_size, self.scratch_block)

    def static_tables_for(self, size: int, seq_lens: np.ndarray,
                          tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """static_tables() on this graph set's block size and scratch block."""
        return static_tables(size, seq_lens, tables, self.block_size, self.scratch_block)

    def _stage(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
               seq_lens: np.ndarray, tables: list[np.ndarray], patch: Callable[[torch.Tensor], None] | None,
               state_slots: np.ndarray | None = None) -> None:
        """Queue a step's inputs for the graph of `size`: ids, positions, slots and state slots (padding rows past
        them), patched ids, and the attention tables: with the inputs in one copy (static-table sizes) or planned
        (flashinfer)."""
        planned = size in self.planned_sizes
        seq_tables = (None, None) if planned else self.static_tables_for(size, seq_lens, tables)
        self.inputs.write(input_ids, positions, slots, *seq_tables, state_slots=state_slots)
        if patch is not None:
            patch(self.input_ids)
        if planned:
            self._plan(size, seq_lens, tables)

    def _plan(self, size: int, seq_lens: np.ndarray, tables: list[np.ndarray]) -> None:
        """FlashInfer's plan of a decode of `size` rows (its page tables into the graph's buffers)."""
        indptr, indices, last = self.page_tables(size, seq_lens, tables)
        # The page indices go straight into the buffer the graph reads, queued from pinned memory. Handing
        # FlashInfer's plan() host indices instead makes it copy them with non_blocking=False (flashinfer 0.6
        # decode.py), a copy that waits until the device has finished the step in flight: the host would then
        # never run ahead of the device, and every decode step would pay its whole launch time on top.
        on_device = self.kv_indices[:len(indices)]
        on_device.copy_(pinned(indices), non_blocking=True)
        self.attn.plan_graph(self.wrappers[size], self.metas[size], indptr, on_device, last, **self.heads)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            if size in self.planned_sizes:
                self.wrappers[size] = self.attn.graph_decode_wrapper(
                    self.device, self.kv_indptr[:size + 1], self.kv_indices, self.kv_last[:size])
            self.metas[size] = self._meta(size)
            none = np.zeros(0, dtype=np.int64)
            self._stage(size, none, none, none, none, [], None, None if self.inputs.state_slots is None else none)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self.metas[size])
            # under gathering expert parallelism every rank captures the same sizes in this order, so the MoE
            # layers' all-gathers and reduce-scatters of `size` rows pair up across the ranks inside the captures
            with ep_step(size):
                self._forward(size, args)  # warm-up: lazy initialisation (triton's compiles) must not be captured
                torch.cuda.synchronize(self.device)
                self.metas[size].backend_state.clear()  # per-step state (FlashMLA's scheduling) is in the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size], self.greedy[size] = self._forward(size, args)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def _forward(self, size: int, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph of `size` rows runs: (hidden states, argmax token ids); the logits go to self.logits."""
        hidden = self.model(*args)
        if self.logits is None:
            width = self.model.compute_logits(hidden[:1]).shape[1]
            self.logits = torch.empty(self.sizes[-1], width, dtype=torch.float32, device=self.device)
        return hidden, greedy_argmax(self.model.compute_logits(hidden, out=self.logits[:size]))

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def padded_size(self, batch: int) -> int:
        """The captured size a batch of `batch` sequences replays (fits(batch) must hold)."""
        return next(s for s in self.sizes if s >= batch)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            tables: list[np.ndarray], patch: Callable[[torch.Tensor], None] | None = None,
            size: int | None = None, state_slots: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of B sequences, by replay of the graph of `size` (default: the smallest that holds them;
        expert-parallel ranks that gather tokens replay the size they agreed on): its float32 logits [B, vocab] and
        their argmax int64 [B], views of the graph's buffers (the next replay overwrites them). state_slots [B]: a
        hybrid model's recurrent-state slot of each sequence.

        patch(input_ids) may then overwrite ids the host does not know yet (tokens still on the device).
        """
        batch = len(input_ids)
        size = size or self.padded_size(batch)
        if size not in self.graphs or size < batch:
            raise ValueError(f"no captured graph of {size} rows for a batch of {batch}")
        self._stage(size, input_ids, positions, slots, seq_lens, tables, patch, state_slots)
        self.graphs[size].replay()
        return self.logits[:batch], self.greedy[size][:batch]
