"""Paged KV bookkeeping: random reserve / truncate / free never lose or double-own a block."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.cache.block_manager import BlockManager, OutOfBlocks, slots_of


def check_invariant(bm: BlockManager, tables: list[list[int]]):
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not set(owned) & set(bm.free_block_ids), "an owned block is also free"
    assert len(owned) + bm.num_free_blocks == bm.num_blocks, "a block was lost"
    assert len(set(bm.free_block_ids)) == bm.num_free_blocks, "a free block is listed twice"


ops = st.lists(st.tuples(st.sampled_from(["reserve", "truncate", "free"]), st.integers(0, 5), st.integers(0, 70)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_random_reserve_truncate_free_keep_every_block(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    tables = [[] for _ in range(6)]
    lengths = [0] * 6
    for op, seq, n in ops:
        if op == "reserve":
            if bm.can_reserve(tables[seq], n):
                bm.reserve(tables[seq], n)
                lengths[seq] = max(lengths[seq], n)
                assert len(tables[seq]) == max(bm.blocks_for(n), len(tables[seq]))
            else:
                before = list(tables[seq])
                with pytest.raises(OutOfBlocks):
                    bm.reserve(tables[seq], n)
                assert tables[seq] == before
        elif op == "truncate":
            bm.truncate(tables[seq], n)
            assert len(tables[seq]) <= bm.blocks_for(n)
        else:
            bm.free(tables[seq])
            assert tables[seq] == []
        check_invariant(bm, tables)
    for t in tables:
        bm.free(t)
    assert bm.num_free_blocks == num_blocks


def test_slots_cross_block_boundaries():
    bm = BlockManager(8, 4)
    table = []
    bm.reserve(table, 3)
    other = []
    bm.reserve(other, 4)  # interleave so the first sequence's blocks are not contiguous
    bm.reserve(table, 9)
    assert len(table) == 3
    slots = slots_of(table, bm.block_size, range(9))
    assert slots == [table[i // 4] * 4 + i % 4 for i in range(9)]
    assert len(set(slots)) == 9


def test_truncate_keeps_partial_block_and_returns_whole_ones():
    bm = BlockManager(10, 4)
    table = []
    bm.reserve(table, 13)  # 4 blocks
    assert bm.num_free_blocks == 6
    bm.truncate(table, 5)  # tokens 0..4 need 2 blocks
    assert len(table) == 2 and bm.num_free_blocks == 8


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match=str(bad)):
        BlockManager(bad, 16)
    with pytest.raises(ValueError, match=str(bad)):
        BlockManager(4, bad)


def test_a_sequence_alone_keeps_consecutive_blocks_through_speculative_steps():
    """Each step reserves room for the guesses and truncates to what was accepted; the lowest free ids go out
    first, so the returned tail comes back and the table stays consecutive (the CPU attention reads one slice),
    also after other tables were freed in between."""
    bm = BlockManager(32, 4)
    warm = [[], []]
    bm.reserve(warm[0], 10)
    bm.reserve(warm[1], 10)
    bm.free(warm[1])
    bm.free(warm[0])  # freed in the other order than reserved: a FIFO free list would hand out 3, 4, 5, 0, ...
    table, length = [], 5
    bm.reserve(table, length)
    for accepted in [0, 3, 1, 0, 4, 2, 0, 0, 4, 1] * 3:
        bm.reserve(table, length + 1 + 9)   # the emitted token and 9 guesses
        length += 1 + accepted
        bm.truncate(table, length)
        assert table == list(range(len(table))), table
    assert len(table) == bm.blocks_for(length) > 10
