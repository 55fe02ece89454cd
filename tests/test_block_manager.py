"""BlockManager: deterministic scenarios plus a hypothesis state machine driving it like a scheduler.

The state machine keeps a model of what KV each block holds (the token prefix written into it), so a
prefix hit is checked for *content*, not just for bookkeeping: a hit block must hold exactly the tokens
the new sequence would have computed there.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from flotilla.actors.block_manager import BlockManager

BS = 4


def _prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def _admit_and_compute(bm: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocate a whole prompt and mark it computed, as a finished prefill would."""
    alloc = bm.allocate(seq_id, tokens)
    assert alloc is not None
    bm.commit(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return alloc.block_ids


# ------------------------------------------------------------------------------ scenarios


def test_shared_prefix_hits_and_refcounts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _admit_and_compute(bm, "a", _prompt(14))  # 3 full blocks + 2 tokens
    b_tokens = _prompt(8) + [100, 101, 102]  # shares 2 full blocks with a
    alloc = bm.allocate("b", b_tokens)
    assert alloc is not None
    assert alloc.num_cached_tokens == 2 * BS
    assert alloc.block_ids[:2] == a[:2] and not set(alloc.block_ids[2:]) & set(a)
    assert bm.refcount(a[0]) == bm.refcount(a[1]) == 2 and bm.refcount(a[2]) == 1
    assert (bm.queried_tokens, bm.hit_tokens) == (14 + 11, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 25)
    bm.check_invariants()
    assert bm.free("a") and bm.free("b")
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_whole_prompt_hit_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _admit_and_compute(bm, "a", _prompt(12))  # exactly 3 full blocks
    assert bm.match_prefix(_prompt(12)).num_cached_tokens == 8
    alloc = bm.allocate("b", _prompt(12))
    assert alloc is not None and alloc.num_cached_tokens == 8  # block 2 is recomputed into a new block
    assert alloc.block_ids[:2] == a[:2] and alloc.block_ids[2] != a[2]
    bm.commit("b", _prompt(12), 12)  # same hash as a's block 2: stays uncached, no overwrite
    assert bm.num_cached_blocks == 3
    bm.check_invariants()
    assert bm.match_prefix(_prompt(13)).block_ids == a  # one more token: all three blocks hit


def test_chunked_prefill_then_decode() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = _prompt(10)
    alloc = bm.allocate("s", tokens, num_new_tokens=3)
    assert alloc is not None and alloc.num_cached_tokens == 0 and len(alloc.block_ids) == 1
    bm.commit("s", tokens, 3)
    assert bm.num_cached_blocks == 0  # block 0 not full yet
    assert bm.num_new_blocks("s", 4) == 1
    assert len(bm.append_slots("s", 4) or []) == 1  # chunk 2: tokens 3..6
    assert bm.commit("s", tokens, 7) == 1
    assert len(bm.append_slots("s", 3) or []) == 1  # chunk 3: tokens 7..9, token 8 opens block 2
    assert bm.num_slots("s") == 10 and len(bm.block_ids("s")) == 3
    assert bm.commit("s", tokens, 10) == 1
    tokens += [42, 43]  # decode steps compute sampled tokens 10 and 11: still block 2
    assert bm.append_slots("s", 1) == [] and bm.append_slots("s", 1) == []
    bm.commit("s", tokens, 12)
    assert bm.num_cached_blocks == 3
    opened = bm.append_slots("s", 1)  # token 12 opens block 3
    assert opened is not None and len(opened) == 1 and bm.block_ids("s")[-1] == opened[0]
    bm.check_invariants()


def test_out_of_blocks_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate("a", _prompt(17)) is None  # 5 blocks
    assert bm.num_free_blocks == 4 and "a" not in bm
    alloc = bm.allocate("a", _prompt(12))
    assert alloc is not None and bm.num_free_blocks == 1
    assert bm.allocate("b", _prompt(8, base=50)) is None
    assert bm.append_slots("a", 5) is None  # 17 tokens need 5 blocks
    assert bm.num_slots("a") == 12 and len(bm.block_ids("a")) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(2) and bm.can_allocate(1)
    assert "b" not in bm
    bm.check_invariants()


def test_eviction_takes_unused_blocks_first_then_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = _admit_and_compute(bm, "old", _prompt(8, base=0))  # 2 cached blocks
    new = _admit_and_compute(bm, "new", _prompt(8, base=100))  # 2 cached blocks
    bm.free("old")
    bm.free("new")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # 2 never-cached blocks go first, then old's tail block, then old's head, then new's tail.
    got = bm.allocate("x", _prompt(17, base=500))
    assert got is not None
    assert got.block_ids[2:] == [old[1], old[0], new[1]]
    assert bm.num_evictions == 3
    assert bm.match_prefix(_prompt(9, base=0)).num_cached_tokens == 0
    assert bm.match_prefix(_prompt(9, base=100)).block_ids == [new[0]]  # head outlives its tail
    bm.check_invariants()


def test_prefix_hit_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = _admit_and_compute(bm, "a", _prompt(4, base=0))
    b = _admit_and_compute(bm, "b", _prompt(4, base=10))
    bm.free("a")
    bm.free("b")
    hit = bm.allocate("a2", _prompt(5, base=0))  # touches a's block: now b's is least recently freed
    assert hit is not None and hit.block_ids[0] == a[0]
    bm.free("a2")
    got = bm.allocate("x", _prompt(12, base=900))
    assert got is not None and got.block_ids[2] == b[0]
    bm.check_invariants()


def test_pinned_blocks_survive_free_until_unpin() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    blocks = bm.allocate("p", _prompt(8))
    assert blocks is not None
    assert bm.pin("p", "xfer-1") == "xfer-1"
    with pytest.raises(ValueError):
        bm.pin("p", "xfer-1")
    assert bm.free("p")  # abort while the migration still reads
    bm.check_invariants()
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(0.5)
    assert bm.allocate("q", _prompt(12, base=40)) is None  # pinned blocks are not handed out
    other = bm.allocate("q", _prompt(8, base=40))
    assert other is not None and not set(other.block_ids) & set(blocks.block_ids)
    bm.free("q")
    assert bm.unpin("xfer-1") and not bm.unpin("xfer-1")
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_free_and_unpin_of_unknown_ids_are_harmless() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    assert not bm.free("nope") and not bm.unpin("nope")
    with pytest.raises(KeyError):
        bm.pin("nope")
    with pytest.raises(ValueError):
        bm.allocate("e", [])
    bm.check_invariants()


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    _admit_and_compute(bm, "gone", _prompt(8))
    bm.free("gone")
    live = _prompt(6, base=30)
    assert bm.allocate("live", live) is not None
    bm.commit("live", live, 4)
    assert bm.reset_prefix_cache() == 3
    assert bm.num_cached_blocks == 0 and bm.match_prefix(_prompt(9)).num_cached_tokens == 0
    assert bm.append_slots("live", 2) == []
    bm.commit("live", live + [1, 2], 8)  # computed (partly) before the reset: must not be cached
    assert bm.num_cached_blocks == 0
    bm.check_invariants()
    bm.free("live")
    assert bm.num_free_blocks == 8


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    _admit_and_compute(bm, "a", _prompt(9))
    alloc = bm.allocate("b", _prompt(9))
    assert alloc is not None and alloc.num_cached_tokens == 0
    assert bm.num_cached_blocks == 0 and bm.queried_tokens == 0
    bm.check_invariants()


# -------------------------------------------------------------------------- state machine


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / step / preempt / finish / pin / unpin / reset against a content model."""

    seqs = Bundle("seqs")
    pins = Bundle("pins")

    @initialize(num_blocks=st.integers(4, 16), caching=st.sampled_from([True, False]), snapshots=st.integers(0, 3))
    def setup(self, num_blocks: int, caching: bool, snapshots: int = 0) -> None:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching, num_state_snapshots=snapshots)
        self.state: dict[int, tuple[int, ...]] = {}  # snapshot slot -> token prefix its saved state was computed for
        self.saves: dict[str, list[tuple[int, int]]] = {}  # seq -> (position, slot) where the worker saves its state
        self.state_hits = 0
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # block -> token prefix its KV was computed for
        self.pinned: dict[str, list[int]] = {}
        self.pinned_content: dict[str, dict[int, tuple[int, ...]]] = {}
        self.counter = 0
        self.did_reset = False

    def _record(self, seq_id: str, start: int, end: int) -> None:
        """Tokens start..end of seq_id were computed: write the model's KV content of their blocks."""
        table, toks = self.bm.block_ids(seq_id), self.tokens[seq_id]
        for i in range(start // BS, -(-end // BS)):
            self.content[table[i]] = tuple(toks[: min((i + 1) * BS, end)])

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(
        target=seqs,
        family=st.integers(0, 1),
        length=st.integers(1, 14),
        tail=st.integers(0, 3),
        chunk=st.none() | st.integers(1, 9),
    )
    def admit(self, family: int, length: int, tail: int, chunk: int | None) -> object:
        # Prompts of one family share their head (tokens 0..), so prefix hits happen often.
        tokens = [family * 1000 + i for i in range(length)] + [7] * tail
        seq_id = f"s{self.counter}"
        self.counter += 1
        expected = self.bm.match_prefix(tokens)
        free_before = self.bm.num_free_blocks
        alloc = self.bm.allocate(seq_id, tokens, chunk)
        if alloc is None:
            assert self.bm.num_free_blocks == free_before and seq_id not in self.bm
            return multiple()
        assert alloc.num_cached_tokens == expected.num_cached_tokens
        assert alloc.block_ids[: len(expected.block_ids)] == expected.block_ids
        assert alloc.num_cached_tokens % BS == 0 and alloc.num_cached_tokens <= len(tokens) - 1
        for i, block in enumerate(alloc.block_ids[: alloc.num_cached_tokens // BS]):
            assert self.content.get(block) == tuple(tokens[: (i + 1) * BS]), "prefix hit on wrong KV"
        if self.bm.num_state_snapshots and alloc.num_cached_tokens:  # a hybrid model resumes from a saved state
            assert self.state.get(alloc.state_snapshot) == tuple(tokens[: alloc.num_cached_tokens]), "wrong state"
            self.state_hits += 1
        else:
            assert alloc.state_snapshot == -1
        for at in self.bm.snapshot_points(tokens, expected):
            slot = self.bm.reserve_snapshot(seq_id, at)
            if slot >= 0:
                self.saves.setdefault(seq_id, []).append((at, slot))
        for block in alloc.block_ids[alloc.num_cached_tokens // BS :]:
            self.content.pop(block, None)  # fresh: will be overwritten
        self.tokens[seq_id] = tokens
        self.computed[seq_id] = alloc.num_cached_tokens
        return seq_id

    @rule(seq_id=seqs, budget=st.integers(1, 8), sampled=st.integers(0, 3))
    def step(self, seq_id: str | None, budget: int, sampled: int) -> None:
        if seq_id not in self.tokens:
            return
        tokens, done = self.tokens[seq_id], self.computed[seq_id]
        if done == len(tokens):
            tokens.append(sampled)  # the previous step sampled a token; this step computes it
        new = min(budget, len(tokens) - done)
        at, slot = self.saves[seq_id][0] if self.saves.get(seq_id) else (0, -1)
        assert (at, slot) == (self.bm.snapshot_after(seq_id, done) or (0, -1))
        if done < at < done + new:
            new = at - done  # the chunk ends where the state is saved
        before = self.bm.block_ids(seq_id)
        appended = self.bm.append_slots(seq_id, max(0, done + new - self.bm.num_slots(seq_id)))
        if appended is None:
            assert self.bm.block_ids(seq_id) == before
            self._finish(seq_id)  # preempt by recompute
            return
        for block in appended:
            self.content.pop(block, None)
        self._record(seq_id, done, done + new)
        self.computed[seq_id] = done + new
        if done + new == at:  # the worker saves the state after the step
            self.state[slot] = tuple(tokens[:at])
            self.saves[seq_id].pop(0)
        self.bm.commit(seq_id, tokens, done + new)

    def _finish(self, seq_id: str) -> None:
        assert self.bm.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]
        self.saves.pop(seq_id, None)

    @rule(seq_id=seqs)
    def finish(self, seq_id: str | None) -> None:
        if seq_id in self.tokens:
            self._finish(seq_id)

    @precondition(lambda self: len(self.pinned) < 2)
    @rule(target=pins, seq_id=seqs)
    def pin(self, seq_id: str | None) -> str | None:
        if seq_id not in self.tokens:
            return None
        pin_id = f"pin{self.counter}"
        self.counter += 1
        self.bm.pin(seq_id, pin_id)
        blocks = self.bm.block_ids(seq_id)
        self.pinned[pin_id] = blocks
        # Blocks full at pin time never change while pinned: the transfer reads stable KV.
        full = blocks[: self.computed[seq_id] // BS]
        self.pinned_content[pin_id] = {b: self.content[b] for b in full}
        return pin_id

    @rule(pin_id=consumes(pins))
    def unpin(self, pin_id: str | None) -> None:
        if pin_id is not None:
            self.pinned.pop(pin_id)
            snapshot = self.pinned_content.pop(pin_id)
            assert all(self.content.get(b) == kv for b, kv in snapshot.items()), "pinned KV was reused"
            assert self.bm.unpin(pin_id)

    @precondition(lambda self: not self.did_reset and self.counter > 8)
    @rule()
    def reset(self) -> None:
        self.did_reset = True  # at most once per run: a reset wipes the cache the other rules build up
        self.bm.reset_prefix_cache()
        assert self.bm.num_cached_blocks == 0

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_invariants()
            pinned = {b for blocks in self.pinned.values() for b in blocks}
            assert all(self.bm.refcount(b) > 0 for b in pinned)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.tokens):
            self._finish(seq_id)
        for pin_id in list(self.pinned):
            assert self.bm.unpin(pin_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.usage == 0.0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


@pytest.mark.parametrize("seed,snapshots", [(0, 0), (1, 0), (2, 0), (3, 2), (4, 3)])
def test_long_scheduler_like_runs(seed: int, snapshots: int) -> None:
    """Long runs of the same rules (hypothesis favours short ones): many hits, evictions, preemptions (and with
    state snapshots, hits that resume a recurrent state)."""
    rng = random.Random(seed)
    machine = BlockManagerMachine()
    machine.setup(num_blocks=rng.randint(8, 20), caching=True, snapshots=snapshots)
    live: list[str] = []
    pins: list[str] = []
    for _ in range(1500):
        live = [s for s in live if s in machine.tokens]
        roll = rng.random()
        if roll < 0.25 and len(live) < 5:
            chunk = rng.choice([None, rng.randint(1, 9)])
            seq_id = machine.admit(rng.randint(0, 2), rng.randint(1, 16), rng.randint(0, 3), chunk)
            if isinstance(seq_id, str):
                live.append(seq_id)
        elif roll < 0.8 and live:
            machine.step(rng.choice(live), rng.randint(1, 8), rng.randint(0, 3))
        elif roll < 0.9 and live:
            machine.finish(rng.choice(live))
        elif roll < 0.95 and live and len(pins) < 2:
            pins.append(machine.pin(rng.choice(live)))
        elif pins:
            machine.unpin(pins.pop(rng.randrange(len(pins))))
        machine.consistent()
    bm = machine.bm
    assert bm.hit_tokens > 0 and bm.num_evictions > 0
    assert (machine.state_hits > 0) == (snapshots > 0)
    machine.teardown()


def test_a_hybrid_models_prefix_hit_ends_where_a_state_snapshot_was_taken():
    bm = BlockManager(16, BS, num_state_snapshots=2)
    first = _prompt(11)  # blocks [0-3] [4-7], then 8, 9, 10: the state is saved at 8
    hit = bm.match_prefix(first)
    assert bm.snapshot_points(first, hit) == [8]
    assert bm.allocate("a", first, num_new_tokens=8).num_cached_tokens == 0
    assert bm.reserve_snapshot("a", 8) == 0 and bm.snapshot_after("a", 0) == (8, 0)
    bm.commit("a", first, 8)  # the chunk that ends at 8 is back: its state is saved, the hit may resume it
    assert bm.snapshot_after("a", 0) is None
    bm.append_slots("a", 3)
    bm.commit("a", first, 11)
    # a longer prompt with the same head: its blocks [0-3] [4-7] are cached and the state after 8 is there
    second = _prompt(22)
    hit = bm.match_prefix(second)
    assert (hit.num_cached_tokens, hit.state_snapshot, hit.num_shared_tokens) == (8, 0, 8)
    assert bm.snapshot_points(second, hit) == [20]
    bm.free("a")
    # a prompt that shares only the first block: cached, not resumable; its state is worth saving there
    third = _prompt(4) + [99] * 9
    hit = bm.match_prefix(third)
    assert (hit.num_cached_tokens, hit.num_shared_tokens) == (0, 4)
    assert bm.snapshot_points(third, hit) == [4, 12]
    bm.allocate("c", third, num_new_tokens=4)
    assert [bm.reserve_snapshot("c", at) for at in (4, 12)] == [1, 0]  # the second evicts the state after 8
    assert bm.match_prefix(second).num_cached_tokens == 0 and bm.num_cached_blocks == 2
    bm.commit("c", third, 4)
    assert bm.match_prefix(second).num_cached_tokens == 4  # resumes the state after 4 now
    bm.check_invariants()
    bm.free("c")  # before its second save: that slot is free again
    assert bm.match_prefix(third).num_cached_tokens == 4
    bm.check_invariants()


def test_a_state_snapshot_goes_with_the_evicted_block_it_ends():
    bm = BlockManager(3, BS, num_state_snapshots=2)
    tokens = _prompt(9)
    bm.allocate("a", tokens, num_new_tokens=8)
    assert bm.reserve_snapshot("a", 8) >= 0
    bm.commit("a", tokens, 8)
    bm.free("a")
    assert bm.match_prefix(tokens).num_cached_tokens == 8
    assert bm.allocate("b", _prompt(9, base=100)) is not None  # takes all three blocks: the cached ones evicted
    assert bm.match_prefix(tokens).num_cached_tokens == 0
    bm.check_invariants()  # (the snapshot's slot is free again)
