"""Sampling kernels: the Triton kernels (interpreted on CPU) against the torch reference, the reference
against a plain sort-based definition, and the reference's empirical distribution against the
probabilities it samples from.

Triton against the reference on the test device (the probabilities with a 1e-5 tolerance, the draws from them bit
for bit); the reference's semantics and statistics on the CPU, by intent (the kernels follow it)."""

import math

import pytest
import torch

from nanospec.kernels.backend import backend
from nanospec.kernels.sampling import (
    probs_from_logits,
    probs_from_logits_ref,
    probs_from_logits_triton,
    sample,
    sample_from_probs,
    sample_from_probs_ref,
    sample_from_probs_triton,
    sample_ref,
)

# (temperature, top_k, top_p) of the rows of a mixed batch
MIXED_ROWS = [
    (0.0, 0, 1.0),  # greedy
    (1.0, -1, 1.0),  # temperature only
    (0.7, 5, 1.0),  # top-k only
    (1.3, 0, 0.9),  # top-p only
    (1.0, 3, 0.8),  # both
    (2.0, 1, 1.0),  # top_k = 1
    (0.5, 0, 1e-6),  # tiny top_p
    (1.5, 300, 0.95),  # both, a nucleus larger than the reference's first 64 candidates
]
SEEDS = [0, 7, 2**32, -1, 2**62 + 12345, -(2**63), 31337, 2**33 + 1]


def mixed_batch(vocab_size, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED_ROWS), vocab_size, generator=generator) * 3
    logits[0, vocab_size // 2] = logits[0, -1] = 20.0  # a tie for the argmax: the first one wins
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*MIXED_ROWS))
    return (
        logits.to(device),
        temperature.float().to(device),
        top_k.int().to(device),
        top_p.float().to(device),
        torch.tensor(SEEDS, dtype=torch.int64, device=device),
        torch.arange(len(MIXED_ROWS), dtype=torch.int64, device=device) * 1000 + 17,
    )


def sort_based_probs(logits, temperature, top_k, top_p, min_p=None):
    """The module docstring's definition, row by row with a full sort: the oracle for the reference. min-p as vLLM
    applies it: the tokens below ``min_p`` times the largest probability become -inf before top-k and top-p."""
    out = torch.zeros(logits.shape, dtype=torch.float32)
    for row, x in enumerate(logits.float().cpu()):
        t, k, p = float(temperature[row]), int(top_k[row]), float(top_p[row])
        if t == 0:
            out[row, int(x.argmax())] = 1.0
            continue
        if min_p is not None and min_p[row] > 0:
            probs = torch.softmax(x / t, dim=0)
            x = torch.where(probs >= float(min_p[row]) * probs.max(), x, float("-inf"))
        weights = torch.exp((x - x.max()) / t)
        sorted_x, order = x.sort(descending=True)
        keep = torch.ones_like(x, dtype=torch.bool)
        if 0 < k < x.numel():
            keep &= x >= sorted_x[k - 1]
        if p < 1:
            cumulative = (weights * keep)[order].cumsum(0)
            crossing = int((cumulative < p * cumulative[-1]).sum())
            keep &= x >= sorted_x[crossing]
        out[row] = weights * keep / (weights * keep).sum()
    return out


def total_variation(samples, probs):
    empirical = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (empirical - probs.double() / probs.sum()).abs().sum().item()


# ------------------------------------------------------------------------------------------------
# Triton against the reference


@pytest.mark.parametrize("vocab_size", [1, 7, 1000, 1031])
def test_triton_matches_ref_on_mixed_rows(vocab_size, device):
    logits, temperature, top_k, top_p, seeds, offsets = mixed_batch(vocab_size, device)
    expected = probs_from_logits_ref(logits, temperature, top_k, top_p)
    probs = probs_from_logits_triton(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(probs > 0, expected > 0)
    # sample_triton is sample_from_probs_triton(probs_from_logits_triton(...)): the same tokens
    assert torch.equal(sample_from_probs_triton(probs, seeds, offsets),
                       sample_ref(logits, temperature, top_k, top_p, seeds, offsets))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_logits_and_row_stride(dtype, device):
    logits, temperature, top_k, top_p, seeds, offsets = mixed_batch(1100, device, seed=1)
    logits = logits.to(dtype)[:, :1031]  # rows 1100 apart: the kernels take a row stride
    expected = probs_from_logits_ref(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs_from_logits_triton(logits, temperature, top_k, top_p), expected,
                               atol=1e-5, rtol=1e-5)


def test_sample_from_probs_triton_is_bit_identical_to_ref(device):
    generator = torch.Generator().manual_seed(2)
    num_rows, vocab_size = 64, 37
    probs = torch.rand(num_rows, vocab_size, generator=generator)
    probs[probs < 0.4] = 0.0  # zeros are never drawn
    probs *= torch.logspace(-30, 30, num_rows)[:, None]  # unnormalised, at any scale
    probs[:8] = 0.0
    probs[torch.arange(8), torch.arange(8) * 5] = 1.0  # one-hot rows
    seeds = torch.randint(-(2**63), 2**63 - 1, (num_rows,), generator=generator, dtype=torch.int64)
    offsets = torch.randint(0, 2**40, (num_rows,), generator=generator, dtype=torch.int64)
    probs, seeds, offsets = probs.to(device), seeds.to(device), offsets.to(device)

    tokens = sample_from_probs_triton(probs, seeds, offsets)
    assert torch.equal(tokens, sample_from_probs_ref(probs, seeds, offsets))
    assert torch.equal(tokens[:8].cpu(), torch.arange(8) * 5)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_sample_from_probs_across_blocks(device):
    generator = torch.Generator().manual_seed(3)
    probs = torch.rand(6, 1031, generator=generator) ** 8  # mass spread over both 1024-wide blocks
    probs[0] = 0.0
    probs[0, 1030] = 0.25  # the last token, alone in the second block
    probs[1, :1024] = 0.0  # only the second block has mass
    seeds = torch.tensor(SEEDS[:6], device=device)
    offsets = torch.arange(6, device=device)
    tokens = sample_from_probs_triton(probs.to(device), seeds, offsets)
    assert torch.equal(tokens, sample_from_probs_ref(probs.to(device), seeds, offsets))
    assert tokens[0] == 1030 and tokens[1] >= 1024


def test_greedy_rows_take_the_first_argmax_across_blocks(device):
    """Temperature 0: the one-hot of the argmax, the first index on ties, within a block and across blocks."""
    logits = torch.randn(5, 1031)
    logits[0, [5, 1030]] = 10.0  # tie across blocks: the first wins
    logits[1, [1025, 1030]] = 10.0  # tie inside the second block
    logits[2] = 1.0  # all equal: index 0
    logits[3] = float("-inf")
    logits[3, 1027] = -1e30
    logits[4, 1023:1025] = 10.0  # tie straddling the block boundary
    logits = logits.to(device)
    greedy = (torch.zeros(5, device=device), torch.zeros(5, dtype=torch.int32, device=device),
              torch.ones(5, device=device))
    for probs in (probs_from_logits_triton(logits, *greedy), probs_from_logits_ref(logits, *greedy)):
        assert probs.argmax(-1).tolist() == [5, 1025, 0, 1027, 1023] and probs.sum(-1).tolist() == [1.0] * 5


def test_empty_batch(device, triton_backend):
    for impl in ("triton", "torch"):
        with backend(impl):
            logits = torch.randn(0, 11, device=device)
            no_rows = torch.zeros(0, device=device)
            no_ints = torch.zeros(0, dtype=torch.int64, device=device)
            assert probs_from_logits(logits, no_rows, no_ints.int(), no_rows).shape == (0, 11)
            assert sample_from_probs(logits, no_ints, no_ints).shape == (0,)
            assert sample(logits, no_rows, no_ints.int(), no_rows, no_ints, no_ints).shape == (0,)


def test_dispatcher_follows_the_backend(device, triton_backend):
    logits, temperature, top_k, top_p, seeds, offsets = mixed_batch(7, device)
    triton_tokens = sample(logits, temperature, top_k, top_p, seeds, offsets)
    with backend("torch"):
        assert torch.equal(sample(logits, temperature, top_k, top_p, seeds, offsets), triton_tokens)


# ------------------------------------------------------------------------------------------------
# the semantics (reference; the Triton kernel follows it by the tests above)


def test_tie_rules_on_both_backends(device):
    # greedy and top-k: x = [1, 3, 3, 2, 3, 0]; top-p: probabilities [0.4, 0.2, 0.2, 0.1, 0.1]
    top_k_logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    top_p_logits = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1, 0.0]))
    rows = [  # (logits, temperature, top_k, top_p, the kept tokens)
        (top_k_logits, 0.0, 0, 1.0, [1]),  # argmax: first of the tied 3s
        (top_k_logits, 1.0, 2, 1.0, [1, 2, 4]),  # the k-th value 3 repeats: all three kept
        (top_k_logits, 1.0, 4, 1.0, [1, 2, 3, 4]),
        (top_p_logits, 1.0, 0, 0.3, [0]),  # 0.4 >= 0.3 already
        (top_p_logits, 1.0, 0, 0.0, [0]),  # top_p <= 0 still keeps the most probable token
        (top_p_logits, 1.0, 0, 0.5, [0, 1, 2]),  # crosses at a 0.2: its tie is kept too
        (top_p_logits, 1.0, 0, 0.7, [0, 1, 2]),
        (top_p_logits, 1.0, 0, 0.85, [0, 1, 2, 3, 4]),  # crosses at a 0.1, tie kept; -inf never
        (top_p_logits, 1.0, 2, 0.6, [0, 1, 2]),  # top-k keeps the tied 0.2s; 0.4 < 0.6 * 0.8
        (top_p_logits, 1.0, 2, 0.4, [0]),  # 0.4 >= 0.4 * 0.8
    ]
    logits = torch.stack([row[0] for row in rows]).to(device)
    temperature = torch.tensor([row[1] for row in rows], device=device)
    top_k = torch.tensor([row[2] for row in rows], dtype=torch.int32, device=device)
    top_p = torch.tensor([row[3] for row in rows], device=device)
    for probs in (probs_from_logits_ref(logits, temperature, top_k, top_p),
                  probs_from_logits_triton(logits, temperature, top_k, top_p)):
        for row, (x, *_, kept) in enumerate(rows):
            assert (probs[row] > 0).nonzero().flatten().tolist() == kept, row
            expected = torch.zeros(6)
            expected[kept] = torch.softmax(x[kept], dim=0) if rows[row][1] > 0 else 1.0
            torch.testing.assert_close(probs[row].cpu(), expected)


@pytest.mark.parametrize("vocab_size", [1, 7, 1000, 49152])
def test_ref_matches_sort_based_definition(vocab_size):
    rows = MIXED_ROWS + [(1.0, 0, 0.999), (0.3, 49152, 0.5), (1.0, 20, 0.9999)]
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(len(rows), vocab_size, generator=generator) * 3
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*rows))
    temperature, top_k, top_p = temperature.float(), top_k.int(), top_p.float()
    probs = probs_from_logits_ref(logits, temperature, top_k, top_p)
    expected = sort_based_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(probs > 0, expected > 0)


# (temperature, top_k, top_p, min_p)
MIN_P_ROWS = [(1.0, 0, 1.0, 0.05), (0.7, 5, 1.0, 0.1), (1.3, 0, 0.9, 0.02), (2.0, -1, 1.0, 0.5),
              (0.5, 300, 0.95, 0.001), (1.0, -1, 1.0, 1.0), (0.0, 0, 1.0, 0.3), (1.5, 1, 1.0, 0.2)]


def min_p_batch(vocab_size, device, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIN_P_ROWS), vocab_size, generator=generator) * 3
    temperature, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*MIN_P_ROWS))
    return (logits.to(device), temperature.float().to(device), top_k.int().to(device), top_p.float().to(device),
            min_p.float().to(device))


@pytest.mark.parametrize("vocab_size", [1, 7, 1000, 49152])
def test_min_p_ref_matches_sort_based_definition(vocab_size):
    logits, temperature, top_k, top_p, min_p = min_p_batch(vocab_size, "cpu", seed=vocab_size)
    probs = probs_from_logits_ref(logits, temperature, top_k, top_p, min_p)
    expected = sort_based_probs(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(probs > 0, expected > 0)
    if vocab_size >= 1000:  # min-p removed tokens that temperature, top-k and top-p alone keep
        assert (probs > 0).sum() < (probs_from_logits_ref(logits, temperature, top_k, top_p) > 0).sum()


@pytest.mark.parametrize("vocab_size", [7, 1031])
def test_min_p_triton_matches_ref(vocab_size, device):
    logits, temperature, top_k, top_p, min_p = min_p_batch(vocab_size, device, seed=5)
    expected = probs_from_logits_ref(logits, temperature, top_k, top_p, min_p)
    probs = probs_from_logits_triton(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(probs > 0, expected > 0)
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=device)
    offsets = torch.arange(len(MIN_P_ROWS), dtype=torch.int64, device=device)
    assert torch.equal(sample(logits, temperature, top_k, top_p, seeds, offsets, min_p),
                       sample_ref(logits, temperature, top_k, top_p, seeds, offsets, min_p))


def test_min_p_kept_tokens_on_both_backends(device):
    # probabilities [0.4, 0.2, 0.2, 0.1, 0.05, 0.05, 0]: ratios to the largest 1, .5, .5, .25, .125, .125, 0
    x = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.1, 0.05, 0.05, 0.0]))
    rows = [  # (temperature, top_k, top_p, min_p, the kept tokens)
        (1.0, 0, 1.0, 0.0, [0, 1, 2, 3, 4, 5]),  # off; -inf never
        (1.0, 0, 1.0, 0.4, [0, 1, 2]),
        (1.0, 0, 1.0, 0.2, [0, 1, 2, 3]),
        (1.0, 0, 1.0, 1.0, [0]),  # only the likeliest
        (1.0, 0, 1.0, 0.6, [0]),
        (2.0, 0, 1.0, 0.6, [0, 1, 2]),  # after temperature: ratios sqrt(.5) = .71 >= .6 > sqrt(.25)
        (1.0, 1, 1.0, 0.2, [0]),  # top-k below min-p's count
        (1.0, 5, 1.0, 0.4, [0, 1, 2]),  # min-p below top-k's
        (1.0, 0, 0.6, 0.2, [0, 1, 2]),  # top-p over min-p's 0.9: 0.4 < 0.54 <= 0.8, the tied 0.2 kept
    ]
    logits = x.expand(len(rows), -1).contiguous().to(device)
    temperature, top_k, top_p, min_p = (torch.tensor([row[i] for row in rows], device=device) for i in range(4))
    top_k = top_k.int()
    for probs in (probs_from_logits_ref(logits, temperature, top_k, top_p, min_p),
                  probs_from_logits_triton(logits, temperature, top_k, top_p, min_p)):
        for row, (t, *_, kept) in enumerate(rows):
            assert (probs[row] > 0).nonzero().flatten().tolist() == kept, row
            expected = torch.zeros(7)
            expected[kept] = torch.softmax(x[kept] / t, dim=0)
            torch.testing.assert_close(probs[row].cpu(), expected)


# ------------------------------------------------------------------------------------------------
# the draws (reference, vectorised over rows)

# With n draws from V outcomes, P(TV >= eps) <= 2**V * exp(-2 n eps**2) (Bretagnolle-Huber-Carol).
# n = 20000, V <= 8, eps = 0.03: under 1e-13, so a failure means a wrong distribution, not bad luck.
NUM_DRAWS = 20000
TV_BOUND = 0.03


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.5, 0, 0.8), (1.0, 5, 0.9)])
def test_sample_distribution_matches_probs(temperature, top_k, top_p):
    assert 2**8 * math.exp(-2 * NUM_DRAWS * TV_BOUND**2) < 1e-12
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    args = (torch.tensor([temperature]), torch.tensor([top_k], dtype=torch.int32), torch.tensor([top_p]))
    probs = probs_from_logits_ref(logits[None], *args)[0]
    n = NUM_DRAWS
    tokens = sample_ref(logits.expand(n, -1), *(a.expand(n) for a in args),
                        torch.full((n,), 1234, dtype=torch.int64), torch.arange(n))
    assert total_variation(tokens, probs) < TV_BOUND
    assert bool((probs[tokens] > 0).all())  # filtered-out tokens are never drawn
    if top_k or top_p < 1:  # the bound tells the filtered distribution from the unfiltered one
        unfiltered = torch.softmax(logits / temperature, dim=0)
        assert 0.5 * (probs - unfiltered).abs().sum() > 2 * TV_BOUND


def test_sample_from_probs_distribution_over_seeds():
    probs = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.5, 0.0, 2.0])  # unnormalised, with zeros
    n = NUM_DRAWS
    seeds = torch.arange(n, dtype=torch.int64) * 0x5851F42D4C957F2D  # wraps: large and negative seeds
    tokens = sample_from_probs_ref(probs.expand(n, -1), seeds, torch.full((n,), 5, dtype=torch.int64))
    assert total_variation(tokens, probs) < TV_BOUND
    assert bool((probs[tokens] > 0).all())


def test_one_hot_rows_always_give_their_token(device):
    n, vocab_size = 4096, 50
    hot = torch.arange(n) % vocab_size
    probs = torch.nn.functional.one_hot(hot, vocab_size).float() * torch.logspace(-20, 20, n)[:, None]
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64)
    tokens = sample_from_probs_ref(probs, seeds, torch.arange(n))
    assert torch.equal(tokens, hot)
    few = slice(0, 16)
    assert torch.equal(sample_from_probs_triton(probs[few].to(device), seeds[few].to(device),
                                                torch.arange(16, device=device)).cpu(), hot[few])


def test_row_without_mass_gives_token_zero(device):
    probs = torch.zeros(2, 9, device=device)
    probs[1, 4] = -1.0  # negative entries count as zero
    seeds, offsets = torch.tensor([3, 4], device=device), torch.tensor([0, 1], device=device)
    assert sample_from_probs_ref(probs, seeds, offsets).tolist() == [0, 0]
    assert sample_from_probs_triton(probs, seeds, offsets).tolist() == [0, 0]


def test_seeded_draws_are_reproducible_and_batch_independent():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 1000, generator=generator)
    temperature, top_k, top_p = torch.ones(64), torch.full((64,), 100, dtype=torch.int32), torch.full((64,), 0.95)
    seeds = torch.randint(-(2**63), 2**63 - 1, (64,), generator=generator, dtype=torch.int64)
    offsets = torch.arange(64) + 10
    tokens = sample_ref(logits, temperature, top_k, top_p, seeds, offsets)
    assert torch.equal(tokens, sample_ref(logits, temperature, top_k, top_p, seeds, offsets))
    one_by_one = [sample_ref(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                             seeds[i : i + 1], offsets[i : i + 1]).item() for i in range(64)]
    assert tokens.tolist() == one_by_one
    # the seed and the offset both matter
    assert (tokens != sample_ref(logits, temperature, top_k, top_p, seeds + 1, offsets)).sum() > 32
    assert (tokens != sample_ref(logits, temperature, top_k, top_p, seeds, offsets + 1)).sum() > 32
