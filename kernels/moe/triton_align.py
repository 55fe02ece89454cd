"""The expert grouping of routing.sort_by_expert in one triton launch (vLLM's and SGLang's moe_align_block_size).

routing.sort_by_expert is ~25 small torch kernels (a histogram, two cumsums, an argsort, gathers, a scatter, a
searchsorted). Inside a batch-1 decode graph of a 48-layer MoE model that is ~1,200 launches per token of a few
microseconds each, for a few hundred bytes of work. Here one program does all of it:

  1. zero the per-expert counters and fill every row of sorted_slots with the padding sentinel (num_slots);
  2. count each expert's slots (atomic adds on the counters);
  3. pad each count to block_m, prefix-sum them into each expert's first row, and store the rows in use;
  4. turn the counters into cursors at those first rows, and place every slot at its expert's cursor (an
     atomic add returns the row);
  5. name each block of block_m rows after its expert (how many experts end at or before the block's start).

The result has the contract of routing.sort_by_expert (same sizes, padding, block_experts and num_padded; slots
with a negative id left out) with one difference: within one expert's run the slots are in the order the atomics served them, not ascending.
The expert GEMMs compute each row on its own and write it back to its slot, so the output does not depend on
that order. `tl.debug_barrier` orders the phases: one program (one CTA) does all of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.moe.routing import ExpertBlocks, padded_rows
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior

CHUNK = 1024
"""Slots (and rows) one loop step of the kernel handles."""
BLOCK_CHUNK = 32
"""Blocks whose expert one loop step of the kernel finds ([BLOCK_CHUNK, experts] comparisons)."""


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, cursor_ptr, num_slots, max_rows, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr, SLOTS_BOUND: tl.constexpr, ROWS_BOUND: tl.constexpr, BLOCKS_BOUND: tl.constexpr,
):  # fmt: skip
    """The loops run to constexpr bounds (powers of two at least the runtime counts, masked): few compiled
    variants, and triton's CPU interpreter cannot loop to a runtime bound."""
    experts = tl.arange(0, E_P2)
    tl.store(cursor_ptr + experts, tl.full([E_P2], 0, tl.int32))
    for r in range(0, ROWS_BOUND, CHUNK):
        rows = r + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_slots, mask=rows < max_rows)
    tl.debug_barrier()
    for c in range(0, SLOTS_BOUND, CHUNK):
        slots = c + tl.arange(0, CHUNK)
        valid = slots < num_slots
        ids = tl.load(ids_ptr + slots, mask=valid, other=0)
        valid = valid & (ids >= 0)  # a negative id: a masked slot, in no run
        tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=valid)
    tl.debug_barrier()
    # read back through the atomics' own path (L2), not a plain load that may hit a stale L1 line; zero past
    # NUM_EXPERTS: no slot names those
    counts = tl.atomic_add(cursor_ptr + experts, tl.full([E_P2], 0, tl.int32))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()  # every thread has read the counts before they become cursors
    tl.store(cursor_ptr + experts, ends - padded)
    tl.debug_barrier()
    for c in range(0, SLOTS_BOUND, CHUNK):
        slots = c + tl.arange(0, CHUNK)
        valid = slots < num_slots
        ids = tl.load(ids_ptr + slots, mask=valid, other=0)
        valid = valid & (ids >= 0)
        rows = tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=valid)
        tl.store(sorted_ptr + rows, slots, mask=valid)
    for b in range(0, BLOCKS_BOUND, BLOCK_CHUNK):
        blocks = b + tl.arange(0, BLOCK_CHUNK)
        starts = blocks * BLOCK_M
        # experts ending at or before the block's first row come before its expert (searchsorted, right=True);
        # the E_P2 - NUM_EXPERTS empty entries end at the last row in use, so only blocks past it count them
        expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.minimum(expert, NUM_EXPERTS - 1), mask=blocks < num_blocks)


@triton.jit
def _align_small_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, cursor_ptr, num_slots, max_rows, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    SLOTS_P2: tl.constexpr, ROWS_BOUND: tl.constexpr, BLOCKS_BOUND: tl.constexpr, USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """_align_kernel's result for a decode-sized batch (all slots in registers: SLOTS_P2 >= num_slots), with one
    atomic round trip instead of three: the counts are a histogram of the ids held in registers (no counter zeroing,
    counting atomics or read-back), the prefix sums stay in registers, and each expert stores its own blocks' id
    instead of every block searching the run ends. Only the placing of slots at their expert's cursor takes atomics."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    wait_prior(USE_GDC)
    slots = tl.arange(0, SLOTS_P2)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
    valid = ids >= 0  # past the batch, or a negative id (a masked slot): in no run
    for r in range(0, ROWS_BOUND, CHUNK):  # the padding sentinel, before any slot is placed (barrier below)
        rows = r + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_slots, mask=rows < max_rows)
    experts = tl.arange(0, E_P2)
    # the slots in no run are counted in bin 0, then taken out of it
    counts = tl.histogram(tl.where(valid, ids, 0), E_P2).to(tl.int32)
    counts -= tl.where(experts == 0, SLOTS_P2 - tl.sum(valid.to(tl.int32), 0), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    used = tl.sum(padded, 0)
    tl.store(num_padded_ptr, used)
    tl.store(cursor_ptr + experts, starts)
    # each expert's blocks are named after it; blocks past the rows in use after the last expert (sort_by_expert's)
    first_block = starts // BLOCK_M
    run_blocks = padded // BLOCK_M
    for j in range(0, tl.max(run_blocks, 0)):
        tl.store(block_experts_ptr + first_block + j, experts, mask=j < run_blocks)
    for b in range(0, BLOCKS_BOUND, CHUNK):
        blocks = b + tl.arange(0, CHUNK)
        tl.store(block_experts_ptr + blocks, tl.full([CHUNK], NUM_EXPERTS - 1, tl.int32),
                 mask=(blocks >= used // BLOCK_M) & (blocks < num_blocks))  # fmt: skip
    tl.debug_barrier()  # the cursors and the sentinel rows stored before any slot is placed
    rows = tl.atomic_add(cursor_ptr + ids, tl.full([SLOTS_P2], 1, tl.int32), mask=valid, sem="relaxed")
    tl.store(sorted_ptr + rows, slots, mask=valid)


SMALL_MAX_SLOTS = 4096
"""Batches of at most this many slots (512 tokens at top-8: every decode step of the engine's default batch) group in
_align_small_kernel, which holds them all in registers and needs no atomic counting pass; larger ones in
_align_kernel, which loops over them."""
SMALL_NUM_WARPS = 8


def _bound(n: int) -> int:
    """n rounded up to a power of two (0 for 0): a loop bound that compiles one variant per octave."""
    return triton.next_power_of_2(n) if n else 0


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """routing.sort_by_expert in one launch (see the module docstring for the one difference: slot order within
    an expert). topk_ids [T, top_k] int32 or int64, ids in [0, num_experts)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    max_rows = padded_rows(num_slots, num_experts, block_m)
    num_blocks = max_rows // block_m
    device = flat.device
    sorted_slots = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursors = torch.empty(triton.next_power_of_2(num_experts), dtype=torch.int32, device=device)
    if num_slots <= SMALL_MAX_SLOTS:
        _align_small_kernel[(1,)](
            flat, sorted_slots, block_experts, num_padded, cursors, num_slots, max_rows, num_blocks,
            NUM_EXPERTS=num_experts, E_P2=cursors.numel(), BLOCK_M=block_m, CHUNK=CHUNK,
            SLOTS_P2=max(16, triton.next_power_of_2(num_slots)), ROWS_BOUND=_bound(max_rows),
            BLOCKS_BOUND=_bound(num_blocks), num_warps=SMALL_NUM_WARPS, **pdl_options(device),
        )  # fmt: skip
        return ExpertBlocks(sorted_slots=sorted_slots, block_experts=block_experts, num_padded=num_padded,
                            num_slots=num_slots, block_m=block_m)  # fmt: skip
    _align_kernel[(1,)](
        flat, sorted_slots, block_experts, num_padded, cursors, num_slots, max_rows, num_blocks,
        NUM_EXPERTS=num_experts, E_P2=cursors.numel(), BLOCK_M=block_m, CHUNK=CHUNK, BLOCK_CHUNK=BLOCK_CHUNK,
        SLOTS_BOUND=_bound(num_slots), ROWS_BOUND=_bound(max_rows), BLOCKS_BOUND=_bound(num_blocks),
    )  # fmt: skip
    return ExpertBlocks(sorted_slots=sorted_slots, block_experts=block_experts, num_padded=num_padded,
                        num_slots=num_slots, block_m=block_m)  # fmt: skip
