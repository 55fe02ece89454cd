"""CUDA graphs for one sequence's prompt chunk: a prefill of up to 512 tokens replayed instead of launched.

Eager, a short prefill is bound by the host: the device idles between launches that cost tens of microseconds of
host time each (the FP8 linears' quantization and GEMM, the MoE's routing and grouping), so the prefill takes
several times its device work; for a server at low load that is the time to first token. vLLM covers
prefill with piecewise graphs (attention outside them); here the whole forward is captured, for the attention
backends that read only device metadata at any query length (the MLA kernels: triton's prefill kernel, which
FlashMLA's backend also sends multi-token queries to; actors/spec_graphs.py's verify pass captures it the same way).

A chunk of n tokens of one sequence with `cached` tokens before it replays the graph of the smallest bucket of
`size` >= n tokens (PREFILL_GRAPH_TOKENS). The padding rows continue the sequence: positions cached + n .. cached +
size - 1, token 0, their KV written where the sequence's table puts those positions (the rest of its last block,
which later tokens overwrite before anything reads it, and the scratch block past its blocks), so that the causal
attention of the real rows reads only keys written before or by this pass. The graph returns the hidden states of
all `size` rows; the runner takes the real ones' logits eagerly, as after an eager forward.

WorkerConfig.prefill_cuda_graphs chooses the backends: the MLA ones by default ("auto"), the GQA triton and
flashinfer_triton ones too with "all", none with "off".
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from flotilla.actors.graph_inputs import StaticGraph, StaticInputs
from flotilla.kernels.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
"""The buckets a chunk is padded to (each costs a capture at start and its activations in the graphs' pool)."""

PREFILL_GRAPH_BACKENDS = ("mla_triton", "mla_flash_mla")
"""Attention backends whose prefill reads only device metadata (a model's attention_backend_name), with graphs by
default."""

PREFILL_GRAPH_BACKENDS_OPT_IN = ("triton", "flashinfer_triton")
"""The GQA backends whose prefill a graph can capture: triton's prefill kernel reads only device metadata, and
flashinfer_triton sends a chunk without host metadata (a graph's) to it instead of FlashInfer, which plans on the
host. Opt-in, with prefill_cuda_graphs "all"."""


def prefill_graph_backends(mode: str) -> tuple[str, ...]:
    """The attention backends that get prefill graphs under WorkerConfig.prefill_cuda_graphs `mode`: none with "off",
    the MLA ones with "auto", the GQA ones too with "all" (enforce_eager turns every graph off)."""
    if mode == "off":
        return ()
    return PREFILL_GRAPH_BACKENDS + (PREFILL_GRAPH_BACKENDS_OPT_IN if mode == "all" else ())


class PrefillGraphs:
    """Captured forwards of one sequence's chunk, one per bucket up to `max_tokens`."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_model_len: int, max_tokens: int, device: torch.device) -> None:  # fmt: skip
        """max_tokens: the largest chunk to capture (the step's token budget; buckets above it or above max_model_len
        are left out; ValueError when none is left)."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.scratch_block, self.max_model_len, self.device = scratch_block, max_model_len, device
        self.sizes = [s for s in PREFILL_GRAPH_TOKENS if s <= min(max_tokens, max_model_len)]
        if not self.sizes:
            raise ValueError(f"no prefill graph of {PREFILL_GRAPH_TOKENS[0]} or more tokens fits a step budget of "
                             f"{max_tokens} and max_model_len {max_model_len}")
        self.max_blocks = -(-max_model_len // block_size)
        self.inputs = StaticInputs(self.sizes[-1], 1, self.max_blocks, scratch_block, scratch_block * block_size,
                                   device)  # fmt: skip
        self.graphs: dict[int, StaticGraph] = {}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        t0 = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            qsl = torch.tensor([0, size], dtype=torch.int32, device=device)
            meta = AttentionMetadata(query_start_loc=qsl, seq_lens=self.inputs.seq_lens[:1],
                                     block_tables=self.inputs.block_tables[:1], slot_mapping=self.inputs.slots[:size],
                                     max_query_len=size, max_seq_len=self.max_blocks * block_size,
                                     block_size=block_size)  # fmt: skip
            self._stage(np.zeros(size, dtype=np.int64), 0, np.zeros(0, dtype=np.int32), size)  # valid warm-up inputs

            def forward(size: int = size, meta: AttentionMetadata = meta) -> torch.Tensor:
                return model(self.inputs.ids[:size], self.inputs.positions[:size], kv_caches, meta)

            self.graphs[size] = StaticGraph(forward, device, pool, meta.backend_state.clear)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            log.info("captured CUDA graphs of prefill chunks of one sequence for %s tokens in %.1f s", self.sizes,
                     time.perf_counter() - t0)

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size a chunk of `num_tokens` pads to; None past the largest."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def fits(self, cached: int, num_tokens: int) -> bool:
        """Whether a chunk of `num_tokens` after `cached` tokens has a graph whose padding stays within
        max_model_len (the positions the rotary tables and block tables cover)."""
        size = self.bucket(num_tokens)
        return num_tokens > 0 and size is not None and cached + size <= self.max_model_len

    def run(self, ids: np.ndarray, cached: int, block_ids: np.ndarray) -> torch.Tensor:
        """The forward of one sequence's chunk (ids int64 [n], after `cached` tokens; block_ids: its KV blocks, as
        many as cached + n tokens need): hidden states [n, H] (valid until the next replay)."""
        n = len(ids)
        size = self.bucket(n)
        if size is None or not self.fits(cached, n):
            raise ValueError(f"no prefill graph for {n} tokens after {cached}")
        padded = np.zeros(size, dtype=np.int64)
        padded[:n] = ids
        self._stage(padded, cached, block_ids, size)
        return self.graphs[size].replay()[:n]

    def _stage(self, ids: np.ndarray, cached: int, block_ids: np.ndarray, size: int) -> None:
        """Write the inputs of a `size`-row chunk: positions and slots continue past the real rows, on the
        sequence's blocks and then the scratch block."""
        bs = self.block_size
        pages = -(-(cached + size) // bs)
        table = np.full((1, pages), self.scratch_block, dtype=np.int32)
        real = min(len(block_ids), pages)
        table[0, :real] = block_ids[:real]
        positions = np.arange(cached, cached + size, dtype=np.int64)
        slots = table[0, positions // bs].astype(np.int64) * bs + positions % bs
        self.inputs.write(ids, positions, slots, np.array([cached + size], dtype=np.int32), table)
