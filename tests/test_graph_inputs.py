"""StaticInputs (actors/graph_inputs.py): a captured step's inputs, written with one copy into views of one buffer,
read back through those views exactly as the separate tensors held them, padding and alignment included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flotilla.actors import graph_inputs
from flotilla.actors.cuda_graphs import static_tables
from flotilla.actors.graph_inputs import StaticInputs

SCRATCH_BLOCK, BLOCK = 99, 4


def _tables(rng: np.random.Generator, lens: list[int]) -> list[np.ndarray]:
    return [rng.permutation(90)[: -(-n // BLOCK) + 2].astype(np.int32) for n in lens]  # spare room, as runners keep


@pytest.mark.parametrize("whole", [True, False])
def test_a_steps_inputs_land_in_their_views_with_the_padding_graphs_read(monkeypatch, whole):
    if not whole:  # the block table too large to go with the inputs: its own copy of the columns in use
        monkeypatch.setattr(graph_inputs, "WHOLE_TABLE_BYTES", 0)
    rng = np.random.default_rng(0)
    inputs = StaticInputs(rows=13, max_seqs=13, max_blocks=9, scratch_block=SCRATCH_BLOCK,
                          scratch_slot=SCRATCH_BLOCK * BLOCK, device=torch.device("cpu"))
    for views in ((inputs.ids, inputs.positions, inputs.slots), (inputs.seq_lens, inputs.block_tables)):
        for v in views:  # every section on a 64-byte boundary of the buffer
            assert (v.data_ptr() - inputs.buffer.data_ptr()) % 64 == 0
    for lens in ([30, 3, 17], [5], [33, 1, 2, 3, 4, 5, 6, 7], [2, 9]):  # batches grow and shrink over one buffer
        batch, size = len(lens), {1: 1, 2: 2, 3: 4}.get(len(lens), 8)
        tables = _tables(rng, lens)
        ids = rng.integers(1, 300, batch)
        pos = np.asarray(lens) - 1
        slots = np.array([t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, pos)])
        seq_lens, table = static_tables(size, np.asarray(lens), tables, BLOCK, SCRATCH_BLOCK)
        inputs.write(ids, pos, slots, seq_lens, table)
        assert inputs.ids[:size].tolist() == [*ids, *[0] * (size - batch)]
        assert inputs.positions[:size].tolist() == [*pos, *[0] * (size - batch)]
        assert inputs.slots[:size].tolist() == [*slots, *[SCRATCH_BLOCK * BLOCK] * (size - batch)]
        assert inputs.seq_lens[:size].tolist() == [*lens, *[1] * (size - batch)]
        got = inputs.block_tables[:size].numpy()
        assert (got[:, :table.shape[1]] == table).all()
        for b, n in enumerate(lens):  # each sequence's pages, then (where the table went whole) the scratch block
            pages = -(-n // BLOCK)
            assert (got[b, :pages] == tables[b][:pages]).all()
            if whole:
                assert (got[b, pages:] == SCRATCH_BLOCK).all()


def test_token_inputs_alone_for_a_backend_planned_on_the_host():
    inputs = StaticInputs(rows=8, max_seqs=0, max_blocks=0, scratch_block=SCRATCH_BLOCK,
                          scratch_slot=SCRATCH_BLOCK * BLOCK, device=torch.device("cpu"))
    inputs.write(np.array([5, 6]), np.array([7, 8]), np.array([9, 10]))
    assert inputs.ids.tolist() == [5, 6, *[0] * 6]
    assert inputs.positions.tolist() == [7, 8, *[0] * 6]
    assert inputs.slots.tolist() == [9, 10, *[SCRATCH_BLOCK * BLOCK] * 6]
    with pytest.raises(AssertionError, match="no attention tables"):
        inputs.write(np.array([5]), np.array([7]), np.array([9]), np.array([8], dtype=np.int32),
                     np.zeros((1, 2), dtype=np.int32))


def test_a_hybrid_models_rows_carry_their_state_slots_and_padding_rows_slot_minus_one():
    inputs = StaticInputs(rows=8, max_seqs=8, max_blocks=3, scratch_block=SCRATCH_BLOCK,
                          scratch_slot=SCRATCH_BLOCK * BLOCK, device=torch.device("cpu"), state_slots=True)
    assert inputs.state_slots is not None and (inputs.state_slots.data_ptr() - inputs.buffer.data_ptr()) % 64 == 0
    assert inputs.state_slots.tolist() == [-1] * 8  # (before any step: every row is padding)
    seq_lens, table = static_tables(4, np.array([5, 2]), [np.array([7, 8]), np.array([3])], BLOCK, SCRATCH_BLOCK)
    inputs.write(np.array([11, 12]), np.array([4, 1]), np.array([32, 13]), seq_lens, table,
                 state_slots=np.array([3, 0]))
    assert inputs.state_slots[:4].tolist() == [3, 0, -1, -1]
    assert inputs.ids[:4].tolist() == [11, 12, 0, 0] and inputs.slots[:2].tolist() == [32, 13]
    assert inputs.seq_lens[:4].tolist() == [5, 2, 1, 1] and inputs.block_tables[0, :2].tolist() == [7, 8]
    with pytest.raises(AssertionError, match="state slots"):
        inputs.write(np.array([5]), np.array([7]), np.array([9]), seq_lens[:1], table[:1])
