"""Rejection sampling of a chain d_1..d_k (Leviathan et al. 2023; Chen et al. 2023) through the kernel the engine
verifies with, the tree verifier given parents [-1, 0, 1, ...]: the emitted tokens follow the target distribution p
(not the draft's q) at every position, the bonus included; the first draft is accepted as often as the rule says;
a recovered token comes from the residual.

Statistics of the torch reference, on the CPU by intent (hundreds of thousands of draws; the interpreter would take
hours): the Triton kernel draws the same tokens bit for bit on either device (tests/test_tree_rejection.py)."""

import math

import torch

from nanospec.kernels.tree_rejection import tree_rejection_sample_ref


# ----------------------------------------------------------------------------------------------------
# Convergence: the emitted tokens follow p
#
# Bound (Bretagnolle-Huber-Carol; Weissman et al. 2003): for n samples of a distribution on V values,
# P(TV(empirical, true) >= t) <= 2^V exp(-2 n t^2). We take t(n) = sqrt((V ln 2 + ln(1/delta)) / (2 n))
# with delta = 1e-6, so each check below fails by chance with probability at most 1e-6 (the seeds are
# fixed, so the test is deterministic). t(n) shrinks like 1/sqrt(n): 0.031 at n = 10k, 0.0057 at 300k.

P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = torch.tensor([0.02, 0.05, 0.08, 0.10, 0.10, 0.15, 0.20, 0.30])
DELTA = 1e-6


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def _tv_bound(n, vocab_size):
    return math.sqrt((vocab_size * math.log(2) + math.log(1 / DELTA)) / (2 * n))


def _sample(num_rows, k, seed):
    """num_rows verification steps of a chain with target p at every position and drafts drawn from q.
    Returns ``[num_rows, k + 1]`` emitted tokens (-1 padded).

    The target rows are scaled by 0.5 and the draft rows by 3 (not normalised): the kernel normalises. Node 0 is
    the root, node i the draft d_i; node i's draft row (what proposed it) is q."""
    vocab_size = P.numel()
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, num_rows * k, replacement=True, generator=gen).reshape(num_rows, k)
    target = (0.5 * P).expand(num_rows, k + 1, vocab_size)
    draft_probs = torch.cat([torch.zeros(num_rows, 1, vocab_size), (3.0 * Q).expand(num_rows, k, vocab_size)], 1)
    node_tokens = torch.cat([torch.full((num_rows, 1), -1), drafts], 1)
    parents = torch.arange(-1, k).expand(num_rows, k + 1)
    seeds = seed * 1_000_003 + torch.arange(num_rows)
    _, emitted = tree_rejection_sample_ref(target, node_tokens, parents, torch.full((num_rows,), k + 1), draft_probs,
                                           seeds=seeds, offsets=torch.zeros(num_rows, dtype=torch.int64))
    return emitted


def _emitted_distributions(out, vocab_size):
    """Per position j: the empirical distribution of out[:, j] over the rows that reached j, and their count."""
    dists = []
    for column in out.T:
        reached = column[column >= 0]
        dists.append((torch.bincount(reached, minlength=vocab_size).double() / reached.numel(), reached.numel()))
    return dists


def test_emitted_tokens_converge_to_p():
    k, vocab_size = 3, P.numel()
    p, q = P.double(), Q.double()
    assert _tv(p, q) > 0.45  # q is deliberately far from p
    first_token_tv = {}
    for num_rows in (10_000, 300_000):
        out = _sample(num_rows, k, seed=num_rows)
        # Every position, the bonus (j = k) included, conditioned on the row reaching it: the bound is
        # taken at the number of rows that reached it (all of them at j = 0, fewer further on).
        dists = _emitted_distributions(out, vocab_size)
        for position, (emitted, count) in enumerate(dists):
            bound = _tv_bound(count, vocab_size)
            assert _tv(emitted, p) < bound, (num_rows, position)
            assert _tv(emitted, q) > _tv(p, q) - bound, (num_rows, position)
        emitted, count = dists[0]
        assert count == num_rows
        first_token_tv[num_rows] = _tv(emitted, p)

        # First draft: accepted with probability sum_x min(p, q), within 5 binomial standard deviations.
        acceptance = p.minimum(q).sum().item()
        accepted = (out[:, 1] >= 0).double().mean().item()
        assert abs(accepted - acceptance) < 5 * math.sqrt(acceptance * (1 - acceptance) / num_rows)
    # Converges: 30x the rows, a TV about sqrt(30) ~ 5.5x smaller, under a bound (0.0057) that is itself
    # below a fifth of the 10k bound (0.031).
    assert first_token_tv[300_000] < first_token_tv[10_000]
    assert first_token_tv[300_000] < _tv_bound(300_000, vocab_size) < _tv_bound(10_000, vocab_size) / 5


def test_recovered_token_comes_from_the_residual():
    """After a rejection at position j the token is drawn from max(p - q, 0): never where p <= q."""
    k = 3
    out = _sample(20_000, k, seed=7)
    for position in range(k):
        rejected = (out[:, position] >= 0) & (out[:, position + 1] < 0)
        recovered = out[rejected, position]
        assert recovered.numel() > 50
        assert (P[recovered] > Q[recovered]).all()
