"""The KV block pool: allocation, reference counts, prefix reuse, LRU eviction, and (Hypothesis) that no
sequence of arrivals, growth, finishes, cancellations and preemptions leaks a block."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from redline.engine.blocks import ROOT, BlockPool, BlockTable, OutOfBlocks, block_key


def test_allocation_takes_all_or_nothing_and_release_returns_blocks():
    pool = BlockPool(4, block_size=16)
    table = BlockTable(pool)
    table.ensure(33)  # positions 0..32: 3 blocks
    assert len(table.blocks) == 3 and table.capacity == 48 and pool.available == 1
    with pytest.raises(OutOfBlocks, match="2 KV blocks wanted, 1 available of 4"):
        table.ensure(80)
    assert len(table.blocks) == 3 and pool.available == 1  # nothing taken
    table.release()
    assert pool.available == 4 and pool.refs == [0, 0, 0, 0]


def test_a_shared_prompt_prefix_is_reused_block_by_block():
    """Blocks of 16: a 40-token prompt caches its 2 full blocks. A prompt sharing its first 35 tokens
    reuses both (32 tokens), one sharing 20 reuses the first, and a 32-token prompt equal to the cached
    blocks reuses only the first: its last token must still be computed for the first new token."""
    pool = BlockPool(16, block_size=16)
    prompt = list(range(100, 140))
    first = BlockTable(pool)
    assert first.reuse_prefix(prompt) == 0
    first.count_lookup(prompt)
    first.ensure(len(prompt) + 4)
    first.cache_prompt(prompt)
    assert pool.stats.queries == 32 and pool.stats.hits == 0
    same35 = BlockTable(pool)
    assert same35.reuse_prefix(prompt[:35] + [7] * 10) == 32
    assert same35.blocks == first.blocks[:2] and pool.refs[first.blocks[0]] == 2
    same20 = BlockTable(pool)
    assert same20.reuse_prefix(prompt[:20] + [7] * 20) == 16
    exact = BlockTable(pool)
    assert exact.reuse_prefix(prompt[:32]) == 16
    assert exact.keys == [block_key(ROOT, prompt[:16])]
    for table, looked_up in ((same35, prompt[:35] + [7] * 10), (same20, prompt[:20] + [7] * 20)):
        table.count_lookup(looked_up)
    assert pool.stats.queries == 32 + 32 + 32 and pool.stats.hits == 32 + 16


def test_with_a_draft_a_block_is_keyed_with_the_token_after_it():
    """key_lookahead 1 (EAGLE-3: the draft's last row of a block read the next token): a 40-token prompt
    caches blocks 0 and 1 under (tokens 0..16) and (tokens 16..32). A prompt equal for 32 tokens but not
    the 33rd reuses block 0 only; one equal for 33 reuses both. A 32-token prompt plus its first new token
    caches both blocks; without that token only the first has a key."""
    pool = BlockPool(16, block_size=16, key_lookahead=1)
    prompt = list(range(100, 140))
    first = BlockTable(pool)
    first.ensure(len(prompt))
    first.cache_prompt(prompt)
    assert first.keys == pool.keys(prompt, 2) and first.keys[0] == block_key(ROOT, prompt[:17])
    assert BlockTable(pool).reuse_prefix(prompt[:32] + [7] * 8) == 16
    assert BlockTable(pool).reuse_prefix(prompt[:33] + [7] * 7) == 32
    short = BlockTable(pool)
    short.ensure(32)
    short.cache_prompt(list(range(32)))
    assert len(short.keys) == 1
    short.release()
    short.ensure(32)
    short.cache_prompt([*range(32), 5], computed=32)
    assert len(short.keys) == 2


def test_unreferenced_cached_blocks_are_evicted_least_recently_released_first():
    """4 blocks of 2: prompts [1, 2, 3] and [4, 5, 6] take 2 blocks each and cache their first. Released
    (b first), the pool hands out the two free blocks, then evicts b's cached block, the older; a's
    stays cached and is reused."""
    pool = BlockPool(4, block_size=2)
    a, b = BlockTable(pool), BlockTable(pool)
    for table, prompt in ((a, [1, 2, 3]), (b, [4, 5, 6])):
        table.ensure(len(prompt))
        table.cache_prompt(prompt)
    assert pool.available == 0
    (a0, a1), (b0, b1) = a.blocks, b.blocks
    b.release()
    a.release()
    assert pool.available == 4 and pool.stats.evictions == 0
    fresh = BlockTable(pool)
    fresh.ensure(6)
    assert fresh.blocks == [b1, a1, b0] and pool.stats.evictions == 1
    again = BlockTable(pool)
    assert again.reuse_prefix([1, 2, 3]) == 2 and again.blocks == [a0]
    assert BlockTable(pool).reuse_prefix([4, 5, 6]) == 0


def test_the_same_prefix_computed_twice_is_cached_once():
    pool = BlockPool(4, block_size=2)
    one, two = BlockTable(pool), BlockTable(pool)
    for table in (one, two):
        table.ensure(3)
        table.cache_prompt([9, 9, 9])
    assert len(pool.block_of) == 1 and pool.key_of == {one.blocks[0]: one.keys[0]}
    one.release()
    two.release()
    assert pool.available == 4 and len(pool.evictable) == 1


class PoolMachine(RuleBasedStateMachine):
    """Requests arrive (reusing cached prefixes), grow by decode steps, finish (caching their prompt),
    are cancelled, or are preempted (the newest running one) when the pool runs dry."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, block_size=4)
        self.running: list[tuple[BlockTable, list[int]]] = []

    def _make_room(self, table: BlockTable, positions: int) -> bool:
        """ensure(positions), preempting the newest other request while the pool is short; False when
        even alone it does not fit (the request itself is then preempted)."""
        while True:
            try:
                table.ensure(positions)
                return True
            except OutOfBlocks:
                others = [r for r in self.running if r[0] is not table]
                if not others:
                    return False
                victim = others[-1]
                victim[0].release()
                self.running.remove(victim)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=30), lookahead=st.integers(0, 4))
    def arrive(self, prompt, lookahead):
        table = BlockTable(self.pool)
        reused = table.reuse_prefix(prompt)
        assert reused < len(prompt) and reused % 4 == 0
        self.running.append((table, prompt))
        if self._make_room(table, len(prompt) + lookahead):
            table.cache_prompt(prompt)  # its prefill wrote the prompt's keys and values
        else:
            table.release()
            self.running.remove((table, prompt))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), tokens=st.integers(1, 6))
    def decode(self, which, tokens):
        table, prompt = self.running[which % len(self.running)]
        if not self._make_room(table, table.capacity + tokens):
            table.release()
            self.running.remove((table, prompt))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def end(self, which):  # finished, stopped or cancelled: the same release
        table, _ = self.running.pop(which % len(self.running))
        table.release()

    @invariant()
    def every_block_is_accounted_for(self):
        held = [b for table, _ in self.running for b in table.blocks]
        assert sum(self.pool.refs) == len(held)
        for block in range(self.pool.num_blocks):
            assert self.pool.refs[block] == held.count(block)
            idle = (block in self.pool.free) + (block in self.pool.evictable)
            assert idle == (self.pool.refs[block] == 0)
            assert not (block in self.pool.free and block in self.pool.key_of)
        assert all(self.pool.block_of[key] == b for b, key in self.pool.key_of.items())
        assert self.pool.available + len(set(held)) == self.pool.num_blocks

    def teardown(self):
        for table, _ in self.running:
            table.release()
        assert self.pool.available == self.pool.num_blocks and not any(self.pool.refs)


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_no_sequence_of_requests_leaks_a_block = PoolMachine.TestCase
