"""StaticInputs: the device tensors a captured step reads, in one buffer that one copy per step fills; StaticGraph:
a function over such buffers captured as a CUDA graph (on a CPU, rerun eagerly).

A CUDA graph reads its inputs from fixed device tensors: the token ids, positions and KV slots of its rows, and for
the attention kernels that read device metadata (actors/cuda_graphs.py STATIC_TABLE_BACKENDS) each sequence's
context length and block table. Filled one by one they take eight small copies per step (an upload, three device
copies out of it, seq_lens, the block table and its device-side scatter into the table's columns, the result), and
at batch 1 the device idles around them. Here they are views of one int64 buffer laid out so that a step's part of
it is one contiguous prefix:

    ids [rows] | positions [rows] | slots [rows] | (state slots [rows]) | seq_lens int32 [seqs] |
    block tables int32 [seqs, max_blocks]

and `write` builds that prefix on the host (each section padded as the graph's padding rows need) and queues it
with one copy from pinned memory: the block tables' rows [:size] whole, scratch-filled past each table. Where those
rows would be large (long max_model_len at a large batch) the table keeps its own copy of only the columns in use.
A hybrid model's rows also carry their recurrent-state slots (-1 on padding rows, which the delta-net kernels skip).
Every section starts on a 64-byte boundary, so the kernels see the alignment they would with tensors of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from flotilla.kernels.staging import staged

ALIGN = 8
"""Section starts, in int64 elements (64 bytes)."""

WHOLE_TABLE_BYTES = 256 * 1024
"""The most block-table bytes a step copies with its inputs in one go (rows [:size] at full width); beyond it the
table is copied on its own, only the columns its sequences use."""


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StaticInputs:
    """Views of one device buffer: `ids`, `positions`, `slots` (int64 [rows]), with `state_slots` also
    `state_slots` (int64 [rows]), and with `max_seqs`, `seq_lens` (int32 [max_seqs]) and `block_tables` (int32
    [max_seqs, max_blocks])."""

    def __init__(self, rows: int, max_seqs: int, max_blocks: int, scratch_block: int, scratch_slot: int,
                 device: torch.device, state_slots: bool = False) -> None:  # fmt: skip
        """max_seqs 0: token inputs only (a backend planned on the host keeps its own tables)."""
        self.rows, self.max_seqs, self.max_blocks = rows, max_seqs, max_blocks
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.token_sections = 4 if state_slots else 3
        self.lens_at = self.token_sections * _up(rows)  # int64 offsets of the sections
        self.tables_at = self.lens_at + _up(-(-max_seqs // 2))
        self.size = self.tables_at + _up(-(-max_seqs * max_blocks // 2))
        self.buffer = torch.zeros(self.size, dtype=torch.int64, device=device)
        r = _up(rows)
        self.ids, self.positions, self.slots = (self.buffer[i * r:i * r + rows] for i in range(3))
        self.slots.fill_(scratch_slot)
        self.state_slots = self.buffer[3 * r:3 * r + rows] if state_slots else None
        if self.state_slots is not None:
            self.state_slots.fill_(-1)
        as32 = self.buffer.view(torch.int32)
        self.seq_lens = as32[2 * self.lens_at:2 * self.lens_at + max_seqs]
        self.seq_lens.fill_(1)
        self.block_tables = as32[2 * self.tables_at:2 * self.tables_at + max_seqs * max_blocks].view(max_seqs,
                                                                                                    max_blocks)
        self.block_tables.fill_(scratch_block)

    def write(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray | None = None,
              table: np.ndarray | None = None, state_slots: np.ndarray | None = None) -> None:
        """Queue a step's inputs: ids / positions / slots (and state slots) of its first len(ids) rows (every later
        row is padding: token 0 at position 0 on the scratch slot, state slot -1); with seq_lens [size] and table
        [size, w] (static_tables', padding sequences included), the attention tables of its `size` sequences (later
        ones: length 1; columns past w: the scratch block)."""
        r, n = _up(self.rows), len(ids)
        assert (state_slots is not None) == (self.state_slots is not None), "state slots: all the rows' or none"
        end, whole, size = self.token_sections * r, False, 0
        if seq_lens is not None:
            assert table is not None and self.max_seqs, "this buffer holds no attention tables"
            size = len(seq_lens)
            whole = size * self.max_blocks * 4 <= WHOLE_TABLE_BYTES
            end = self.tables_at + (-(-size * self.max_blocks // 2) if whole else 0)
        host = np.empty(end, dtype=np.int64)
        sections = ((ids, 0), (positions, 0), (slots, self.scratch_slot), (state_slots, -1))
        for i, (values, pad) in enumerate(sections[:self.token_sections]):
            host[i * r:i * r + n] = values
            host[i * r + n:(i + 1) * r] = pad
        if seq_lens is not None:
            as32 = host.view(np.int32)
            as32[2 * self.lens_at:2 * self.lens_at + size] = seq_lens
            as32[2 * self.lens_at + size:2 * self.tables_at] = 1
            if whole:
                rows = as32[2 * self.tables_at:2 * self.tables_at + size * self.max_blocks]
                rows = rows.reshape(size, self.max_blocks)
                rows[:, table.shape[1]:] = self.scratch_block
                rows[:, :table.shape[1]] = table
        self.buffer[:end].copy_(staged(host, self.buffer.device), non_blocking=True)
        if table is not None and not whole:
            self.block_tables[:size, :table.shape[1]].copy_(staged(table, self.buffer.device), non_blocking=True)


class StaticGraph:
    """fn() captured once (CUDA) and replayed, or on a CPU device rerun eagerly on every replay (which lets tests check
    every buffer and table a graph reads without a GPU)."""

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device, pool: object,
                 before_capture: Callable[[], None]) -> None:  # fmt: skip
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if device.type != "cuda":
            return
        fn()  # warm-up: lazy initialisation (triton compiles, workspaces) must not happen inside the capture
        torch.cuda.synchronize(device)
        before_capture()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        assert self.out is not None
        return self.out
