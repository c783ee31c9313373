"""Rejection sampling and greedy verification: the Triton kernels (interpreted on CPU) give the same tokens
as the references, the emitted tokens follow the target distribution p (not the draft's q), seeds
reproduce, and greedy verification walks the drafts as it should."""

import math

import pytest
import torch

from nanospec.kernels.backend import backend
from nanospec.kernels.rejection import (
    greedy_verify,
    greedy_verify_ref,
    greedy_verify_triton,
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)


def _random_problem(batch, k, vocab_size, device, generator_seed=0, sharpness=3.0):
    """Unnormalised target rows [B, k+1, V], draft rows [B, k, V] (scaled by 2), drafts drawn from q."""
    gen = torch.Generator().manual_seed(generator_seed)
    target = torch.rand(batch, k + 1, vocab_size, generator=gen) ** sharpness
    draft = torch.rand(batch, k, vocab_size, generator=gen) ** sharpness * 2.0
    if k > 0:
        drafts = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=gen).reshape(batch, k)
    else:
        drafts = torch.zeros(batch, 0, dtype=torch.int64)
    return target.to(device), draft.to(device), drafts.to(device)


# ----------------------------------------------------------------------------------------------------
# Triton == reference, token for token


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("num_drafts", [None, [4, 0, 2, 3]])
def test_triton_matches_ref(device, with_draft_probs, num_drafts):
    target, draft, drafts = _random_problem(4, 4, 37, device)
    draft_probs = draft if with_draft_probs else None
    num_draft_tokens = None if num_drafts is None else torch.tensor(num_drafts, device=device)
    for seed in (0, 1, 2):
        expected = rejection_sample_ref(target, drafts, draft_probs, seed=seed, num_draft_tokens=num_draft_tokens)
        got = rejection_sample_triton(target, drafts, draft_probs, seed=seed, num_draft_tokens=num_draft_tokens)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_triton_matches_ref_many_rows(device, with_draft_probs):
    """A batch big enough to take every path: rejections at each position, the bonus, n_b = 0."""
    target, draft, drafts = _random_problem(48, 3, 8, device, generator_seed=1, sharpness=4.0)
    target[:, :3] = 0.5 * draft + 0.05 * target[:, :3]  # p close to q: many drafts are accepted
    num_draft_tokens = torch.arange(48, device=device) % 4
    draft_probs = draft if with_draft_probs else None
    seeds = torch.arange(48, device=device) * 7919 + 3
    offsets = torch.arange(48, device=device) * 11
    kwargs = dict(num_draft_tokens=num_draft_tokens, seeds=seeds, offsets=offsets)
    expected = rejection_sample_ref(target, drafts, draft_probs, **kwargs)
    got = rejection_sample_triton(target, drafts, draft_probs, **kwargs)
    assert torch.equal(got, expected)
    num_accepted = (expected >= 0).sum(-1) - 1
    assert (num_accepted < num_draft_tokens).any()  # rejections
    assert ((num_accepted == num_draft_tokens) & (num_draft_tokens > 0)).any()  # all accepted, then the bonus


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_triton_matches_ref_across_vocab_tiles(device, with_draft_probs):
    """V larger than one BLOCK_V tile (2048), and not a multiple of it."""
    target, draft, drafts = _random_problem(2, 2, 2500, device, generator_seed=2, sharpness=8.0)
    draft_probs = draft if with_draft_probs else None
    for seed in (0, 1):
        expected = rejection_sample_ref(target, drafts, draft_probs, seed=seed)
        got = rejection_sample_triton(target, drafts, draft_probs, seed=seed)
        assert torch.equal(got, expected)


def test_triton_matches_ref_bf16_and_k0_and_empty(device):
    target, draft, drafts = _random_problem(3, 2, 19, device, generator_seed=3)
    target16 = target.to(torch.bfloat16)
    expected = rejection_sample_ref(target16, drafts, draft, seed=4)
    assert torch.equal(rejection_sample_triton(target16, drafts, draft, seed=4), expected)

    bonus_only, _, no_drafts = _random_problem(3, 0, 19, device)
    expected = rejection_sample_ref(bonus_only, no_drafts, seed=5)
    assert expected.shape == (3, 1) and (expected >= 0).all()
    assert torch.equal(rejection_sample_triton(bonus_only, no_drafts, seed=5), expected)

    empty, empty_draft, empty_drafts = _random_problem(0, 3, 19, device)
    for verify in (rejection_sample_ref, rejection_sample_triton):
        assert verify(empty, empty_drafts, empty_draft, seed=0).shape == (0, 4)


def test_zero_mass_residual_falls_back_to_p(device):
    """p == q, and a draft token outside both supports: rejected (ratio 0/0), the residual max(p - q, 0)
    is empty, so the token is drawn from p. Well defined, identical on both backends."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0], device=device)
    target = p.expand(6, 2, 6).contiguous()
    draft = p.expand(6, 1, 6).contiguous()
    drafts = torch.zeros(6, 1, dtype=torch.int64, device=device)
    expected = rejection_sample_ref(target, drafts, draft, seed=11)
    assert torch.equal(rejection_sample_triton(target, drafts, draft, seed=11), expected)
    assert (expected[:, 1] == -1).all()
    assert (p[expected[:, 0]] > 0).all()


def test_dispatcher(device, triton_backend):
    target, draft, drafts = _random_problem(2, 3, 10, device)
    expected = rejection_sample_ref(target, drafts, draft, seed=3)
    assert torch.equal(rejection_sample(target, drafts, draft, seed=3), expected)
    with backend("torch"):
        assert torch.equal(rejection_sample(target, drafts, draft, seed=3), expected)


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


def _sample(num_rows, k, with_draft_probs, seed):
    """num_rows verification steps with target p at every position and drafts drawn from q.

    The target rows are scaled by 0.5 and the draft rows by 3 (not normalised): the kernel normalises."""
    vocab_size = P.numel()
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, num_rows * k, replacement=True, generator=gen).reshape(num_rows, k)
    target = (0.5 * P).expand(num_rows, k + 1, vocab_size)
    draft_probs = (3.0 * Q).expand(num_rows, k, vocab_size) if with_draft_probs else None
    return rejection_sample_ref(target, drafts, draft_probs, seed=seed), drafts


def _emitted_distributions(out, vocab_size):
    """Per position j: the empirical distribution of out[:, j] over the rows that reached j, and their count."""
    dists = []
    for column in out.T:
        reached = column[column >= 0]
        dists.append((torch.bincount(reached, minlength=vocab_size).double() / reached.numel(), reached.numel()))
    return dists


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_emitted_tokens_converge_to_p(with_draft_probs):
    k, vocab_size = 3, P.numel()
    p, q = P.double(), Q.double()
    assert _tv(p, q) > 0.45  # q is deliberately far from p
    first_token_tv = {}
    for num_rows in (10_000, 300_000):
        out, drafts = _sample(num_rows, k, with_draft_probs, seed=num_rows)
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

        # First draft: accepted with probability sum_x min(p, q) (a draft model) or sum_x q p (one-hot),
        # within 5 binomial standard deviations.
        acceptance = (p.minimum(q) if with_draft_probs else p * q).sum().item()
        accepted = (out[:, 1] >= 0).double().mean().item()
        assert abs(accepted - acceptance) < 5 * math.sqrt(acceptance * (1 - acceptance) / num_rows)
    # Converges: 30x the rows, a TV about sqrt(30) ~ 5.5x smaller, under a bound (0.0057) that is itself
    # below a fifth of the 10k bound (0.031).
    assert first_token_tv[300_000] < first_token_tv[10_000]
    assert first_token_tv[300_000] < _tv_bound(300_000, vocab_size) < _tv_bound(10_000, vocab_size) / 5


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_recovered_token_comes_from_the_residual(with_draft_probs):
    """After a rejection at position j the token is drawn from max(p - q, 0): never where p <= q
    (one-hot: never the rejected draft itself)."""
    k = 3
    out, drafts = _sample(20_000, k, with_draft_probs, seed=7)
    for position in range(k):
        rejected = (out[:, position] >= 0) & (out[:, position + 1] < 0)
        recovered = out[rejected, position]
        assert recovered.numel() > 50
        if with_draft_probs:
            assert (P[recovered] > Q[recovered]).all()
        else:
            assert (recovered != drafts[rejected, position]).all()


# ----------------------------------------------------------------------------------------------------
# Seeds


def test_seeded_reproducibility(device):
    target, draft, drafts = _random_problem(16, 4, 300, device, sharpness=1.0)
    first = rejection_sample_ref(target, drafts, draft, seed=123)
    assert torch.equal(rejection_sample_ref(target, drafts, draft, seed=123), first)
    assert not torch.equal(rejection_sample_ref(target, drafts, draft, seed=124), first)

    # seed=None draws the seed from torch's global RNG.
    torch.manual_seed(0)
    unseeded = rejection_sample_ref(target, drafts, draft)
    torch.manual_seed(0)
    assert torch.equal(rejection_sample_ref(target, drafts, draft), unseeded)

    # An int seed means seeds[b] = seed + b, offsets 0; each row depends only on its own seed and offset.
    seeds = 123 + torch.arange(16, device=device)
    assert torch.equal(rejection_sample_ref(target, drafts, draft, seeds=seeds), first)
    offsets = torch.full((16,), 40, device=device)
    shifted = rejection_sample_ref(target, drafts, draft, seeds=seeds, offsets=offsets)
    assert not torch.equal(shifted, first)
    row = 5
    alone = rejection_sample_ref(
        target[row : row + 1], drafts[row : row + 1], draft[row : row + 1],
        seeds=seeds[row : row + 1], offsets=offsets[row : row + 1],
    )
    assert torch.equal(alone[0], shifted[row])


# ----------------------------------------------------------------------------------------------------
# Greedy verification


GREEDY_CASES = [
    # target_argmax, drafts, num_drafts, expected
    ([5, 6, 7, 8], [5, 6, 7], 3, [5, 6, 7, 8]),  # all accepted: the bonus follows
    ([5, 6, 7, 8], [5, 9, 7], 3, [5, 6, -1, -1]),  # first mismatch at 1: emit the target's 6 there
    ([5, 6, 7, 8], [1, 6, 7], 3, [5, -1, -1, -1]),  # mismatch at 0
    ([5, 6, 7, 8], [5, 6, 7], 0, [5, -1, -1, -1]),  # no drafts: the bonus at position 0
    ([5, 6, 7, 8], [5, 6, 3], 2, [5, 6, 7, -1]),  # n_b = 2: the draft at 2 is ignored, target[2] is the bonus
]


@pytest.mark.parametrize("verify", [greedy_verify_ref, greedy_verify_triton])
def test_greedy_verify_cases(device, verify):
    target = torch.tensor([case[0] for case in GREEDY_CASES], device=device)
    drafts = torch.tensor([case[1] for case in GREEDY_CASES], device=device)
    num_drafts = torch.tensor([case[2] for case in GREEDY_CASES], device=device)
    expected = torch.tensor([case[3] for case in GREEDY_CASES], device=device)
    assert torch.equal(verify(target, drafts, num_drafts), expected)
    assert torch.equal(verify(target[:1], drafts[:1]), expected[:1])  # num_draft_tokens defaults to k
    assert verify(target[:0], drafts[:0]).shape == (0, 4)


def test_greedy_verify_triton_matches_ref_random(device, triton_backend):
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (64, 6), generator=gen).to(device)
    drafts = torch.randint(0, 3, (64, 5), generator=gen).to(device)
    num_drafts = torch.randint(0, 6, (64,), generator=gen).to(device)
    assert torch.equal(greedy_verify(target, drafts, num_drafts), greedy_verify_ref(target, drafts, num_drafts))


@pytest.mark.parametrize("verify", [rejection_sample_ref, rejection_sample_triton])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_one_hot_target_reduces_to_greedy(device, verify, with_draft_probs):
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab_size = 16, 4, 6
    target_argmax = torch.randint(0, 3, (batch, k + 1), generator=gen).to(device)
    drafts = torch.randint(0, 3, (batch, k), generator=gen).to(device)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen).to(device)
    target = torch.nn.functional.one_hot(target_argmax, vocab_size).float()
    draft = torch.rand(batch, k, vocab_size, generator=gen).to(device) if with_draft_probs else None
    expected = greedy_verify_ref(target_argmax, drafts, num_drafts)
    for seed in (0, 1):
        assert torch.equal(verify(target, drafts, draft, seed=seed, num_draft_tokens=num_drafts), expected)
