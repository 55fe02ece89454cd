"""AttentionMetadata: where every new token of one flattened mixed batch reads and writes paged KV.

A step packs B sequences into one flat token axis of T new tokens: prefill chunks and decodes in any
order. The GPU worker builds this once per step; every layer (and every attention backend) reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class HostMetadata:
    """Host (numpy) copies of the step's layout, built alongside the device tensors."""

    query_start_loc: np.ndarray
    """int64 [B+1]."""
    seq_lens: np.ndarray
    """int64 [B]."""
    block_tables: np.ndarray
    """int32 [B, max_blocks_per_seq]."""

    def paged_kv(self, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The paged cache in CSR form, as FlashInfer's plans take it (int32): kv_indptr [B+1], kv_indices (each
        sequence's pages in order, concatenated) and last_page_len [B]."""
        pages = -(-self.seq_lens // block_size)
        kv_indptr = np.zeros(len(pages) + 1, dtype=np.int32)
        np.cumsum(pages, out=kv_indptr[1:])
        used = np.arange(self.block_tables.shape[1])[None, :] < pages[:, None]
        kv_indices = self.block_tables[used].astype(np.int32)  # row-major: each sequence's pages in order
        last_page_len = (self.seq_lens - (pages - 1) * block_size).astype(np.int32)
        return kv_indptr, kv_indices, last_page_len


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of a flattened batch over a paged KV cache (all tensors on one device)."""

    query_start_loc: torch.Tensor
    """int32 [B+1]: cumulative new-token counts; sequence b owns flat tokens [qsl[b], qsl[b+1])."""
    seq_lens: torch.Tensor
    """int32 [B]: context length in tokens after this step (already-cached tokens + new tokens)."""
    block_tables: torch.Tensor
    """int32 [B, max_blocks_per_seq]: KV block ids per sequence in order; padded with block 0."""
    slot_mapping: torch.Tensor
    """int64 [T]: flat cache slot (block_id * block_size + offset) each new token's K/V goes to;
    -1 means the token is padding and is not stored."""
    max_query_len: int
    """Most new tokens of any one sequence in this step (python int: no device sync to read it)."""
    max_seq_len: int
    """Longest context (seq_lens.max()) in tokens (python int)."""
    block_size: int = 0
    """Tokens per KV block (0 when unknown)."""
    host: HostMetadata | None = None
    """The same layout in host memory, for kernels that plan on the CPU (flashinfer) without a device sync."""
    backend_state: dict = field(default_factory=dict)
    """What an attention backend computes once per step and every layer reuses (FlashMLA's scheduler metadata)."""
    state_slots: torch.Tensor | None = None
    """int64 [B]: each sequence's slot in the recurrent-state pools of a hybrid model's linear-attention layers
    (kernels/gdn.py); None for models without recurrent state."""
    state_history: np.ndarray | None = None
    """int64 [T] on the host: per token, the pool row that gets the state after it (-1: none); a speculative verify
    step's (kernels/gdn.py)."""
    verify_history: torch.Tensor | None = None
    """int64 [B, q] on the device: state_history as each sequence's row, set when every sequence of the step verifies
    q tokens, each with a history row; the delta nets' kernels then run the step token by token with no host loop."""

    @property
    def num_seqs(self) -> int:
        """B: number of sequences in the step."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """T: number of new tokens in the step."""
        return self.slot_mapping.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionMetadata:
        """Copy of this metadata with every tensor moved to `device`."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        moved["backend_state"] = {}  # computed for the old device's tensors
        return AttentionMetadata(**moved)

    @classmethod
    def from_lists(
        cls,
        num_cached_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        *,
        max_blocks_per_seq: int | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Build the metadata from per-sequence python lists.

        num_cached_tokens[b]: tokens of sequence b whose K/V is already in the cache (prefix-cache hits
        and earlier steps); num_new_tokens[b]: tokens it runs this step (>= 1); block_ids[b]: its block
        ids in order, at least ceil((cached + new) / block_size) of them. max_blocks_per_seq pads the
        block table to a fixed width (for CUDA graphs); default: the longest list. Tensors are built on
        the CPU with numpy (no per-token python loop) and moved to `device` in one copy each.
        """
        num_seqs = len(num_new_tokens)
        if not (len(num_cached_tokens) == len(block_ids) == num_seqs):
            raise ValueError(
                f"per-sequence lists differ in length: {len(num_cached_tokens)} cached, "
                f"{num_seqs} new, {len(block_ids)} block lists"
            )
        cached = np.asarray(num_cached_tokens, dtype=np.int64).reshape(num_seqs)
        new = np.asarray(num_new_tokens, dtype=np.int64).reshape(num_seqs)
        if num_seqs and (new.min() < 1 or cached.min() < 0):
            raise ValueError("every sequence needs >= 1 new token and >= 0 cached tokens")
        seq_lens = cached + new
        blocks_needed = -(-seq_lens // block_size)
        num_blocks = np.asarray([len(ids) for ids in block_ids], dtype=np.int64).reshape(num_seqs)
        short = np.nonzero(num_blocks < blocks_needed)[0]
        if short.size:
            b = int(short[0])
            raise ValueError(
                f"sequence {b} has {int(num_blocks[b])} blocks but needs {int(blocks_needed[b])} for "
                f"{int(seq_lens[b])} tokens at block_size {block_size}"
            )
        width = max(int(num_blocks.max(initial=0)), 1) if max_blocks_per_seq is None else max_blocks_per_seq
        if num_seqs and width < int(blocks_needed.max()):
            raise ValueError(f"max_blocks_per_seq={width} < {int(blocks_needed.max())} blocks needed")
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        for b, ids in enumerate(block_ids):  # one row copy per sequence, not per token
            row = ids[:width]
            block_tables[b, : len(row)] = row

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), new)
        positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + cached[seq_of_token]
        token_blocks = block_tables[seq_of_token, positions // block_size].astype(np.int64)
        slot_mapping = token_blocks * block_size + positions % block_size

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

        return cls(
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(block_tables, torch.int32),
            slot_mapping=tensor(slot_mapping, torch.int64),
            max_query_len=int(new.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=block_size,
            host=HostMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables),
        )


def positions_from_lists(
    num_cached_tokens: Sequence[int], num_new_tokens: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 [T]: absolute position of every new token (cached + index within its chunk), for RoPE."""
    cached = np.asarray(num_cached_tokens, dtype=np.int64)
    new = np.asarray(num_new_tokens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(new)[:-1])) if new.size else new
    seq_of_token = np.repeat(np.arange(new.size), new)
    positions = np.arange(int(new.sum())) - starts[seq_of_token] + cached[seq_of_token]
    return torch.from_numpy(positions).to(device=device, dtype=torch.int64)
