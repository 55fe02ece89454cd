"""A mixed step's decode rows apart from its prompt rows (flashinfer_triton's attention).

FlashInfer's prefill kernel gives a sequence with one new token a whole query tile and, unsplit, one CTA per KV head
that reads the sequence's entire context: beside a prompt chunk, a decode row at a long context is the kernel's
tail. So a step with both runs its decode rows through triton's split decode kernel, which reads each row's token
from the step's own query rows (its query_start_loc holds their indices) and writes them into the step's output,
and its prompt rows (every sequence with more than one new token) through FlashInfer, planned for those alone.
vLLM's and SGLang's FlashInfer backends separate the two the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flotilla.kernels.attention.metadata import AttentionMetadata, HostMetadata
from flotilla.kernels.staging import upload


@dataclass(frozen=True, slots=True)
class MixedSplit:
    decode: AttentionMetadata
    """The one-token sequences: query_start_loc[b] is the step's token row of decode sequence b (+ T at the end)."""
    prefill: AttentionMetadata
    """The other sequences over their own token axis (their rows in step order), with host copies to plan."""
    prefill_rows: slice | torch.Tensor
    """Where the prefill axis's tokens are in the step's: one range, or (not contiguous) their row indices."""


def split_mixed(meta: AttentionMetadata) -> MixedSplit | None:
    """The step's decode and prompt sequences apart, from the host copies (no device sync); None when the step has
    no host copies or not both kinds."""
    host = meta.host
    if host is None or meta.max_query_len == 1:
        return None
    new = np.diff(host.query_start_loc)
    one = new == 1
    if not one.any() or one.all():
        return None
    device = meta.seq_lens.device
    dec_seqs, pre_seqs = upload(np.nonzero(one)[0], device), upload(np.nonzero(~one)[0], device)
    starts = host.query_start_loc[:-1]
    num_tokens = int(host.query_start_loc[-1])
    dec_qsl = np.append(starts[one], num_tokens).astype(np.int32)
    dec_lens = host.seq_lens[one]
    decode = AttentionMetadata(
        query_start_loc=upload(dec_qsl, device), seq_lens=meta.seq_lens.index_select(0, dec_seqs),
        block_tables=meta.block_tables.index_select(0, dec_seqs), slot_mapping=meta.slot_mapping[:0], max_query_len=1,
        max_seq_len=int(dec_lens.max()), block_size=meta.block_size)  # fmt: skip

    pre_new = new[~one]
    pre_qsl = np.zeros(len(pre_new) + 1, dtype=np.int64)
    np.cumsum(pre_new, out=pre_qsl[1:])
    token_rows = np.nonzero(np.repeat(~one, new))[0]
    if token_rows[-1] - token_rows[0] + 1 == len(token_rows):
        rows: slice | torch.Tensor = slice(int(token_rows[0]), int(token_rows[-1]) + 1)
        slots = meta.slot_mapping[rows]
    else:
        rows = upload(token_rows, device)
        slots = meta.slot_mapping.index_select(0, rows)
    pre_host = HostMetadata(query_start_loc=pre_qsl, seq_lens=host.seq_lens[~one],
                            block_tables=host.block_tables[~one])
    prefill = AttentionMetadata(
        query_start_loc=upload(pre_qsl.astype(np.int32), device), seq_lens=meta.seq_lens.index_select(0, pre_seqs),
        block_tables=meta.block_tables.index_select(0, pre_seqs), slot_mapping=slots,
        max_query_len=meta.max_query_len, max_seq_len=int(pre_host.seq_lens.max()), block_size=meta.block_size,
        host=pre_host)  # fmt: skip
    return MixedSplit(decode=decode, prefill=prefill, prefill_rows=rows)


def mixed_split(meta: AttentionMetadata) -> MixedSplit | None:
    """split_mixed(meta), made at the step's first layer and kept in its backend_state for the others."""
    state = meta.backend_state
    if "mixed_split" not in state:
        state["mixed_split"] = split_mixed(meta)
    return state["mixed_split"]
