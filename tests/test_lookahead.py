"""Lookahead decoding state and step layout: masks by hand and by property, the window's Jacobi moves, the
n-gram pool, validation, and a full decode loop against toy deterministic targets."""

import random

import pytest
import torch

from nanospec.kernels.attention_mask import pack_mask, unpack_mask
from nanospec.speculative.proposal import tree_depths, tree_mask
from nanospec.speculative.lookahead import LookaheadDecoder


# ----------------------------------------------------------------------------- helpers
def dense(step):
    n = len(step.tokens)
    return unpack_mask(tree_mask(step.parents), n)


def full_parents(step):
    """Parent of each token read back from the mask: the visible token just before it (by position)."""
    visible = dense(step)
    parents = []
    for row in range(len(step.tokens)):
        seen = [b for b in range(len(step.tokens)) if visible[row, b] and b != row]
        parents.append(max(seen, key=lambda b: tree_depths(step.parents)[b]) if seen else -1)
    return parents


def causal_path(step, row, visible_rows=None):
    """Tokens that `row` sees, in position order; checks they are exactly one per position 0..pos(row)."""
    visible_rows = dense(step) if visible_rows is None else visible_rows
    visible = visible_rows[row].nonzero().flatten().tolist()
    visible.sort(key=lambda b: tree_depths(step.parents)[b])
    assert [tree_depths(step.parents)[b] for b in visible] == list(range(tree_depths(step.parents)[row] + 1))
    return [step.tokens[b] for b in visible]


def window_cells(state):
    """(level, column) of each lookahead row, in step order."""
    return [(level, column) for level, tokens in enumerate(state.levels)
            for column in range(1 if level == 0 else 0, len(tokens) + (1 if level == 0 else 0))]


def greedy_tree_walk(step, argmax):
    """Accepted path along the target's argmax plus the final emitted token."""
    children = {}
    for node, parent in enumerate(step.parents[:step.num_tree_nodes]):
        if parent >= 0:
            children[(parent, step.tokens[node])] = node
    node, accepted = 0, []
    while True:
        accepted.append(argmax[node])
        node = children.get((node, argmax[node]))
        if node is None:
            return accepted


def set_pool(decoder, state, entries):
    """Insert (key, continuation) pairs in order: the last one inserted is the most recent."""
    for key, continuation in entries:
        decoder._insert(state, key, tuple(continuation))


# ----------------------------------------------------------------------------- the step, by hand
def test_step_by_hand_w3_n3_g2():
    decoder = LookaheadDecoder(window_size=3, ngram_size=3, guess_set_size=2)
    # prompt 3-grams: (5,1,2) (1,2,5) (2,5,1) (5,1,3) -> pool[5] = [(1,3), (1,2)], most recent first
    state = decoder.new_state([5, 1, 2, 5, 1, 3])
    assert state.candidates(5) == [(1, 3), (1, 2)]
    state.levels = [[10, 11], [20, 21, 22]]  # level 0: columns 1, 2 (column 0 is the root); level 1: columns 0..2
    step = decoder.build_step(state, 5)

    assert step.tokens == [5, 1, 3, 2, 10, 11, 20, 21, 22]
    assert tree_depths(step.parents) == [0, 1, 2, 2, 1, 2, 1, 2, 3]
    assert step.parents[:step.num_tree_nodes] == [-1, 0, 1, 1]  # the shared prefix "1" appears once
    assert step.num_tree_nodes == 4
    assert step.lookahead_rows == range(4, 9)
    sees = {
        0: [0],              # root
        1: [0, 1],           # v: 1
        2: [0, 1, 2],        # v: 1 3
        3: [0, 1, 3],        # v: 1 2
        4: [0, 4],           # level 0 column 1
        5: [0, 4, 5],        # level 0 column 2
        6: [0, 6],           # level 1 column 0
        7: [0, 4, 7],        # level 1 column 1
        8: [0, 4, 5, 8],     # level 1 column 2
    }
    expected = torch.zeros(9, 9, dtype=torch.bool)
    for row, cols in sees.items():
        expected[row, cols] = True
    assert tree_mask(step.parents).dtype == torch.int64 and tree_mask(step.parents).shape == (9, 1)
    assert torch.equal(tree_mask(step.parents), pack_mask(expected))


def test_no_candidates_gives_root_only_tree():
    decoder = LookaheadDecoder(4, 4, 3, seed_pool_from_prompt=False)
    state = decoder.new_state([9, 9, 9])
    step = decoder.build_step(state, 7)
    assert step.num_tree_nodes == 1 and step.parents[:step.num_tree_nodes] == [-1]
    assert step.lookahead_rows == range(1, len(step.tokens))


# ----------------------------------------------------------------------------- the step, by property
@pytest.mark.parametrize("seed", range(30))
def test_step_structure_random(seed):
    rng = random.Random(seed)
    W, N, G = rng.randint(1, 6), rng.randint(3, 5), rng.randint(1, 4)
    decoder = LookaheadDecoder(W, N, G)
    state = decoder.new_state([rng.randrange(6) for _ in range(rng.randint(1, 20))])
    if rng.random() < 0.5:  # steady window instead of a warm-up one
        state.levels = [[rng.randrange(6) for _ in range(W - 1)]] + [[rng.randrange(6) for _ in range(W)]
                                                                     for _ in range(N - 2)]
    root = rng.randrange(6)
    set_pool(decoder, state, [(root, [rng.randrange(3) for _ in range(N - 1)]) for _ in range(rng.randint(0, 6))])
    step = decoder.build_step(state, root)
    n, t = len(step.tokens), step.num_tree_nodes
    visible = dense(step)

    # the mask is the ancestor mask of one tree spanning both branches
    parents = full_parents(step)
    assert parents[:t] == step.parents[:step.num_tree_nodes]
    assert torch.equal(tree_mask(step.parents), tree_mask(parents))
    assert tree_mask(step.parents).shape == (n, (n + 63) // 64)
    for row in range(n):
        causal_path(step, row, visible)

    # verification: a trie of exactly the root's candidates, shared prefixes once
    assert step.lookahead_rows == range(t, n)
    assert t <= 1 + G * (N - 1)
    paths = {0: ()}
    for node in range(1, t):
        assert 0 <= step.parents[:step.num_tree_nodes][node] < node
        paths[node] = paths[step.parents[:step.num_tree_nodes][node]] + (step.tokens[node],)
        assert tree_depths(step.parents)[node] == len(paths[node])
    assert len(set(paths.values())) == t  # no two nodes for one prefix
    prefixes = {c[:d] for c in state.candidates(root) for d in range(N)}
    assert set(paths.values()) == prefixes

    # the branches see each other only through the root
    assert not visible[t:, 1:t].any()
    assert not visible[1:t, t:].any()
    assert visible[:, 0].all()

    # lookahead cells: token (l, c) at position l + c, in level order
    cells = window_cells(state)
    assert len(cells) == n - t
    assert [tree_depths(step.parents)[r] for r in step.lookahead_rows] == [level + c for level, c in cells]
    assert [step.tokens[r] for r in step.lookahead_rows] == [x for level in state.levels for x in level]
    assert n <= decoder.max_step_tokens


def test_mask_spans_several_words():
    decoder = LookaheadDecoder(10, 5, 8)
    state = decoder.new_state(list(range(40)))
    state.levels = [list(range(100, 109))] + [list(range(200 + 10 * i, 210 + 10 * i)) for i in range(3)]
    set_pool(decoder, state, [(7, [k, k + 1, k + 2, k + 3]) for k in range(8)])
    step = decoder.build_step(state, 7)
    assert len(step.tokens) == 1 + 8 * 4 + 39 == 72
    assert tree_mask(step.parents).shape == (72, 2)
    assert torch.equal(tree_mask(step.parents), tree_mask(full_parents(step)))


# ----------------------------------------------------------------------------- pool and window updates
def test_pool_update_from_known_window_and_outputs():
    decoder = LookaheadDecoder(3, 3, 2, seed_pool_from_prompt=False)
    state = decoder.new_state([100, 101])
    state.levels = [[10, 11], [20, 21, 22]]
    step = decoder.build_step(state, 5)
    # rows: 10 11 | 20 21 22 -> the last level's argmax are 30 31 32
    decoder.update(state, step, [90, 91, 30, 31, 32], accepted=[7, 8])

    # window columns: (root 5, 20 -> 30), (10, 21 -> 31), (11, 22 -> 32); committed text 100 101 5 7 8
    assert state.candidates(10) == [(21, 31)]
    assert state.candidates(11) == [(22, 32)]
    assert state.candidates(100) == [(101, 5)]
    assert state.candidates(101) == [(5, 7)]
    assert state.candidates(5) == [(7, 8), (20, 30)]  # the committed n-gram came later: it is the most recent
    assert state.levels == [[21, 22], [30, 31, 32]]
    assert state.recent == [7, 8]

    # the next root is the last committed token; its n-grams continue the committed text
    step = decoder.build_step(state, 8)
    assert step.tokens[: step.num_tree_nodes] == [8]
    decoder.update(state, step, [0, 0, 40, 41, 42], accepted=[9])
    assert state.candidates(7) == [(8, 9)]
    assert state.candidates(8) == [(30, 40)]
    assert state.candidates(21) == [(31, 41)]


def test_pool_dedupe_recency_and_cap():
    decoder = LookaheadDecoder(3, 3, 2, seed_pool_from_prompt=False)
    state = decoder.new_state([0])
    set_pool(decoder, state, [(1, (2, 3)), (1, (4, 5))])
    assert state.candidates(1) == [(4, 5), (2, 3)]
    set_pool(decoder, state, [(1, (2, 3))])  # seen again: moves to the front, no duplicate
    assert state.candidates(1) == [(2, 3), (4, 5)]
    set_pool(decoder, state, [(1, (6, 7))])  # a third one: the oldest goes
    assert state.candidates(1) == [(6, 7), (2, 3)]


def test_prompt_seeding():
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    seeded = LookaheadDecoder(2, 3, 5).new_state(prompt)
    assert seeded.candidates(1) == [(2, 4), (2, 3)]
    assert seeded.candidates(2) == [(4, 1), (3, 1)]
    assert seeded.recent == [1, 2]
    unseeded = LookaheadDecoder(2, 3, 5, seed_pool_from_prompt=False).new_state(prompt)
    assert unseeded.pool == {} and unseeded.recent == [1, 2]


def test_window_is_deterministic_and_drawn_from_prompt():
    decoder = LookaheadDecoder(5, 4, 2)
    prompt = [11, 22, 33, 44]
    a, b = decoder.new_state(prompt), decoder.new_state(prompt)
    assert a.levels == b.levels
    assert len(a.levels) == 1 and len(a.levels[0]) == 5 + 3 - 2
    assert set(a.levels[0]) <= set(prompt)


@pytest.mark.parametrize("W,N", [(1, 3), (2, 3), (4, 4), (5, 5), (1, 5), (3, 6)])
def test_window_moves_one_position_per_step(W, N):
    """Every window token keeps its absolute position as the root moves on by one, or is the target's guess
    for its position; warm-up grows one level per step, then the window keeps N - 1 levels and W columns."""
    L = N - 1
    decoder = LookaheadDecoder(W, N, 2, seed_pool_from_prompt=False)
    state = decoder.new_state(list(range(10)))
    state.levels = [list(range(100, 100 + W + L - 2))]  # distinct tokens, so each can be traced
    root, fresh = 1000, 5000  # roots 1000.., guesses 5000.. (committed tokens are < 5000)
    for step_index in range(L + 3):
        filled = min(step_index + 1, L)
        assert len(state.levels) == filled
        assert state.width == W + L - filled
        step = decoder.build_step(state, root)
        assert len(step.tokens) <= decoder.max_step_tokens
        old_position = {step.tokens[row]: tree_depths(step.parents)[row] for row in step.lookahead_rows}
        argmax = list(range(fresh, fresh + len(step.lookahead_rows)))
        guess_position = {g: tree_depths(step.parents)[row] + 1 for g, row in zip(argmax, step.lookahead_rows)}
        fresh += 10_000
        decoder.update(state, step, argmax, accepted=[root + 1])
        window_ngrams = [c for cs in state.pool.values() for c in cs if c[-1] >= 5000]
        assert bool(window_ngrams) == (step_index >= L - 1)  # none while warming up (columns shorter than N)
        for (level, column), token in zip(window_cells(state), (x for lvl in state.levels for x in lvl)):
            absolute = level + column + 1  # the new root sits at old position 1
            assert old_position.get(token, guess_position.get(token)) == absolute
        root += 1
    assert len(state.levels) == L and state.width == W


# ----------------------------------------------------------------------------- validation
def test_validation_errors():
    with pytest.raises(ValueError, match="window_size must be >= 1, got 0"):
        LookaheadDecoder(0, 4, 2)
    with pytest.raises(ValueError, match="ngram_size must be >= 3.*got 2"):
        LookaheadDecoder(4, 2, 2)
    with pytest.raises(ValueError, match="guess_set_size must be >= 1, got 0"):
        LookaheadDecoder(4, 4, 0)
    decoder = LookaheadDecoder(3, 3, 2)
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        decoder.new_state([])
    state = decoder.new_state([1, 2, 3])
    step = decoder.build_step(state, 4)
    with pytest.raises(ValueError, match="lookahead_argmax has 2 tokens, the step has 3 lookahead rows"):
        decoder.update(state, step, [0, 0], [5])
    with pytest.raises(ValueError, match="accepted must hold"):
        decoder.update(state, step, [0, 0, 0], [])
    decoder.update(state, step, [0, 0, 0], [5, 6])
    with pytest.raises(ValueError, match="step was not built from this state's current window"):
        decoder.update(state, step, [0, 0, 0], [7])
    with pytest.raises(ValueError, match="root 5 is not the last committed token 6"):
        decoder.build_step(state, 5)


# ----------------------------------------------------------------------------- decoding toy targets
def run_lookahead(decoder, prompt, next_token, max_new):
    """Greedy lookahead decoding of a target whose argmax after a text is `next_token(text)`; every row's
    argmax is computed from the committed text plus that row's own causal path in the mask."""
    state = decoder.new_state(prompt)
    text = list(prompt) + [next_token(prompt)]  # the prefill emits the first token: the first root
    steps, tokens_per_step = 0, []
    while len(text) - len(prompt) < max_new:
        step = decoder.build_step(state, text[-1])
        visible = dense(step)
        argmax = [next_token(text[:-1] + causal_path(step, row, visible)) for row in range(len(step.tokens))]
        accepted = greedy_tree_walk(step, argmax)
        decoder.update(state, step, [argmax[r] for r in step.lookahead_rows], accepted)
        text += accepted
        steps += 1
        tokens_per_step.append(len(accepted))
    return state, text, tokens_per_step


def greedy_reference(prompt, next_token, length):
    text = list(prompt)
    while len(text) < length:
        text.append(next_token(text))
    return text


def test_jacobi_toy_first_order_target():
    """next = (7 * prev + 3) % 50: the window's columns become chains of the map, the pool fills with correct
    n-grams and the verification branch lands several tokens per step; the text equals plain greedy."""
    f = lambda t: (t * 7 + 3) % 50  # noqa: E731
    next_token = lambda text: f(text[-1])  # noqa: E731
    decoder = LookaheadDecoder(window_size=5, ngram_size=4, guess_set_size=3, seed_pool_from_prompt=False)
    prompt = [3, 17, 40, 9, 28, 35, 14]
    state, text, tokens_per_step = run_lookahead(decoder, prompt, next_token, max_new=60)
    assert text == greedy_reference(prompt, next_token, len(text))

    correct = [(k, c) for k, cs in state.pool.items() for c in cs
               if all(b == f(a) for a, b in zip((k,) + c, c))]
    assert len(correct) >= 10
    assert sum(tokens_per_step) / len(tokens_per_step) > 2
    assert max(tokens_per_step) == 4  # a whole 3-token candidate + the bonus token


def test_jacobi_toy_window_alone_finds_ngrams():
    """A full-period map on 1000 tokens: the text never repeats, so every accepted guess comes from
    n-grams the lookahead window computed (the prompt holds points further along the orbit)."""
    f = lambda t: (21 * t + 3) % 1000  # noqa: E731  (Hull-Dobell: period 1000)
    next_token = lambda text: f(text[-1])  # noqa: E731
    orbit = [7]
    for _ in range(60):
        orbit.append(f(orbit[-1]))
    prompt = [orbit[12], orbit[25], orbit[0]]  # the first root is orbit[1]
    decoder = LookaheadDecoder(window_size=4, ngram_size=4, guess_set_size=2, seed_pool_from_prompt=False)
    state, text, tokens_per_step = run_lookahead(decoder, prompt, next_token, max_new=40)
    generated = text[len(prompt):]
    assert text == greedy_reference(prompt, next_token, len(text))
    assert len(set(generated)) == len(generated)  # no repeats: the committed text offers no candidates
    assert max(tokens_per_step) > 1
    assert len(tokens_per_step) < len(generated)


def test_jacobi_toy_second_order_target_stays_exact():
    """A target that reads two tokens back: the lookahead rows' argmax depend on their causal paths, and the
    committed text still equals plain greedy."""
    next_token = lambda text: (3 * text[-1] + 5 * text[-2] + 1) % 11  # noqa: E731
    decoder = LookaheadDecoder(window_size=4, ngram_size=3, guess_set_size=4)
    prompt = [1, 2, 3, 4, 5]
    state, text, tokens_per_step = run_lookahead(decoder, prompt, next_token, max_new=50)
    assert text == greedy_reference(prompt, next_token, len(text))
    assert sum(tokens_per_step) > len(tokens_per_step)
