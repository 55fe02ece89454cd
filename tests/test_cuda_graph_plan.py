"""The CUDA-graph decode's page tables, built on the host (checked without a GPU)."""

from __future__ import annotations

import numpy as np

from flotilla.actors.cuda_graphs import DecodeGraphs


def _graphs(block_size: int, scratch_block: int) -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)  # no capture: only the host-side planning is under test
    g.block_size, g.scratch_block = block_size, scratch_block
    return g


def test_page_tables_take_each_sequences_pages_then_pad_on_the_scratch_block():
    g = _graphs(block_size=4, scratch_block=99)
    # tables with spare capacity past the pages in use (as the runner's per-sequence storage has)
    tables = [np.array([5, 6, 7, 0, 0], np.int32), np.array([9, 1, 1], np.int32), np.array([3, 4, 8, 2], np.int32)]
    seq_lens = np.array([9, 1, 16])  # 3, 1 and 4 pages; last pages hold 1, 1 and 4 tokens
    indptr, indices, last = g.page_tables(8, seq_lens, tables)
    assert indptr.tolist() == [0, 3, 4, 8, 9, 10, 11, 12, 13]
    assert indices.tolist() == [5, 6, 7, 9, 3, 4, 8, 2] + [99] * 5
    assert last.tolist() == [1, 1, 4] + [1] * 5


def test_page_tables_of_an_empty_batch_are_all_padding():
    g = _graphs(block_size=16, scratch_block=7)
    indptr, indices, last = g.page_tables(8, np.zeros(0, np.int64), [])
    assert indptr.tolist() == list(range(9)) and indices.tolist() == [7] * 8 and last.tolist() == [1] * 8
