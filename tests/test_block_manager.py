"""Paged KV bookkeeping: random reserve / truncate / free never lose or double-own a block; with the prefix cache, a
stateful machine of requests (add / step / abort / preempt / finish) keeps every reference count and every block's
K/V right."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanospec.cache.block_manager import BlockManager, OutOfBlocks, slots_of


def free_block_ids(bm: BlockManager) -> list[int]:
    """The free blocks in the block manager's free heap, lowest first."""
    return sorted(b for b in bm._free_heap if bm.ref_counts[b] == 0 and bm.block_hashes[b] is None)


def check_invariant(bm: BlockManager, tables: list[list[int]]):
    """Reference counts equal the tables that hold each block; every block is exactly one of used, cached, free."""
    owned = [b for t in tables for b in t]
    free, cached = set(free_block_ids(bm)), set(bm.evictable)
    assert len(free) == len(free_block_ids(bm)), "a free block is listed twice"
    assert bm.ref_counts == [owned.count(b) for b in range(bm.num_blocks)], "a reference count is wrong"
    assert not set(owned) & (free | cached), "a block in a table is also free or cached"
    assert not free & cached, "a block is both free and cached"
    assert len(set(owned)) + len(cached) + len(free) == bm.num_blocks, "a block was lost"
    assert bm.num_free_blocks == len(free) + len(cached)
    for block in cached:
        assert bm.cached_blocks[bm.block_hashes[block]] == block, "a cached block cannot be found by its name"
    for name, block in bm.cached_blocks.items():
        assert bm.block_hashes[block] == name and block not in free


ops = st.lists(st.tuples(st.sampled_from(["reserve", "truncate", "free"]), st.integers(0, 5), st.integers(0, 70)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 4, 16]), ops=ops, consecutive=st.booleans())
def test_random_reserve_truncate_free_keep_every_block(num_blocks, block_size, ops, consecutive):
    bm = BlockManager(num_blocks, block_size, consecutive=consecutive)
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


@pytest.mark.parametrize("enable", [False, True])
def test_a_table_alone_keeps_consecutive_blocks_with_the_cache_too(enable):
    """The same, for a table whose full blocks are named every step (the cache does not take a returned tail)."""
    bm = BlockManager(32, 4, enable_prefix_caching=enable)
    tokens = list(range(200))
    table, length = [], 5
    bm.reserve(table, length)
    for accepted in [0, 3, 1, 0, 4, 2, 0, 0, 4, 1] * 3:
        bm.reserve(table, length + 1 + 9)
        length += 1 + accepted
        bm.truncate(table, length)
        bm.cache_full_blocks(table, tokens, length - 1)
        assert table == list(range(len(table))), table
    bm.free(table)
    assert bm.num_free_blocks == 32 and bm.num_cached_blocks == (bm.blocks_for(length) - 1 if enable else 0)


def test_consecutive_tables_grow_into_the_next_block_when_it_is_free():
    """With ``consecutive`` a table takes the block after its last before the lowest free one."""
    for consecutive, grown in ((False, [2, 0]), (True, [2, 3])):
        bm = BlockManager(8, 4, consecutive=consecutive)
        first, second, table = [], [], []
        for t in (first, second, table):
            bm.reserve(t, 4)
        bm.free(first)
        bm.reserve(table, 8)
        assert table == grown
        check_invariant(bm, [second, table])


def test_consecutive_tables_copy_a_cached_prefix_that_cannot_be_continued_in_place():
    """The cached prefix's next block is cached too (another request's continuation): the new table takes a run of
    free blocks and the prefix's K/V is copied there; the cached blocks stay cached. Where the blocks after the
    prefix are free, the prefix is shared in place."""
    bm = BlockManager(16, 2, enable_prefix_caching=True, consecutive=True)
    first = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks and one token
    table: list[int] = []
    bm.allocate(table, [], len(first), len(first))
    bm.cache_full_blocks(table, first, len(first) - 1)
    bm.free(table)
    assert table == [] and bm.num_cached_blocks == 3
    other: list[int] = []
    tokens = [1, 2, 3, 4, 9, 9, 9]
    prefix = bm.cached_prefix(tokens)
    assert prefix == [0, 1]  # block 2 (first's [5, 6]) is cached: no room to grow in place
    assert bm.allocate(other, prefix, len(tokens), len(tokens) + 2) == 4
    assert other == [3, 4, 5, 6, 7]
    assert bm.take_copies() == [(0, 3), (1, 4)] and bm.take_copies() == []
    assert bm.num_cached_blocks == 3 and bm.cached_prefix(first) == [0, 1, 2]
    assert bm.stats.hits == 4
    check_invariant(bm, [other])
    bm = BlockManager(16, 2, enable_prefix_caching=True, consecutive=True)
    table = []
    bm.allocate(table, [], 5, 5)  # two full blocks and one token
    bm.cache_full_blocks(table, first[:5], 4)
    bm.free(table)
    again: list[int] = []
    assert bm.allocate(again, bm.cached_prefix([1, 2, 3, 4, 8]), 5, 7) == 4
    assert again == [0, 1, 2, 3] and bm.take_copies() == [], "shared in place: the blocks after the prefix are free"
    check_invariant(bm, [again])


def test_consecutive_tables_grow_in_place_over_cached_blocks_when_no_run_is_free():
    """A pool too short for a run (its free blocks scattered): the cached blocks after the prefix are forgotten so
    that the new table grows in place; a block another table holds there leaves the prefix shared as it lies."""
    bm = BlockManager(8, 2, enable_prefix_caching=True, consecutive=True)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 4 full blocks and one token: blocks 0-4
    table: list[int] = []
    bm.allocate(table, [], len(first), len(first))
    holders = [[], [], []]
    for holder in holders:
        bm.reserve(holder, 1)  # blocks 5, 6, 7
    bm.cache_full_blocks(table, first, len(first) - 1)
    bm.free(table)
    bm.free(holders[1])  # block 6 free; blocks 0-3 cached, 4 free: no free run of 4
    other: list[int] = []
    assert bm.allocate(other, bm.cached_prefix([1, 2, 3, 4, 9, 9]), 6, 8) == 4
    assert other == [0, 1, 2, 3] and bm.take_copies() == [] and bm.cached_prefix(first) == [0, 1]
    check_invariant(bm, [other, holders[0], holders[2]])
    bm.free(other)
    held: list[int] = []
    bm.reserve(held, 1)
    assert held == [2]  # the lowest free block: the cache holds 0 and 1
    again: list[int] = []
    assert bm.allocate(again, bm.cached_prefix([1, 2, 3, 4, 9, 9]), 6, 8) == 4
    assert again[:2] == [0, 1] and 2 not in again and bm.take_copies() == []
    check_invariant(bm, [again, held, holders[0], holders[2]])


def test_consecutive_tables_grow_over_another_continuation_of_their_own_tokens():
    """A request repeats an earlier one's prompt in a pool with no free run: it takes the earlier blocks in place,
    then grows over the earlier answer's cached blocks, first a continuation of its own tokens (named after its last
    block), then blocks no lookup reaches any more (their parent's name is gone)."""
    bm = BlockManager(5, 2, enable_prefix_caching=True, consecutive=True)
    earlier: list[int] = []
    bm.allocate(earlier, [], 9, 9)  # [1, 2] [3, 4] [5, 6] [7, 8] [9]: blocks 0-4
    bm.cache_full_blocks(earlier, list(range(1, 10)), 8)
    bm.free(earlier)
    table: list[int] = []
    prompt = [1, 2, 3, 4]
    assert bm.allocate(table, bm.cached_prefix(prompt), 4, 4) == 2 and table == [0, 1] and not bm.take_copies()
    tokens = prompt + [50, 51, 52, 53, 54]  # its own answer
    bm.cache_full_blocks(table, tokens, 4)
    for length, grown in ((6, [0, 1, 2]), (8, [0, 1, 2, 3]), (9, [0, 1, 2, 3, 4])):
        bm.reserve(table, length)
        assert table == grown
        bm.cache_full_blocks(table, tokens, length - 1)
    check_invariant(bm, [table])


def test_consecutive_tables_leave_the_head_of_another_chain_cached():
    bm = BlockManager(8, 2, enable_prefix_caching=True, consecutive=True)
    table, other = [], []
    bm.allocate(table, [], 2, 2)                       # block 0
    bm.allocate(other, [], 5, 5)                       # blocks 1-3
    bm.cache_full_blocks(table, [1, 2], 2)
    bm.cache_full_blocks(other, [20, 21, 22, 23, 24], 4)
    bm.free(other)
    bm.reserve(table, 4)
    assert table == [0, 3] and bm.cached_prefix([20, 21, 22, 23, 24]) == [1, 2]
    check_invariant(bm, [table])


def test_a_prompt_takes_the_cached_blocks_of_its_start_but_never_its_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = list(range(10, 24))  # 14 tokens: 3 full blocks and 2 tokens
    table: list[int] = []
    assert bm.allocate(table, bm.cached_prefix(first), len(first), len(first)) == 0
    bm.cache_full_blocks(table, first, len(first) - 1)
    bm.free(table)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 16
    assert bm.cached_prefix(first) == table[:0] + bm.cached_prefix(first[:13]) and len(bm.cached_prefix(first)) == 3
    assert len(bm.cached_prefix(first[:12])) == 2, "12 tokens: the third block holds the last one, so it is computed"
    assert len(bm.cached_prefix(first[:13])) == 3
    assert bm.cached_prefix(first[:4] + [99] + first[5:]) == bm.cached_prefix(first)[:1], "a block that differs"
    assert bm.cached_prefix([99] + first[1:]) == [], "a different start: no later block matches, though equal"
    other: list[int] = []
    prefix = bm.cached_prefix(first + [1, 2])
    assert bm.allocate(other, prefix, 16, 17) == 12 and other[:3] == prefix and len(other) == 5
    assert bm.num_cached_blocks == 0 and bm.stats.queries == 14 + 16 and bm.stats.hits == 12


def test_cached_blocks_are_evicted_least_recently_used_first_and_tails_before_heads():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    tables = {}
    for name, tokens in (("a", a), ("b", b)):
        tables[name] = []
        bm.allocate(tables[name], bm.cached_prefix(tokens), len(tokens), len(tokens))
        bm.cache_full_blocks(tables[name], tokens, len(tokens) - 1)
    ta, tb = list(tables["a"]), list(tables["b"])
    bm.free(tables["a"])
    bm.free(tables["b"])
    assert list(bm.evictable) == [ta[1], ta[0], tb[1], tb[0]]  # a before b; each one's tail before its head
    new: list[int] = []
    bm.reserve(new, 2 * 4)  # the 2 free blocks (a's and b's partial third), then a's two
    assert sorted(new) == sorted([ta[2], tb[2], ta[1], ta[0]])
    assert bm.cached_prefix(a) == [] and bm.cached_prefix(b) == tb[:2]


def test_a_block_named_twice_is_shared_once_and_freed_as_a_plain_block():
    """Two tables that computed the same tokens side by side: the first name stays; the second block goes back
    free when its table ends."""
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    one, two = [], []
    bm.allocate(one, [], 5, 5)
    bm.allocate(two, [], 5, 5)
    bm.cache_full_blocks(one, tokens, 4)
    bm.cache_full_blocks(two, tokens, 4)
    assert bm.cached_prefix(tokens) == one[:2]
    bm.free(two)
    assert bm.num_cached_blocks == 0 and len(free_block_ids(bm)) == 8 - 3
    bm.free(one)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    check_invariant(bm, [])


def test_reset_forgets_cached_blocks_only_when_no_table_holds_one():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    table: list[int] = []
    bm.allocate(table, [], 5, 5)
    bm.cache_full_blocks(table, [1, 2, 3, 4, 5], 4)
    assert not bm.reset_prefix_cache() and bm.cached_blocks
    bm.free(table)
    assert bm.num_cached_blocks == 2 and bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and not bm.cached_blocks and bm.cached_prefix([1, 2, 3, 4, 5]) == []
    check_invariant(bm, [])


def test_without_the_cache_nothing_is_named_or_counted():
    bm = BlockManager(8, 2)
    table: list[int] = []
    bm.allocate(table, bm.cached_prefix([1, 2, 3, 4, 5]), 5, 5)
    bm.cache_full_blocks(table, [1, 2, 3, 4, 5], 4)
    bm.free(table)
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == [] and bm.num_cached_blocks == 0 and bm.stats.queries == 0


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests over a small pool and a tiny vocabulary (so that prompts share starts), driven as the scheduler
    and the engine drive them. A shadow of the K/V records, for every slot written, the tokens its K/V depends on
    (the sequence up to and including its token); a sequence's committed K/V must always read back as its own
    tokens, so a shared block that another request's guesses or rollback wrote would show. Writes go only to blocks
    that one table holds and that hold no name."""

    BLOCK, POOL, K = 2, 14, 3
    CONSECUTIVE = False

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed):
        self.bm = BlockManager(self.POOL, self.BLOCK, enable_prefix_caching=True, consecutive=self.CONSECUTIVE)
        self.rng = random.Random(seed)
        self.seqs: dict[int, dict] = {}  # id -> {"tokens", "table", "computed", "running"}
        self.shadow: dict[int, tuple] = {}
        self.next_id = 0

    def _write(self, seq: dict, start: int, tokens: list[int]) -> None:
        for i, token in enumerate(tokens, start):
            block = seq["table"][i // self.BLOCK]
            assert self.bm.ref_counts[block] == 1 and self.bm.block_hashes[block] is None, "a shared block written"
            slot = slots_of(seq["table"], self.BLOCK, [i])[0]
            self.shadow[slot] = tuple(seq["tokens"][:start] + tokens[:i - start + 1])

    @rule(base=st.sampled_from([[1, 2, 1, 2, 3], [1, 2, 1, 3], [2, 2, 2, 2, 2, 2]]), cut=st.integers(1, 6),
          tail=st.lists(st.integers(1, 3), max_size=3))
    def add(self, base, cut, tail):
        self.seqs[self.next_id] = {"tokens": base[:cut] + tail, "table": [], "computed": 0, "running": False}
        self.next_id += 1

    @rule()
    def step(self):
        """Admit what fits (taking cached starts), then one forward for every running sequence: its uncached tokens
        and K guesses written, some accepted, a new token, a rollback; the newly full committed blocks named."""
        for seq in self.seqs.values():
            if seq["running"]:
                continue
            need = len(seq["tokens"]) + self.K
            prefix = self.bm.cached_prefix(seq["tokens"])
            if self.bm.can_allocate(prefix, need):
                seq["computed"] = self.bm.allocate(seq["table"], prefix, len(seq["tokens"]), need)
                seq["running"] = True
                assert seq["computed"] < len(seq["tokens"]), "the last token is always computed"
        copies = [(src * self.BLOCK + i, dst * self.BLOCK + i) for src, dst in self.bm.take_copies()
                  for i in range(self.BLOCK)]
        copied = {dst: self.shadow.get(src) for src, dst in copies}  # every read before any write
        for dst, value in copied.items():
            assert self.bm.ref_counts[dst // self.BLOCK] == 1, "a copy into a shared block"
            self.shadow[dst] = value
        for seq in self.seqs.values():
            if not seq["running"]:
                continue
            n = len(seq["tokens"])
            if not self.bm.can_reserve(seq["table"], n + self.K):
                continue
            self.bm.reserve(seq["table"], n + self.K)
            guesses = [self.rng.randint(1, 3) for _ in range(self.K)]
            self._write(seq, seq["computed"], seq["tokens"][seq["computed"]:] + guesses)
            accepted = self.rng.randint(0, self.K)
            seq["tokens"] += guesses[:accepted] + [self.rng.randint(1, 3)]
            seq["computed"] = n + accepted
            self.bm.truncate(seq["table"], len(seq["tokens"]))
            self.bm.cache_full_blocks(seq["table"], seq["tokens"], seq["computed"])

    def _pick(self, index: int, running: bool | None = None) -> int | None:
        ids = [i for i, s in self.seqs.items() if running is None or s["running"] == running]
        return ids[index % len(ids)] if ids else None

    @rule(index=st.integers(0, 10))
    def preempt(self, index):
        seq_id = self._pick(index, running=True)
        if seq_id is not None:
            seq = self.seqs[seq_id]
            self.bm.free(seq["table"])
            seq["computed"], seq["running"] = 0, False

    @rule(index=st.integers(0, 10))
    def abort(self, index):
        seq_id = self._pick(index)
        if seq_id is not None:
            self.bm.free(self.seqs.pop(seq_id)["table"])

    @rule(index=st.integers(0, 10))
    def finish(self, index):
        seq_id = self._pick(index, running=True)
        if seq_id is not None:
            seq = self.seqs.pop(seq_id)
            self.bm.free(seq["table"])

    @precondition(lambda self: hasattr(self, "bm"))
    @invariant()
    def blocks_are_accounted_for_and_kv_reads_back(self):
        check_invariant(self.bm, [s["table"] for s in self.seqs.values()])
        for seq in self.seqs.values():
            for i in range(seq["computed"]):
                slot = slots_of(seq["table"], self.BLOCK, [i])[0]
                assert self.shadow.get(slot) == tuple(seq["tokens"][:i + 1]), "a sequence's K/V was overwritten"

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in self.seqs.values():
                self.bm.free(seq["table"])
            check_invariant(self.bm, [])
            assert self.bm.num_free_blocks == self.POOL, "every block is free or cached at the end"


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class ConsecutivePrefixCacheMachine(PrefixCacheMachine):
    """The same with ``consecutive`` tables: a cached prefix placed by copy reads back as its own tokens too."""
    CONSECUTIVE = True


TestConsecutivePrefixCacheMachine = ConsecutivePrefixCacheMachine.TestCase
TestConsecutivePrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
