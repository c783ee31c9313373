"""N-gram (prompt lookup) proposer: hand-made cases, a brute-force reference, incremental updates, cost."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.speculative.ngram import OCCURRENCES_SCANNED_PER_CANDIDATE, NgramProposer


# ----------------------------------------------------------------------------- brute-force reference
def earlier_ends_reference(tokens, min_n, max_n):
    """(n, ends) for the largest n whose suffix also ends at an earlier position, ends most recent first."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        ends = [e for e in range(length - 1, n - 1, -1) if tokens[e - n : e] == tokens[length - n :]]
        if ends:
            return n, ends
    return None, []


def propose_reference(tokens, min_n, max_n, k):
    _, ends = earlier_ends_reference(tokens, min_n, max_n)
    return tokens[ends[0] : ends[0] + k] if ends else []


def propose_tree_reference(tokens, min_n, max_n, k, max_candidates, budget):
    """The same trie, built from root-to-node paths: a node is the tuple of tokens on its path."""
    _, ends = earlier_ends_reference(tokens, min_n, max_n)
    node_of_path = {}
    paths = []
    num_candidates = 0
    for end in ends[: max_candidates * OCCURRENCES_SCANNED_PER_CANDIDATE]:
        if len(paths) == budget:
            break
        continuation = tuple(tokens[end : end + k])
        prefixes = [continuation[:d] for d in range(1, len(continuation) + 1)]
        new_prefixes = [p for p in prefixes if p not in node_of_path][: budget - len(paths)]
        for prefix in new_prefixes:
            node_of_path[prefix] = len(paths)
            paths.append(prefix)
        num_candidates += bool(new_prefixes)
        if num_candidates == max_candidates:
            break
    node_tokens = [path[-1] for path in paths]
    parents = [node_of_path[path[:-1]] if len(path) > 1 else -1 for path in paths]
    return node_tokens, parents


def check_tree_structure(tokens, parents, budget, depth):
    assert len(tokens) == len(parents) <= budget
    node_depth = []
    seen_children = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        assert -1 <= parent < i
        assert (parent, token) not in seen_children, "two children of one node carry the same token"
        seen_children.add((parent, token))
        node_depth.append(1 if parent == -1 else node_depth[parent] + 1)
    assert max(node_depth, default=0) <= depth


def path_to(node, tokens, parents):
    path = []
    while node != -1:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


# ----------------------------------------------------------------------------- hand-made cases
def test_match_at_max_n():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=4)
    index = proposer.new_index([1, 2, 3, 4, 9, 1, 2, 3, 4])
    assert proposer.chain(index) == [9, 1, 2]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=3)
    # [1, 2, 3] occurred at the start (then 10); only [3] occurred more recently (then 11).
    index = proposer.new_index([1, 2, 3, 10, 9, 3, 11, 1, 2, 3])
    assert proposer.chain(index) == [10, 9]


def test_fallback_to_smaller_n():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=4)
    index = proposer.new_index([5, 2, 3, 7, 8, 1, 2, 3])  # [8,1,2,3] and [1,2,3] are new, [2,3] is not
    assert proposer.chain(index) == [7, 8, 1]


def test_no_match_gives_empty():
    proposer = NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=4)
    for prompt in ([], [7], [1, 2, 3, 4]):
        index = proposer.new_index(prompt)
        assert proposer.chain(index) == []
        assert proposer.tree(index, budget=8) == ([], [])


def test_min_n_is_respected():
    index_tokens = [1, 5, 2, 1]  # only the 1-gram [1] recurs
    assert NgramProposer(2, prompt_lookup_min=1).chain(NgramProposer(2).new_index(index_tokens)) == [5, 2]
    proposer = NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.chain(proposer.new_index(index_tokens)) == []


def test_continuation_runs_into_the_suffix_and_stops_at_the_end():
    proposer = NgramProposer(5, prompt_lookup_min=1, prompt_lookup_max=2)
    assert proposer.chain(proposer.new_index([1, 2, 1, 2])) == [1, 2]
    assert proposer.chain(proposer.new_index([7, 7, 7])) == [7]  # [7,7] also ends at 2 (overlapping)


def test_k_limits():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=2)
    index = proposer.new_index([1, 2, 3, 4, 5, 6, 1, 2])
    assert proposer.chain(index) == [3, 4, 5]  # default k = num_speculative_tokens
    assert proposer.chain(index, k=0) == []
    assert proposer.chain(index, k=1) == [3]
    assert proposer.chain(index, k=5) == [3, 4, 5, 6, 1]
    assert proposer.chain(index, k=100) == [3, 4, 5, 6, 1, 2]
    with pytest.raises(ValueError, match="k"):
        proposer.chain(index, k=-1)


def test_repeated_pattern_picks_the_most_recent_occurrence():
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=1)
    assert proposer.chain(proposer.new_index([1, 5, 1, 6, 1, 7, 1])) == [7, 1]
    proposer = NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.chain(proposer.new_index([1, 2, 8, 1, 2, 9, 0, 1, 2])) == [9, 0]


def test_extend_updates_the_proposal():
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=3)
    index = proposer.new_index([4, 5, 6, 7, 8])
    assert proposer.chain(index) == []
    index.extend([4, 5])
    assert index.tokens == [4, 5, 6, 7, 8, 4, 5]
    assert len(index.tokens) == 7
    assert proposer.chain(index) == [6, 7]
    index.extend([9])
    assert proposer.chain(index) == []


def test_tree_merges_continuations_most_recent_first():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=1, max_candidates=3)
    # [1] was followed by [5,6,1] (oldest), [7,8,1], [5,9,1] (most recent).
    index = proposer.new_index([1, 5, 6, 1, 7, 8, 1, 5, 9, 1])
    tokens, parents = proposer.tree(index, budget=16)
    assert tokens == [5, 9, 1, 7, 8, 1, 6, 1]
    assert parents == [-1, 0, 1, -1, 3, 4, 0, 6]  # [5, 6, 1] shares the node 5 with [5, 9, 1]
    assert proposer.tree(index, budget=5) == ([5, 9, 1, 7, 8], [-1, 0, 1, -1, 3])
    assert proposer.tree(index, budget=0) == ([], [])
    two = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=1, max_candidates=2)
    assert two.tree(index, budget=16) == ([5, 9, 1, 7, 8, 1], [-1, 0, 1, -1, 3, 4])
    with pytest.raises(ValueError, match="budget"):
        proposer.tree(index, budget=-1)


def test_tree_skips_continuations_already_in_the_trie():
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=1, max_candidates=2)
    # [1] was followed by [5,2], [5,2], [5,2], then [6,2] (oldest): the copies add nothing.
    index = proposer.new_index([1, 6, 2, 1, 5, 2, 1, 5, 2, 1, 5, 2, 1])
    assert proposer.tree(index, budget=10) == ([5, 2, 6, 2], [-1, 0, -1, 2])


def test_tree_with_one_candidate_is_the_chain_of_propose():
    proposer = NgramProposer(4, prompt_lookup_min=1, prompt_lookup_max=3)
    index = proposer.new_index([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 1, 4, 1])
    chain = proposer.chain(index)
    assert chain == [5, 9, 2, 6]
    assert proposer.tree(index, budget=10) == (chain, [-1, 0, 1, 2])
    assert proposer.tree(index, budget=2) == (chain[:2], [-1, 0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
        (dict(num_speculative_tokens=2, max_candidates=0), "max_candidates"),
    ],
)
def test_validation_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NgramProposer(**kwargs)


# ----------------------------------------------------------------------------- against the reference
@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    k=st.integers(1, 6),
    max_candidates=st.integers(1, 4),
    budget=st.integers(0, 20),
)
def test_matches_brute_force_reference(tokens, min_n, extra_n, k, max_candidates, budget):
    max_n = min_n + extra_n
    proposer = NgramProposer(k, min_n, max_n, max_candidates)
    index = proposer.new_index(tokens)
    assert proposer.chain(index) == propose_reference(tokens, min_n, max_n, k)

    tree_tokens, parents = proposer.tree(index, budget)
    assert (tree_tokens, parents) == propose_tree_reference(tokens, min_n, max_n, k, max_candidates, budget)
    check_tree_structure(tree_tokens, parents, budget, depth=k)
    n, ends = earlier_ends_reference(tokens, min_n, max_n)
    continuations = [tokens[end : end + k] for end in ends]
    for node in range(len(tree_tokens)):  # every root-to-node path starts a real continuation
        path = path_to(node, tree_tokens, parents)
        assert any(c[: len(path)] == path for c in continuations)
    chain = proposer.chain(index)  # the most recent continuation is inserted first
    assert tree_tokens[: min(len(chain), budget)] == chain[:budget]


def test_long_runs_match_the_reference():
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.choice([0, 0, 0, 1, 2]) for _ in range(rng.randint(50, 400))]
        proposer = NgramProposer(rng.randint(1, 8), rng.randint(1, 3), rng.randint(3, 6), rng.randint(1, 4))
        index = proposer.new_index(tokens)
        args = (proposer.prompt_lookup_min, proposer.prompt_lookup_max, proposer.num_speculative_tokens)
        assert proposer.chain(index) == propose_reference(tokens, *args)
        assert proposer.tree(index, 24) == propose_tree_reference(
            tokens, *args, proposer.max_candidates, 24
        )


# ----------------------------------------------------------------------------- incremental updates
def test_extend_incrementally_equals_building_from_scratch():
    rng = random.Random(1)
    for _ in range(30):
        proposer = NgramProposer(rng.randint(1, 6), rng.randint(1, 2), rng.randint(2, 5), rng.randint(1, 3))
        tokens = [rng.randrange(5) for _ in range(rng.randint(0, 150))]
        prompt_len = rng.randint(0, len(tokens))
        index = proposer.new_index(tokens[:prompt_len])
        position = prompt_len
        while position < len(tokens):
            chunk = tokens[position : position + rng.randint(1, 5)]
            index.extend(chunk)
            position += len(chunk)
            fresh = proposer.new_index(tokens[:position])
            assert index.tokens == fresh.tokens
            assert index.ends == fresh.ends
            assert proposer.chain(index) == proposer.chain(fresh)
            assert proposer.tree(index, 12) == proposer.tree(fresh, 12)


# ----------------------------------------------------------------------------- cost
def fastest_seconds_per_call(fns, calls=200, rounds=40):
    """The best per-call time of each fn, over short batches run in turns (robust to a busy machine)."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best


def test_propose_cost_does_not_grow_with_sequence_length():
    rng = random.Random(3)
    proposer = NgramProposer(8, prompt_lookup_min=1, prompt_lookup_max=4, max_candidates=4)
    calls = {}
    for length in (1_000, 64_000):
        random_tokens = [rng.randrange(1000) for _ in range(length)]
        index = proposer.new_index(random_tokens + random_tokens[10:14])  # the suffix matches at n = 4
        # The suffix recurs length / 10 times, always with the same continuation: the tree proposal
        # must not look at every occurrence to find out that they add nothing.
        periodic = proposer.new_index(list(range(10)) * (length // 10))
        calls[length] = [
            lambda index=index: proposer.chain(index),
            lambda index=index: proposer.tree(index, 32),
            lambda periodic=periodic: proposer.tree(periodic, 32),
        ]
    seconds = fastest_seconds_per_call(calls[1_000] + calls[64_000])
    short, long = seconds[:3], seconds[3:]
    for short_seconds, long_seconds in zip(short, long):
        assert long_seconds / short_seconds < 5, (short, long)


def test_the_policy_sees_the_nodes_a_proposal_has_with_their_chances():
    """The engine's proposer ranks what it found: a chain of 2 tokens is 2 nodes (alpha, alpha^2), not k; a trie's
    nodes come best first (trie_chances), each parent before its children."""
    from types import SimpleNamespace

    from nanospec.speculative.policy import CHAIN_PRIOR as a
    chain, tree = NgramProposer(5, 1, 2), NgramProposer(3, 1, 1, max_candidates=3)
    seq = SimpleNamespace(token_ids=[1, 2, 3, 9, 8, 1, 2, 3, 7, 3], spec_state=None)
    chain.start(seq)  # "3" ends at 2 (then 9, 8), at 7 (then 7, 3) and last: the chain is [7, 3]
    assert chain.rank([seq], [5]) == [[(pytest.approx(a), 1), (pytest.approx(a * a), 2)]]
    tree.start(seq)
    (proposal,) = tree.propose([seq], [3])
    assert proposal.chances == sorted(proposal.chances, reverse=True)
    assert all(p < i for i, p in enumerate(proposal.parents))
    assert proposal.token_ids == [7, 3, 9, 8, 1]  # [7, 3], then the older [9, 8, 1]
    assert proposal.chances == pytest.approx([a, a * a, a * (1 - a), a * a * (1 - a), a ** 3 * (1 - a)])
