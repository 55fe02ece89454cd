"""BlockManager: the scheduler's paged-KV allocator (refcounts, prefix cache, LRU eviction, pins).

The GPU worker's KV cache is ``num_blocks`` blocks of ``block_size`` token slots. This class decides
which blocks each sequence owns; it never touches KV bytes. It lives inside the scheduler process and
is driven by the batching policy, one call per decision:

- admit:    ``allocate(seq_id, token_ids, num_new_tokens)`` takes the longest cached prefix of full
            blocks (never the whole prompt: the last token is always recomputed so the model has
            logits to sample from) plus fresh blocks for the first chunk; ``None`` = not enough blocks.
- each step: ``append_slots(seq_id, n)`` before a sequence computes ``n`` more tokens (a prefill
            chunk, or 1 for a decode); ``None`` = out of blocks, the policy preempts someone.
- after a step: ``commit(seq_id, token_ids, num_computed_tokens)`` offers blocks that became full of
            computed KV to the prefix cache.
- finish / abort / preempt (recompute): ``free(seq_id)``; its cached blocks stay reusable until evicted.
- KV migration: ``pin(seq_id, pin_id)`` holds the sequence's blocks while a transfer reads (prefill side)
            or writes (decode side) them; ``free`` during a pin releases only the table's references,
            the blocks return to the free pool at ``unpin(pin_id)``.
- recurrent state (hybrid models, ``num_state_snapshots`` > 0): a gated delta net's state is valid at one
            position only, so a cached prefix is reusable only up to a block whose end has a state snapshot.
            ``snapshot_points`` says where a new sequence's state is worth saving: where its cached prefix stops
            being resumable (another prompt's blocks shared this far: a system prompt) and where its prompt's last
            full block ends (the next turn of a conversation). ``reserve_snapshot(seq_id, at)`` gives the slot
            the worker saves into when the sequence's KV reaches ``at``; ``commit`` makes that snapshot a prefix
            hit's ``Allocation.state_snapshot``. Snapshots are evicted least recently used, and with the block
            whose hash keys them. A disaggregated transfer's state is a snapshot slot the sequence owns instead
            (``reserve_snapshot(..., owned=True)`` on the prefill side, ``own_state`` on the decode side): ``pin``
            holds it with the blocks until ``unpin``.

Choices, and why:

- No null block is reserved: every id 0..num_blocks-1 is allocatable. The worker pads block tables with
  block 0 but marks padding slots -1 in the slot mapping (kernels/attention/metadata.py), so padding
  never writes KV, and reads through padded entries are masked.
- Block hashes are a chain ``blake2b(parent_hash + int32 token bytes, 16 bytes)``. Python's ``hash()``
  would be fast enough and per-process randomisation would not matter (one process owns the cache), but
  it is 64 bits and not collision resistant: a crafted prompt could collide with another tenant's prefix
  and read its KV (vLLM moved to SHA-256 for this reason). blake2b-128 costs ~1 us per block.
- Two free pools: blocks holding no cached KV are handed out first; blocks holding cached KV are
  evicted least-recently-freed first (an OrderedDict gives O(1) touch and eviction). A sequence's blocks
  are freed tail first, so a prefix outlives its suffix.
- A refcount is the number of sequence tables plus pins holding the block, so "freed but still read by
  a migration" needs no special state: the block is simply not at refcount 0 yet.

Every call costs O(blocks it touches). ``check_invariants()`` is O(num_blocks) and meant for tests.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

TokenIds = Sequence[int] | np.ndarray
"""Token ids as a python sequence or a 1-D integer numpy array (as they arrive on the wire)."""

ROOT_HASH = b""
"""Parent hash of a sequence's first block."""


def hash_block(parent_hash: bytes, token_ids: TokenIds) -> bytes:
    """Chain hash of one full block: identifies the block's tokens *and* every token before them."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(parent_hash + data, digest_size=16).digest()


class Allocation(NamedTuple):
    """What ``allocate`` hands the scheduler for a newly admitted sequence."""

    block_ids: list[int]
    """The sequence's block table: cached prefix blocks first, then fresh ones."""
    num_cached_tokens: int
    """Leading tokens whose KV is already in those blocks (a multiple of block_size), tokens."""
    state_snapshot: int = -1
    """With state snapshots: the snapshot slot holding the recurrent state after those tokens; -1: none."""
    num_shared_tokens: int = 0
    """match_prefix: leading tokens whose KV is cached, resumable or not (>= num_cached_tokens), tokens."""


@dataclass(slots=True)
class _SeqBlocks:
    """The allocator's view of one sequence."""

    block_ids: list[int]
    """Block table, in token order."""
    num_slots: int
    """Token positions the table covers (the scheduler's computed tokens after the planned step)."""
    block_hashes: list[bytes]
    """Chain hashes of the first len() full blocks of the sequence's tokens (computed lazily, reused)."""
    num_committed_blocks: int
    """Leading blocks already offered to the prefix cache (prefix hits count as offered)."""
    cacheable: bool = True
    """False after reset_prefix_cache(): KV computed before the reset must not be cached again."""
    snapshots: list[tuple[int, int, bool]] | None = None
    """(position, slot, owned) ascending: where the worker saves the recurrent state once the KV reaches position;
    owned: for the sequence itself (a transfer's), not the prefix cache."""
    state: int = -1
    """A snapshot slot the sequence owns: its transfer's state (saved here, or migrated in); -1: none."""
    resumes: int = -1
    """The snapshot slot its first step resumes its state from, held until that step is back (resumed()); -1: none."""


class BlockManager:
    """Paged KV-block allocator with refcounted sharing, a hash-chain prefix cache and migration pins."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 recompute_last_hit: bool = False, num_state_snapshots: int = 0) -> None:
        """recompute_last_hit: a prefix hit leaves its last block to be recomputed (speculative decoding with MTP:
        that layer's KV at a block's last position depends on the token after it, which differs between the
        sequences sharing the block; vLLM does the same for EAGLE). num_state_snapshots: a hybrid model's
        recurrent-state snapshot slots; prefix hits then end where a snapshot does (the module docstring)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit = recompute_last_hit
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cache: dict[bytes, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, LRU first
        self._seqs: dict[str, _SeqBlocks] = {}
        self._pins: dict[str, list[int]] = {}
        self.queried_tokens = 0
        """Prompt tokens of admitted sequences (prefix-cache lookups), tokens; for /metrics."""
        self.hit_tokens = 0
        """Of those, tokens served from the prefix cache, tokens."""
        self.num_evictions = 0
        """Cached blocks dropped from the prefix cache to make room, blocks."""
        self.num_state_snapshots = num_state_snapshots
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot of the state at its end, LRU
        self._free_snapshots: list[int] = list(range(num_state_snapshots - 1, -1, -1))
        self._pinned_states: dict[str, int] = {}  # pin id -> the snapshot slot it holds with its blocks
        self._slot_hash: dict[int, bytes] = {}  # a cached snapshot's slot -> its key in _snapshots
        self._readers: dict[int, int] = {}
        """snapshot slot -> sequences whose first step, not back yet, resumes from it: the slot is neither evicted nor
        reused until then (a KV migration writes a slot it is given at once, out of the worker's step order)."""

    # ------------------------------------------------------------------ read-only views

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (unused ones plus evictable cached ones)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or evictable)."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence or a pin, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hit_tokens / queried_tokens since start (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_ids(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seqs[seq_id].block_ids)

    def num_slots(self, seq_id: str) -> int:
        """Token positions the sequence's table covers."""
        return self._seqs[seq_id].num_slots

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks append_slots(seq_id, num_new_tokens) would take (for the policy's budget)."""
        seq = self._seqs[seq_id]
        return max(0, self.blocks_for(seq.num_slots + num_new_tokens) - len(seq.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        """True when num_blocks fresh blocks can be handed out now."""
        return num_blocks <= self.num_free_blocks

    def refcount(self, block_id: int) -> int:
        """Sequence tables plus pins holding the block (0 = in a free pool)."""
        return self._ref[block_id]

    def is_pinned(self, pin_id: str) -> bool:
        """True while the pin is held."""
        return pin_id in self._pins

    # ------------------------------------------------------------------ prefix lookup

    def _match(self, token_ids: TokenIds) -> tuple[list[int], list[bytes], int]:
        """Cached blocks of the longest full-block prefix, leaving at least the last token uncached.

        Returns the hit block ids, the chain hashes computed on the way (the hits' hashes plus, when
        the walk stopped at a miss, that block's hash, so commit() need not hash it again), and how many
        blocks were cached before a hybrid model's hit was cut back to its last state snapshot.
        """
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
            block = self._cache.get(parent)
            if block is None:
                break
            blocks.append(block)
        if self.recompute_last_hit and blocks:
            blocks.pop()  # (its hash stays in `hashes`: commit() then finds it cached and keeps this copy private)
        shared = len(blocks)
        if self.num_state_snapshots:  # a recurrent state resumes only where a snapshot of it was taken
            while blocks and hashes[len(blocks) - 1] not in self._snapshots:
                blocks.pop()
        return blocks, hashes, shared

    def match_prefix(self, token_ids: TokenIds) -> Allocation:
        """Which cached blocks a sequence with these tokens would reuse now; changes nothing."""
        if not self.enable_prefix_caching or len(token_ids) == 0:
            return Allocation([], 0)
        blocks, hashes, shared = self._match(token_ids)
        return Allocation(blocks, len(blocks) * self.block_size, self._snapshot_of(blocks, hashes),
                          shared * self.block_size)

    def _snapshot_of(self, blocks: list[int], hashes: list[bytes]) -> int:
        return self._snapshots[hashes[len(blocks) - 1]] if self.num_state_snapshots and blocks else -1

    # ------------------------------------------------------------------ sequence lifecycle

    def allocate(self, seq_id: str, token_ids: TokenIds, num_new_tokens: int | None = None,
                 read_cache: bool = True) -> Allocation | None:
        """Admit a sequence: reuse its cached prefix and add fresh blocks for its first chunk.

        token_ids are all its known tokens (the prompt; prompt + earlier output when resumed after
        preemption). The table covers ``num_cached_tokens + min(num_new_tokens, rest)`` tokens, where
        rest = len(token_ids) - num_cached_tokens; num_new_tokens=None means the whole rest (no chunking,
        or the decode side of a disaggregated pair reserving room for the migrated prompt). The
        scheduler's first chunk is therefore min(num_new_tokens, rest) tokens starting at
        num_cached_tokens. Returns None, with nothing changed, when the blocks are not there.
        read_cache=False takes no hits (every token is computed: prompt logprobs score each position); its full
        blocks still go to the prefix cache.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise ValueError("cannot allocate a sequence with no tokens")
        if num_new_tokens is not None and num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hit_blocks, hashes, _ = self._match(token_ids) if self.enable_prefix_caching and read_cache else ([], [], 0)
        num_cached = len(hit_blocks) * self.block_size
        rest = num_tokens - num_cached
        num_slots = num_cached + (rest if num_new_tokens is None else min(num_new_tokens, rest))
        num_fresh = self.blocks_for(num_slots) - len(hit_blocks)
        num_revived = sum(1 for b in hit_blocks if self._ref[b] == 0)  # hits that leave the free pool
        if num_fresh + num_revived > self.num_free_blocks:
            return None
        for block in hit_blocks:  # take the hits before popping fresh blocks so none of them is evicted
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        snapshot = self._snapshot_of(hit_blocks, hashes)
        if snapshot >= 0:
            self._snapshots.move_to_end(hashes[len(hit_blocks) - 1])
            self._readers[snapshot] = self._readers.get(snapshot, 0) + 1
        table = hit_blocks + self._pop_free(num_fresh)
        self._seqs[seq_id] = _SeqBlocks(table, num_slots, hashes, len(hit_blocks), resumes=snapshot)
        if self.enable_prefix_caching and read_cache:
            self.queried_tokens += num_tokens
            self.hit_tokens += num_cached
        return Allocation(list(table), num_cached, snapshot)

    def append_slots(self, seq_id: str, num_new_tokens: int) -> list[int] | None:
        """Grow the table to cover num_new_tokens more tokens; returns the appended block ids.

        Call before every step that computes tokens of an admitted sequence beyond what its table
        covers: a later prefill chunk (n = chunk length) or a decode (n = 1). The returned ids are what
        StepPlan.new_block_ids carries. None, with nothing changed, when there are not enough free
        blocks: the policy then preempts (free) a sequence and retries, or skips this one.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs[seq_id]
        needed = self.blocks_for(seq.num_slots + num_new_tokens) - len(seq.block_ids)
        if needed > self.num_free_blocks:
            return None
        new_blocks = self._pop_free(needed) if needed > 0 else []
        seq.block_ids.extend(new_blocks)
        seq.num_slots += num_new_tokens
        return new_blocks

    def commit(self, seq_id: str, token_ids: TokenIds, num_computed_tokens: int) -> int:
        """Register the sequence's blocks that are now full of computed KV in the prefix cache.

        Call after a step's result arrives, with all known tokens and how many of them have KV now
        (for a disaggregated decode side: after MigrationDone, with the prompt length). Blocks committed
        earlier are skipped, so the cost is O(newly full blocks). When another block already caches the
        same hash (two sequences computed the same prefix side by side) this one stays uncached.
        Returns the number of blocks newly added to the cache.
        """
        seq = self._seqs[seq_id]
        if num_computed_tokens > seq.num_slots or num_computed_tokens > len(token_ids):
            raise ValueError(
                f"{seq_id!r}: {num_computed_tokens} computed tokens but {seq.num_slots} slots "
                f"and {len(token_ids)} tokens"
            )
        num_full = num_computed_tokens // self.block_size
        if not (self.enable_prefix_caching and seq.cacheable) or num_full <= seq.num_committed_blocks:
            seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)
            self._commit_snapshots(seq, num_computed_tokens)
            return 0
        bs = self.block_size
        hashes = seq.block_hashes
        newly_cached = 0
        for i in range(seq.num_committed_blocks, num_full):
            if i == len(hashes):
                hashes.append(hash_block(hashes[i - 1] if i else ROOT_HASH, token_ids[i * bs : (i + 1) * bs]))
            block_hash = hashes[i]
            if block_hash not in self._cache:
                block = seq.block_ids[i]
                self._hash[block] = block_hash
                self._cache[block_hash] = block
                newly_cached += 1
        seq.num_committed_blocks = num_full
        self._commit_snapshots(seq, num_computed_tokens)
        return newly_cached

    # ------------------------------------------------------------------ recurrent-state snapshots

    def snapshot_points(self, token_ids: TokenIds, hit: Allocation) -> list[int]:
        """Where a sequence admitted with these tokens and this hit (match_prefix) should save its state, ascending:
        where its cached prefix stops being resumable, and the end of its last full block before its last token;
        [] without snapshots."""
        if not (self.num_state_snapshots and self.enable_prefix_caching):
            return []
        last = (len(token_ids) - 1) // self.block_size * self.block_size
        return sorted({p for p in (hit.num_shared_tokens, last) if p > hit.num_cached_tokens})

    def snapshot_after(self, seq_id: str, position: int) -> tuple[int, int] | None:
        """(position, slot) of the sequence's first reserved snapshot past `position` (those before it may be in a
        step in flight, not yet committed); None when there is none."""
        return next(((at, slot) for at, slot, _ in self._seqs[seq_id].snapshots or () if at > position), None)

    def reserve_snapshot(self, seq_id: str, at: int, owned: bool = False) -> int:
        """A slot the worker saves the sequence's state into when its KV reaches `at`, evicting the least recently
        used snapshot if need be; -1 when every slot is taken. owned: the state is the sequence's own (a transfer's:
        pin() holds it), not the prefix cache's."""
        seq = self._seqs[seq_id]
        if any(p == at for p, _, _ in seq.snapshots or ()):
            raise ValueError(f"{seq_id!r}: a snapshot at {at} is reserved already")
        slot = self._take_snapshot_slot()
        if slot >= 0:
            seq.snapshots = sorted([*(seq.snapshots or []), (at, slot, owned)])
        return slot

    def own_state(self, seq_id: str) -> int:
        """A snapshot slot the sequence owns from now on (a decode engine's migrated state lands there); -1 when
        every slot is taken."""
        seq = self._seqs[seq_id]
        if seq.state >= 0:
            raise ValueError(f"{seq_id!r} owns a state slot already")
        seq.state = self._take_snapshot_slot()
        return seq.state

    def state_of(self, seq_id: str) -> int:
        """The snapshot slot the sequence owns (own_state, or an owned snapshot taken); -1: none."""
        return self._seqs[seq_id].state

    def resume_own_state(self, seq_id: str) -> int:
        """The sequence's first step resumes the state it owns (a migrated one): returns that slot, which is freed
        once the step is back (resumed()); -1 when it owns none."""
        seq = self._seqs[seq_id]
        slot, seq.state = seq.state, -1
        if slot >= 0:
            seq.resumes = slot
            self._readers[slot] = self._readers.get(slot, 0) + 1
        return slot

    def resumed(self, seq_id: str) -> None:
        """The sequence's first step is back: the state it resumed is in its running slot now."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.resumes >= 0:
            self._drop_reader(seq.resumes)
            seq.resumes = -1

    def _drop_reader(self, slot: int) -> None:
        self._readers[slot] -= 1
        if not self._readers[slot]:
            del self._readers[slot]
            if slot not in self._slot_hash:  # (a migrated state, or a snapshot dropped while it was read)
                self._free_snapshots.append(slot)

    def _free_snapshot(self, slot: int) -> None:
        """A slot nothing keeps any more: free, or once its last reader is done."""
        if slot not in self._readers:
            self._free_snapshots.append(slot)

    def _take_snapshot_slot(self) -> int:
        if not self._free_snapshots:  # evict the least recently used snapshot no step is about to resume
            victim = next((h for h, slot in self._snapshots.items() if slot not in self._readers), None)
            if victim is not None:
                self._uncache_snapshot(victim)
        return self._free_snapshots.pop() if self._free_snapshots else -1

    def _uncache_snapshot(self, block_hash: bytes) -> None:
        slot = self._snapshots.pop(block_hash)
        del self._slot_hash[slot]
        self._free_snapshot(slot)

    def _commit_snapshots(self, seq: _SeqBlocks, num_computed_tokens: int) -> None:
        """The snapshots taken by now: a prefix hit up to their blocks may resume from them."""
        while seq.snapshots and seq.snapshots[0][0] <= num_computed_tokens:
            at, slot, owned = seq.snapshots.pop(0)
            if owned:
                if seq.state >= 0:
                    self._free_snapshots.append(seq.state)
                seq.state = slot
                continue
            i = at // self.block_size - 1
            block_hash = seq.block_hashes[i] if seq.cacheable and i < len(seq.block_hashes) else None
            if block_hash is None or block_hash not in self._cache or block_hash in self._snapshots:
                self._free_snapshots.append(slot)  # its block is not cached (or has a snapshot already)
            else:
                self._snapshots[block_hash] = slot
                self._slot_hash[slot] = block_hash

    def free(self, seq_id: str) -> bool:
        """Drop the sequence's table (finish, abort, or preemption by recompute).

        Blocks no one else references return to the free pool, cached ones staying reusable for prefix
        hits until evicted; blocks a pin still holds wait for unpin(). Returns False for an unknown id
        (an abort racing a finish is not an error).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.snapshots:  # never taken (or taken by a step whose result is dropped): the slots are free
            self._free_snapshots.extend(slot for _, slot, _ in seq.snapshots)
        if seq.state >= 0:
            self._free_snapshots.append(seq.state)
        if seq.resumes >= 0:
            self._drop_reader(seq.resumes)
        self._release(seq.block_ids)
        return True

    # ------------------------------------------------------------------ migration pins

    def pin(self, seq_id: str, pin_id: str | None = None) -> str:
        """Hold the sequence's current blocks until unpin(pin_id), whatever happens to the sequence.

        Use while a KV transfer reads the blocks (prefill side, until BlocksReleased) or writes them
        (decode side, until MigrationDone or failure), so that an abort cannot hand them to another
        sequence mid-transfer. pin_id defaults to seq_id; use the transfer id when one sequence may be
        pinned twice. Returns the pin id.
        """
        pin_id = seq_id if pin_id is None else pin_id
        if pin_id in self._pins:
            raise ValueError(f"pin {pin_id!r} already held")
        seq = self._seqs[seq_id]
        blocks = list(seq.block_ids)
        for block in blocks:
            self._ref[block] += 1
        self._pins[pin_id] = blocks
        owned = [slot for _, slot, own in seq.snapshots or () if own]  # saved by the step whose result pins it
        if owned:
            seq.snapshots = [s for s in seq.snapshots if not s[2]]
            if seq.state >= 0:
                self._free_snapshots.append(seq.state)
            seq.state = owned[-1]
            self._free_snapshots.extend(owned[:-1])
        if seq.state >= 0:  # the transfer's state goes with its blocks
            self._pinned_states[pin_id] = seq.state
            seq.state = -1
        return pin_id

    def pinned_state(self, pin_id: str) -> int:
        """The snapshot slot a pin holds (its transfer's state); -1: none."""
        return self._pinned_states.get(pin_id, -1)

    def unpin(self, pin_id: str) -> bool:
        """Release a pin; blocks whose last holder it was return to the free pool. False if unknown."""
        blocks = self._pins.pop(pin_id, None)
        if blocks is None:
            return False
        self._release(blocks)
        slot = self._pinned_states.pop(pin_id, -1)
        if slot >= 0:
            self._free_snapshots.append(slot)
        return True

    # ------------------------------------------------------------------ cache maintenance

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight update); returns how many were dropped.

        Blocks in use keep their KV but are no longer shared with newcomers, and live sequences stop
        registering blocks, since their KV was (partly) computed before the reset.
        """
        dropped = len(self._cache)
        for block in self._cache.values():
            self._hash[block] = None
        self._cache.clear()
        for block_hash in list(self._snapshots):
            self._uncache_snapshot(block_hash)
        self._free_uncached.extend(self._evictable)
        self._evictable.clear()
        for seq in self._seqs.values():
            seq.cacheable = False
        return dropped

    # ------------------------------------------------------------------ internals

    def _pop_free(self, n: int) -> list[int]:
        """Take n blocks (caller checked there are enough): uncached first, then evict LRU cached."""
        taken: list[int] = []
        while len(taken) < n and self._free_uncached:
            taken.append(self._free_uncached.popleft())
        while len(taken) < n:
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self._hash[block]]  # type: ignore[arg-type]
            if self._hash[block] in self._snapshots:
                self._uncache_snapshot(self._hash[block])  # type: ignore[arg-type]
            self._hash[block] = None
            self.num_evictions += 1
            taken.append(block)
        for block in taken:
            self._ref[block] = 1
        return taken

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, tail first so a prefix is evicted after its suffix."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free_uncached.append(block)
                else:
                    self._evictable[block] = None

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests call this after every op)."""

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise AssertionError(msg)

        holders = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            check(len(set(seq.block_ids)) == len(seq.block_ids), f"{seq_id!r} holds a block twice")
            check(len(seq.block_ids) == self.blocks_for(seq.num_slots), f"{seq_id!r} table/slots mismatch")
            check(seq.num_committed_blocks <= len(seq.block_ids), f"{seq_id!r} committed past its table")
            check(
                not (self.enable_prefix_caching and seq.cacheable) or len(seq.block_hashes) >= seq.num_committed_blocks,
                f"{seq_id!r} committed blocks without hashes",
            )
            for block in seq.block_ids:
                holders[block] += 1
        for pin_id, blocks in self._pins.items():
            check(len(set(blocks)) == len(blocks), f"pin {pin_id!r} holds a block twice")
            for block in blocks:
                holders[block] += 1
        check(holders == self._ref, "refcounts differ from the number of tables and pins holding blocks")
        uncached, evictable = set(self._free_uncached), set(self._evictable)
        check(len(uncached) == len(self._free_uncached), "a block is in the free pool twice")
        check(not uncached & evictable, "a block is in both free pools")
        free = {b for b in range(self.num_blocks) if self._ref[b] == 0}
        check(uncached | evictable == free, "free pools differ from the refcount-0 blocks")
        check(all(self._hash[b] is None for b in uncached), "an uncached free block carries a hash")
        check(all(self._hash[b] is not None for b in evictable), "an evictable block carries no hash")
        for block_hash, block in self._cache.items():
            check(self._hash[block] == block_hash, f"cache entry points at block {block} of another hash")
        hashed = sum(h is not None for h in self._hash)
        check(hashed == len(self._cache), "a block carries a hash the cache does not map to it")
        check(all(h in self._cache for h in self._snapshots), "a snapshot outlived its block")
        reserved = [slot for seq in self._seqs.values() for _, slot, _ in seq.snapshots or ()]
        owned = [seq.state for seq in self._seqs.values() if seq.state >= 0]
        read = [seq.resumes for seq in self._seqs.values() if seq.resumes >= 0]
        check(sorted(set(read)) == sorted(self._readers) and len(read) == sum(self._readers.values()),
              "snapshot readers miscounted")
        check(self._slot_hash == {slot: h for h, slot in self._snapshots.items()}, "cached snapshot slots mismatched")
        orphans = [slot for slot in self._readers if slot not in self._slot_hash]
        slots = [*self._snapshots.values(), *self._free_snapshots, *reserved, *owned, *self._pinned_states.values(),
                 *orphans]
        check(sorted(slots) == list(range(self.num_state_snapshots)), "snapshot slots lost or held twice")
