"""The goodput rule for choosing how many guesses to verify."""

import pytest

from nanospec.spec.policy import AcceptanceEstimate, GoodputPolicy

CPU_FP32 = [38.0, 72.0, 70.0, 71.0, 72.0, 73.0]  # ms per forward of 1..6 tokens (MODEL_NOTES, this CPU)
GPU_FLAT = [10.0] * 6  # a GPU: verifying 6 tokens costs what 1 does


def estimate(successes, trials):
    return AcceptanceEstimate(successes=successes, trials=trials)


def test_expected_tokens():
    assert GoodputPolicy.expected_tokens(0.0, 5) == 1.0
    assert GoodputPolicy.expected_tokens(1.0, 5) == 6.0
    assert GoodputPolicy.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_flat_cost_curve_always_guesses_the_most():
    policy = GoodputPolicy(5, GPU_FLAT)
    assert policy.choose_k(estimate(1, 10)) == 5  # alpha ~ 0.18: any acceptance pays
    assert policy.choose_k(estimate(9, 10)) == 5


def test_cpu_cost_curve_guesses_only_when_acceptance_is_high():
    policy = GoodputPolicy(5, CPU_FP32)
    assert policy.choose_k(estimate(0, 20)) == 0       # alpha ~ 0.05: plain decoding is faster
    assert policy.choose_k(estimate(19, 20)) == 5      # alpha ~ 0.9: guess as many as allowed
    assert policy.choose_k(AcceptanceEstimate()) == 5  # prior 0.6: worth a try


def test_draft_cost_limits_k():
    # each guess costs a third of a target forward: long chains stop paying at moderate acceptance
    policy = GoodputPolicy(5, GPU_FLAT, draft_cost=3.3)
    assert 0 < policy.choose_k(estimate(14, 20)) < 5


def test_estimate_decays_back_towards_the_prior():
    e = AcceptanceEstimate()
    for _ in range(10):
        e.observe(1, 0, decay=0.8)
    low = e.alpha(0.6)
    assert low < 0.2
    for _ in range(20):
        e.observe(0, 0, decay=0.8)  # no observations: counts decay
    assert e.alpha(0.6) > 0.5


def test_observe_counts_the_first_rejection_only():
    e = AcceptanceEstimate()
    e.observe(5, 2, decay=1.0)  # accepted, accepted, rejected; the last two were never judged
    assert (e.successes, e.trials) == (2, 3)
    e.observe(3, 3, decay=1.0)
    assert (e.successes, e.trials) == (5, 6)


def test_needs_costs_for_every_k():
    with pytest.raises(ValueError, match="target costs"):
        GoodputPolicy(5, CPU_FP32[:3])
