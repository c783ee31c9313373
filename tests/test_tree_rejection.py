"""Tree verification: the Triton kernels (interpreted on CPU) give the same tokens as the references, and the
emitted tokens follow the target distribution at every depth of a
tree with several candidates per node, duplicates included (not the draft's q).

Triton against the reference: on the test device, bit for bit (both draw from the same counter-based uniforms; no
tolerance). The convergence statistics: the reference on the CPU, by intent (the kernel equals it)."""

import math

import pytest
import torch

from nanospec.kernels.backend import backend
from nanospec.kernels.exponential_race import exponentials_ref
from nanospec.kernels.tree_rejection import (tree_rejection_sample, tree_rejection_sample_ref,
                                             tree_rejection_sample_triton)
from nanospec.kernels.tree_verify import greedy_tree_verify, greedy_tree_verify_ref, greedy_tree_verify_triton

def _random_tree_problem(batch, num_nodes, vocab_size, generator_seed, scale=3.0):
    """Random trees (parents[i] uniform in [0, i)), peaked target rows near the draft rows, so that paths go
    deep and some candidates are rejected. Node i's draft distribution Q[i] proposes its children, i.i.d.;
    child c's draft row is Q[parent(c)]."""
    gen = torch.Generator().manual_seed(generator_seed)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    logits = torch.randn(batch, num_nodes, vocab_size, generator=gen) * scale
    q_after = torch.softmax(logits + torch.randn(logits.shape, generator=gen), -1)
    target = 0.5 * torch.softmax(logits + torch.randn(logits.shape, generator=gen), -1)
    rows = torch.arange(batch)[:, None]
    parent_rows = q_after[rows, parents.clamp(min=0)]
    tokens = torch.multinomial(parent_rows.reshape(-1, vocab_size), 1, generator=gen).reshape(batch, num_nodes)
    tokens[:, 0] = -1
    return target, tokens, parents, 3.0 * parent_rows


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _assert_same(got, expected):
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (got, expected)


# ----------------------------------------------------------------------------------------------------
# Triton == reference, token for token


def test_triton_matches_ref_random_trees(device):
    accepted_later_sibling = rejected_all = reached_depth_2 = False
    for problem in range(4):
        target, tokens, parents, draft_probs = _random_tree_problem(3, 8, 37, problem)
        target, tokens, parents, draft_probs = _to(device, target, tokens, parents, draft_probs)
        num_nodes = torch.tensor([8, 1 + problem, 6], device=device)
        seeds = torch.tensor([problem, 1000 + problem, 77], device=device)
        offsets = torch.tensor([0, 5, 123], device=device)
        args = (target, tokens, parents, num_nodes, draft_probs)
        expected = tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets)
        _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets), expected)

        path, emitted = expected
        length = (path >= 0).sum(-1)
        assert torch.equal((emitted >= 0).sum(-1), length + 1)
        for b in range(3):
            nodes = [0] + path[b, : length[b]].tolist()
            for depth, node in enumerate(nodes[1:]):
                assert parents[b, node] == nodes[depth] and tokens[b, node] == emitted[b, depth]
                first_sibling = (parents[b, 1 : num_nodes[b]] == nodes[depth]).nonzero()[0, 0] + 1
                accepted_later_sibling |= node != first_sibling
            last_children = (parents[b, 1 : num_nodes[b]] == nodes[-1]).sum()
            rejected_all |= bool(last_children > 1)
            reached_depth_2 |= len(nodes) > 2
    assert accepted_later_sibling and rejected_all and reached_depth_2  # the walks took every branch


def test_triton_matches_ref_across_vocab_tiles_and_bf16(device):
    """V larger than one BLOCK_V tile (2048), and not a multiple of it; bf16 inputs are upcast."""
    target, tokens, parents, draft_probs = _random_tree_problem(2, 4, 2500, 5, scale=4.0)
    args = _to(device, target, tokens, parents, torch.tensor([4, 3]), draft_probs)
    seeds, offsets = torch.tensor([3, 4], device=device), torch.tensor([0, 9], device=device)
    _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets),
                 tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets))
    args[0] = args[0].to(torch.bfloat16)
    _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets),
                 tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets))


def test_no_candidates_and_empty_batch(device):
    """num_nodes = 1: the token is drawn from the root's target row, with the root's (depth 0) stream."""
    target, tokens, parents, draft_probs = _random_tree_problem(3, 5, 19, 6)
    args = _to(device, target, tokens, parents, torch.ones(3, dtype=torch.int64), draft_probs)
    seeds, offsets = torch.tensor([1, 2, 3], device=device), torch.tensor([4, 5, 6], device=device)
    expected = tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets)
    _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets), expected)
    assert (expected[0] == -1).all() and (expected[1][:, 1:] == -1).all()
    race = (target[:, 0].to(device) / exponentials_ref(seeds, offsets, 19)).argmax(-1)  # argmax p_v / E_v
    assert torch.equal(expected[1][:, 0], race)

    empty = [t[:0] for t in args]
    for verify in (tree_rejection_sample_ref, tree_rejection_sample_triton):
        path, emitted = verify(*empty, seeds=seeds[:0], offsets=offsets[:0])
        assert path.shape == emitted.shape == (0, 5)


def test_zero_mass_residual_falls_back_to_target(device):
    """p == q, children outside both supports: each is rejected (0/0), the residual max(p - q, 0) is empty,
    so the token is drawn from the node's target row. Well defined, identical on both backends."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    batch = 6
    target = p.expand(batch, 4, 6).contiguous()
    draft_probs = p.expand(batch, 4, 6).contiguous()
    tokens = torch.tensor([-1, 0, 2, 5]).expand(batch, 4)
    parents = torch.tensor([-1, 0, 0, 0]).expand(batch, 4)
    num_nodes = torch.tensor([4, 4, 4, 2, 2, 3])
    args = _to(device, target, tokens, parents, num_nodes, draft_probs)
    seeds, offsets = torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.int64, device=device)
    expected = tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets)
    _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets), expected)
    assert (expected[0] == -1).all() and (expected[1][:, 1:] == -1).all()
    assert (p[expected[1][:, 0].cpu()] > 0).all()


def test_dispatcher(device, triton_backend):
    target, tokens, parents, draft_probs = _random_tree_problem(2, 6, 10, 7)
    args = _to(device, target, tokens, parents, torch.tensor([6, 4]), draft_probs)
    seeds, offsets = torch.tensor([8, 9], device=device), torch.tensor([1, 2], device=device)
    expected = tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets)
    _assert_same(tree_rejection_sample(*args, seeds=seeds, offsets=offsets), expected)
    with backend("torch"):
        _assert_same(tree_rejection_sample(*args, seeds=seeds, offsets=offsets), expected)


# ----------------------------------------------------------------------------------------------------
# Convergence: every emitted token follows the target distribution of the node it is emitted at
#
# Bound (Bretagnolle-Huber-Carol; Weissman et al. 2003), as in tests/test_rejection.py: for n samples of a
# distribution on V values, P(TV(empirical, true) >= t) <= 2^V exp(-2 n t^2). We take
# t(n) = sqrt((V ln 2 + ln(1/delta)) / (2 n)) with delta = 1e-6, so each check fails by chance with
# probability at most 1e-6 (the seeds are fixed: the test is deterministic). t = 0.031 at n = 10k,
# 0.0098 at n = 100k.
#
# The tree (11 nodes): the root has 4 candidates, node 1 has 3, node 2 has 2, node 3 has 1:
#     parents = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3]
# The target after the root is P0; after a depth-1 node with token t it is P1[t] (a duplicate of t
# has the same context, so the same target); after a depth-2 node, P2. The draft distributions Q0 and
# Q1[t] are far from them (total variation 0.5).

P0 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q0 = P0.roll(3)
VOCAB = P0.numel()
P1 = torch.stack([P0.roll(t) for t in range(VOCAB)])
Q1 = torch.stack([Q0.roll(t) for t in range(VOCAB)])
P2 = P0.roll(5)
TREE_PARENTS = torch.tensor([-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3])
DEPTH_1, DEPTH_2 = slice(1, 5), slice(5, 11)
DELTA = 1e-6


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def _tv_bound(n):
    return math.sqrt((VOCAB * math.log(2) + math.log(1 / DELTA)) / (2 * n))


def _tree_sample(num_rows, seed):
    """num_rows verifications of the tree above, every node's children i.i.d. from the node's draft
    distribution. Rows scaled (target 0.5, draft 3): the kernel normalises."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes = TREE_PARENTS.numel()
    rows = torch.arange(num_rows)
    # Q1[t] is Q0 rolled by t: a draw from it is a draw from Q0 plus t (mod V).
    draws = torch.multinomial(Q0, num_rows * (num_nodes - 1), replacement=True, generator=gen)
    tokens = torch.cat([torch.full((num_rows, 1), -1), draws.view(num_rows, num_nodes - 1)], 1)
    tokens[:, DEPTH_2] = (tokens[:, DEPTH_2] + tokens[:, TREE_PARENTS[DEPTH_2]]) % VOCAB
    target = torch.empty(num_rows, num_nodes, VOCAB)
    target[:, 0] = P0
    target[:, DEPTH_1] = P1[tokens[:, DEPTH_1]]
    target[:, DEPTH_2] = P2
    draft_probs = torch.zeros(num_rows, num_nodes, VOCAB)  # child c's row: what its parent's candidates came from
    draft_probs[:, DEPTH_1] = Q0
    draft_probs[:, DEPTH_2] = Q1[tokens[rows[:, None], TREE_PARENTS[DEPTH_2]]]
    parents = TREE_PARENTS.expand(num_rows, num_nodes)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen)
    offsets = torch.randint(0, 2**20, (num_rows,), generator=gen)
    path, emitted = tree_rejection_sample_ref(0.5 * target, tokens, parents, torch.full((num_rows,), num_nodes),
                                              3.0 * draft_probs, seeds=seeds, offsets=offsets)
    return tokens, path, emitted


def _distribution(tokens):
    return torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()


def test_emitted_tokens_converge_to_target():
    p0, q0 = P0.double(), Q0.double()
    assert _tv(p0, q0) > 0.49 and min(_tv(P1[t], Q1[t]) for t in range(VOCAB)) > 0.49
    first_token_tv = {}
    for num_rows in (10_000, 100_000):
        tokens, path, emitted = _tree_sample(num_rows, seed=num_rows)

        # First token (every row): P0, far from Q0.
        first = _distribution(emitted[:, 0])
        bound = _tv_bound(num_rows)
        assert _tv(first, p0) < bound and _tv(first, q0) > _tv(p0, q0) - bound
        first_token_tv[num_rows] = _tv(first, p0)

        # Second token, given the first is t (the rows that accepted a depth-1 node of token t): P1[t].
        checked = 0
        for t in range(VOCAB):
            second = emitted[(emitted[:, 0] == t) & (emitted[:, 1] >= 0), 1]
            if second.numel() >= 500:
                bound = _tv_bound(second.numel())
                dist = _distribution(second)
                assert _tv(dist, P1[t].double()) < bound, (num_rows, t)
                assert _tv(dist, Q1[t].double()) > _tv(P1[t], Q1[t]) - bound, (num_rows, t)
                checked += 1
        assert checked >= 2

        # Third token (after a depth-2 node, all leaves: the bonus): P2.
        third = emitted[emitted[:, 2] >= 0, 2]
        assert _tv(_distribution(third), P2.double()) < _tv_bound(third.numel())

        # The walks went through later siblings, duplicates and full rejections.
        siblings_accepted = path[:, 0] > 1
        assert siblings_accepted.float().mean() > 0.05 and (path[:, 0] == -1).float().mean() > 0.05
        duplicates = (tokens[:, DEPTH_1, None] == tokens[:, None, DEPTH_1]).sum((1, 2)) > 4
        assert duplicates.float().mean() > 0.2
        # A token rejected once is never accepted again at that node: it was rejected only if p(t) < q(t),
        # and then the residual max(p - c q, 0) is zero there.
        accepted_token = tokens.gather(1, path[:, :1].clamp(min=1))
        earlier_copy = (tokens[:, DEPTH_1] == accepted_token) & (torch.arange(1, 5) < path[:, :1])
        assert not earlier_copy.any()
    assert first_token_tv[100_000] < first_token_tv[10_000]
    assert first_token_tv[100_000] < _tv_bound(100_000) < _tv_bound(10_000) / 3


# ----------------------------------------------------------------------------------------------------
# Greedy verification over a tree

GREEDY_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 0]
GREEDY_TOKENS = [-1, 5, 6, 7, 7, 8, 9, 6]
GREEDY_CASES = [
    # target_argmax per node, num_nodes, expected path, expected emitted
    ([6, 0, 8, 0, 0, 3, 0, 0], 8, [2, 5], [6, 8, 3]),  # root -> node 2 (6) -> node 5 (8), a leaf: bonus 3
    ([5, 7, 0, 9, 0, 0, 4, 0], 8, [1, 3, 6], [5, 7, 9, 4]),  # node 1 has two children of token 7: the first
    ([5, 1, 0, 0, 0, 0, 0, 0], 8, [1], [5, 1]),  # node 1's children are 7, 7: mismatch, emit 1
    ([4, 0, 0, 0, 0, 0, 0, 0], 8, [], [4]),  # no child of the root matches
    ([6, 0, 8, 0, 0, 3, 0, 0], 5, [2], [6, 8]),  # node 5 is past num_nodes: ignored, node 2 is a leaf
    ([6, 0, 0, 0, 0, 0, 0, 0], 1, [], [6]),  # no candidates at all
]


def _pad(values, width=8):
    return values + [-1] * (width - len(values))


@pytest.mark.parametrize("verify", [greedy_tree_verify_ref, greedy_tree_verify_triton])
def test_greedy_tree_verify_cases(device, verify):
    batch = len(GREEDY_CASES)
    target = torch.tensor([case[0] for case in GREEDY_CASES], device=device)
    parents = torch.tensor([GREEDY_PARENTS] * batch, device=device)
    tokens = torch.tensor([GREEDY_TOKENS] * batch, device=device)
    num_nodes = torch.tensor([case[1] for case in GREEDY_CASES], device=device)
    path, emitted = verify(target, tokens, parents, num_nodes)
    assert path.tolist() == [_pad(case[2]) for case in GREEDY_CASES]
    assert emitted.tolist() == [_pad(case[3]) for case in GREEDY_CASES]
    path, emitted = verify(target[:0], tokens[:0], parents[:0], num_nodes[:0])
    assert path.shape == emitted.shape == (0, 8)


def test_greedy_tree_verify_triton_matches_ref_random(device, triton_backend):
    gen = torch.Generator().manual_seed(0)
    batch, num_nodes = 32, 7
    parents = torch.full((batch, num_nodes), -1)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    tokens = torch.randint(0, 3, (batch, num_nodes), generator=gen)
    target = torch.randint(0, 3, (batch, num_nodes), generator=gen)
    sizes = torch.randint(1, num_nodes + 1, (batch,), generator=gen)
    args = _to(device, target, tokens, parents, sizes)
    _assert_same(greedy_tree_verify(*args), greedy_tree_verify_ref(*args))


@pytest.mark.parametrize("verify", [tree_rejection_sample_ref, tree_rejection_sample_triton])
def test_one_hot_target_reduces_to_greedy(device, verify):
    gen = torch.Generator().manual_seed(1)
    batch, num_nodes, vocab_size = 3, 7, 5
    parents = torch.full((batch, num_nodes), -1)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    tokens = torch.randint(0, 3, (batch, num_nodes), generator=gen)
    target_argmax = torch.randint(0, 3, (batch, num_nodes), generator=gen)
    sizes = torch.tensor([7, 5, 1])
    target = torch.nn.functional.one_hot(target_argmax, vocab_size).float()
    draft_probs = torch.rand(batch, num_nodes, vocab_size, generator=gen)
    args = _to(device, target, tokens, parents, sizes, draft_probs)
    expected = greedy_tree_verify_ref(*_to(device, target_argmax, tokens, parents, sizes))
    assert (expected[0][0] >= 0).sum() >= 1
    for seed in (0, 1):
        seeds = torch.arange(batch, device=device) + seed
        _assert_same(verify(*args, seeds=seeds, offsets=torch.zeros_like(seeds)), expected)


def test_out_of_vocabulary_candidates_are_rejected_without_reading_outside(device):
    """Guesses outside [0, V) (negative, V, far beyond) are never accepted, and every load is masked: the
    kernel (interpreted on CPU) and the reference agree, with no out-of-bounds read."""
    target, tokens, parents, draft_probs = _random_tree_problem(8, 7, 13, 11)
    tokens[:, 1::2] = torch.tensor([13, -1, 10**9])  # odd nodes: outside the vocabulary
    args = _to(device, target, tokens, parents, torch.full((8,), 7), draft_probs)
    seeds, offsets = torch.arange(8, device=device), torch.zeros(8, dtype=torch.int64, device=device)
    expected = tree_rejection_sample_ref(*args, seeds=seeds, offsets=offsets)
    _assert_same(tree_rejection_sample_triton(*args, seeds=seeds, offsets=offsets), expected)
    path, emitted = expected
    assert not ((path >= 0) & (path % 2 == 1)).any()  # no odd node on any accepted path
    assert ((emitted >= 0) & (emitted < 13) | (emitted == -1)).all()
    greedy = (greedy_tree_verify_ref(target.argmax(-1).to(device), *args[1:4]),
              greedy_tree_verify_triton(target.argmax(-1).to(device), *args[1:4]))
    _assert_same(*greedy)
