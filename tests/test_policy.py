"""The goodput rule for choosing how many guesses to verify."""

import time

import pytest
import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.speculative import cost
from nanospec.speculative.policy import (AcceptanceEstimate, GoodputPolicy, chain_ranking, non_decreasing_fit,
                                         sibling_trials, trie_chances)
from nanospec.speculative.proposal import Proposal, Verdict

CPU_FP32 = [38.0, 72.0, 70.0, 71.0, 72.0, 73.0]  # ms per forward of 1..6 tokens (MODEL_NOTES, this CPU)
GPU_FLAT = [10.0] * 6  # a GPU: verifying 6 tokens costs what 1 does


def estimate(successes, trials):
    return AcceptanceEstimate(successes=successes, trials=trials)


def choose_ks(policy, estimates, num_tokens, num_seqs):
    """Each chain's depth: the policy over each one's ranking (depth j with chance alpha^j)."""
    return policy.choose_nodes([chain_ranking(e.alpha(), policy.max_k) for e in estimates], num_tokens, num_seqs)


def choose_k(policy, e):
    return choose_ks(policy, [e], 1, 1)[0]


def expected_tokens(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_flat_cost_curve_always_guesses_the_most():
    policy = GoodputPolicy(5, GPU_FLAT)
    assert choose_k(policy, estimate(1, 10)) == 5  # alpha ~ 0.18: any acceptance pays
    assert choose_k(policy, estimate(9, 10)) == 5


def test_cpu_cost_curve_guesses_only_when_acceptance_is_high():
    policy = GoodputPolicy(5, CPU_FP32)
    assert choose_k(policy, estimate(0, 20)) == 0       # alpha ~ 0.05: plain decoding is faster
    assert choose_k(policy, estimate(19, 20)) == 5      # alpha ~ 0.9: guess as many as allowed
    assert choose_k(policy, AcceptanceEstimate()) == 5  # prior 0.6: worth a try


def test_draft_cost_limits_k():
    # each guess costs a third of a target forward: long chains stop paying at moderate acceptance
    policy = GoodputPolicy(5, GPU_FLAT, draft_cost=3.3)
    assert 0 < choose_k(policy, estimate(14, 20)) < 5


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


# this CPU, SmolLM2 fp32, ms per forward over m tokens (RESULTS.md: 2: 1.08x, 8: 1.41x, 16: 2.0x, 32: 3.0x)
CPU_CURVE = [40.0, 43.2, 48.0, 51.2, 53.6, 56.0]
CPU_LARGER = {12: 66.4, 24: 96.0, 48: 150.0, 96: 260.0}


def single_sequence_rule(policy, e):
    """argmax over k of E(k) / (T(k + 1) + k D), the smallest k on ties (the module docstring's rule)."""
    alpha = e.alpha()
    return max(range(policy.max_k + 1), key=lambda k: (
        expected_tokens(alpha, k) / (policy.target_cost[k] + k * policy.draft_cost), -k))


def test_batch_of_one_is_the_single_sequence_rule():
    policy = GoodputPolicy(5, CPU_CURVE, larger_forwards=CPU_LARGER)
    for successes in (0, 2, 5, 10, 15, 19):
        e = estimate(successes, 20)
        assert choose_ks(policy, [e], 1, 1) == [single_sequence_rule(policy, e)]
    drafted = GoodputPolicy(5, GPU_FLAT, draft_cost=3.3)
    assert choose_ks(drafted, [estimate(14, 20)], 1, 1) == [single_sequence_rule(drafted, estimate(14, 20))]


def test_forward_cost_interpolates_and_extrapolates():
    policy = GoodputPolicy(5, CPU_CURVE, larger_forwards=CPU_LARGER)
    assert policy.forward_cost(1) == 40.0 and policy.forward_cost(6) == 56.0
    assert policy.forward_cost(9) == pytest.approx(56.0 + (66.4 - 56.0) * 3 / 6)
    assert policy.forward_cost(192) == pytest.approx(260.0 + (260.0 - 150.0) * 2)


def test_a_compute_bound_batch_guesses_only_what_is_likely_to_pay():
    policy = GoodputPolicy(5, CPU_CURVE, larger_forwards=CPU_LARGER)
    alone = choose_k(policy, estimate(8, 20))
    assert alone > 0  # alpha ~0.4 pays for a sequence alone on this CPU ...
    assert choose_ks(policy, [estimate(8, 20)] * 16, 16, 16) == [0] * 16  # ... not in a batch of 16
    ks = choose_ks(policy, [estimate(8, 20)] * 15 + [estimate(20, 20)], 16, 16)
    assert ks[:15] == [0] * 15 and ks[15] > 0  # the one that is nearly always right still guesses


def test_a_flat_cost_curve_guesses_the_most_in_a_batch_too():
    policy = GoodputPolicy(5, GPU_FLAT, larger_forwards={12: 10.0, 24: 10.0, 48: 10.0, 96: 10.0})
    assert choose_ks(policy, [estimate(3, 10)] * 16, 16, 16) == [5] * 16


def test_a_ranked_tree_verifies_the_nodes_likely_enough_to_pay():
    """A forward's cost doubles past 5 tokens: of a tree's nodes, best first, the first 4 (5 tokens with the root)
    pay; on a flat curve all of them do. In a batch the likeliest nodes of all the sequences go first."""
    tree = [(0.9, 1), (0.8, 2), (0.5, 1), (0.4, 2), (0.3, 3), (0.1, 1), (0.05, 2), (0.01, 3)]
    rising = [10.0] * 5 + [20.0] * 4
    assert GoodputPolicy(8, rising).choose_nodes([tree], 1, 1) == [4]
    assert GoodputPolicy(8, [10.0] * 9).choose_nodes([tree], 1, 1) == [8]
    sure, unsure = [(0.95, 1), (0.9, 2), (0.85, 3)], [(0.3, 1), (0.2, 2)]
    assert GoodputPolicy(8, rising).choose_nodes([unsure, sure], 2, 2) == [0, 3]  # 5 tokens: only the sure pay


def test_a_node_is_priced_for_every_token_it_feeds():
    """A node may feed more than itself (lookahead's first node brings its window): its tokens are priced."""
    rising = [0.75 + 0.25 * m for m in range(1, 13)]  # T(m) = 0.75 + 0.25 m
    assert GoodputPolicy(11, rising).choose_nodes([[(0.9, 1), (0.8, 2)]], 1, 1) == [2]
    assert GoodputPolicy(11, rising).choose_nodes([[(0.9, 1, 9), (0.8, 2)]], 1, 1) == [0]  # 2.7 / T(11) < 1 / T(1)
    assert GoodputPolicy(11, [1.0] * 12).choose_nodes([[(0.9, 1, 9), (0.8, 2)]], 1, 1) == [2]


def test_a_ranked_chain_is_the_chain_rule():
    policy = GoodputPolicy(5, CPU_CURVE, larger_forwards=CPU_LARGER, draft_cost=2.0)
    for successes in (0, 5, 10, 15, 19):
        alpha = estimate(successes, 20).alpha()
        nodes = [(alpha ** j, j) for j in range(1, 6)]
        assert policy.choose_nodes([nodes], 1, 1) == [single_sequence_rule(policy, estimate(successes, 20))]


def test_a_calibration_is_the_ratio_of_accepted_to_expected():
    e = AcceptanceEstimate()
    e.observe_expected(2.5, 1, decay=1.0)  # guesses predicted 2.5 accepted tokens, one was
    e.observe_expected(1.5, 1, decay=1.0)
    assert (e.successes, e.trials) == (2, 4.0)
    assert e.alpha(0.7) == pytest.approx((2 + 2 * 0.7) / (4 + 2))


def test_timing_noise_cannot_make_more_tokens_cheaper():
    """A forward over 3 tokens timed below one over 2 (noise) is priced, with it, at their mean: more tokens
    never cost less, and one slow timing does not make the guesses after it free."""
    policy = GoodputPolicy(3, [10.0, 14.0, 12.0, 15.0], larger_forwards={8: 13.0})
    assert [policy.forward_cost(m) for m in (1, 2, 3, 4, 8)] == [10.0, 13.0, 13.0, 14.0, 14.0]
    # measured on the CI CPU: 1 token 27.9 ms, 2 32.1 (slow), 4 25.4, 9 32.7; a running maximum priced tokens
    # 3..9 at nothing
    cpu = GoodputPolicy(8, [27.9, 32.1, 28.0, 25.4, 28.0, 29.5, 30.5, 31.5, 32.7])
    assert cpu.forward_cost(9) - cpu.forward_cost(3) > 3.0


def test_non_decreasing_fit_is_the_least_squares_isotonic_regression():
    assert non_decreasing_fit([]) == []
    assert non_decreasing_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing_fit([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert non_decreasing_fit([1.0, 5.0, 3.0, 4.0, 6.0]) == [1.0, 4.0, 4.0, 4.0, 6.0]
    assert non_decreasing_fit([3.0, 4.0, 1.0]) == pytest.approx([8 / 3] * 3)  # one value undoes two blocks


def test_a_count_is_timed_as_one_row_up_to_per_seq_then_as_rows_of_per_seq():
    assert cost.forward_shapes([1, 4, 5, 8, 40], per_seq=4, max_seqs=3) == [(1, 1), (1, 4), (2, 4), (2, 4), (3, 4)]
    assert cost.forward_shapes([9], per_seq=4, max_seqs=0) == [(1, 4)]
    assert cost.timing_context(BlockManager(8, 16), 4, max_len=256) == 64
    assert cost.timing_context(BlockManager(4, 16), 4, max_len=256) == 0  # 68 tokens: more than the pool's 64
    assert cost.timing_context(BlockManager(8, 16), 4, max_len=60) == 0


def test_start_up_timing_keeps_each_shapes_faster_pass(monkeypatch):
    """Shapes of up to 16 tokens are timed ascending, then again descending, and keep the faster of the two timings
    (a slow first forward after loading does not stick); larger ones once; the costs come back in the asked order."""
    timed: list[int] = []
    slow_first = {1: 0.050}  # the first timing of one token: cold

    def fake_best_seconds(fn, device, repeats=3):
        fn()
        m = timed[-1]
        seconds = slow_first.pop(m, None) if m not in timed[:-1] else None
        return seconds if seconds is not None else 0.010 + 0.001 * m + 0.0001 * len(timed)

    def execute(batch):
        timed.append(int(batch.input_ids.numel()))

    monkeypatch.setattr(cost, "best_seconds", fake_best_seconds)
    bm = BlockManager(64, 4)
    costs = cost.time_forwards(execute, bm, [(1, 1), (1, 2), (1, 3), (1, 20)], device=torch.device("cpu"),
                               batch_device="cpu", context=8)
    assert timed == [8, 1, 2, 3, 20, 20, 3, 2, 1]  # the context's prefill, ascending (20 run untimed first), then
    # descending up to 16
    assert costs[0] == pytest.approx(0.010 + 0.001 + 0.0001 * 9)  # the cold 50 ms replaced by the warm timing
    assert costs[1] == pytest.approx(0.010 + 0.002 + 0.0001 * 3)  # each keeps its faster pass
    assert costs[3] == pytest.approx(0.010 + 0.020 + 0.0001 * 6)
    assert bm.num_free_blocks == 64


def test_start_up_timing_leaves_out_a_shapes_first_forward():
    """A runner's first forward of a shape captures its CUDA graph (and may compile kernels): tens of milliseconds
    that no later step pays. A shape timed once (more than 16 tokens) is run untimed first, so the policy does not
    price a batch's forward as a capture (which flattened its cost curve at batch 30: every guess looked free)."""
    seen: set[tuple[int, int]] = set()
    capture = 0.05

    def execute(batch):  # the first forward of each (sequences, max tokens) shape "captures"
        shape = (batch.seq_lens.shape[0], batch.max_query_len)
        if shape not in seen:
            seen.add(shape)
            time.sleep(capture)

    bm = BlockManager(256, 4)
    shapes = [(1, 1), (1, 6), (2, 6), (4, 6), (8, 6), (32, 6)]
    costs = cost.time_forwards(execute, bm, shapes, device=torch.device("cpu"), batch_device="cpu", context=8)
    assert max(costs) < capture / 2, costs
    assert bm.num_free_blocks == 256


def test_a_tries_chances_follow_its_siblings_in_order():
    """Each sibling in turn is right with chance alpha where the ones before it were wrong: a chain's depth j has
    alpha^j, and siblings' chances never sum past their parent's, so a trie's expected accepted depth stays within
    its depth (ranked as a chain's nodes, a wide trie would promise more tokens than it can give)."""
    a = 0.6
    parents = [-1, 0, -1, 0, 1]  # root -> t0 -> t1 -> t4, root -> t2, t0 -> t3
    assert trie_chances(parents, a) == pytest.approx([a, a * a, a * (1 - a), a * a * (1 - a), a ** 3])
    assert trie_chances([-1, 0, 1], a) == pytest.approx([a, a ** 2, a ** 3])
    wide = [-1] * 5 + [0] * 5 + [5] * 5  # five first guesses, five under the first, five under that one
    for alpha in (0.3, 0.6, 0.9):
        chances = trie_chances(wide, alpha)
        assert sum(chances[:5]) <= 1 and sum(chances[5:10]) <= chances[0] + 1e-12
        assert sum(chances) < 3
    ranked = Proposal([7, 8, 9, 10, 11], parents).ranked_as_trie(0.3)  # (1 - a) > a: a first guess beats a depth 2
    assert ranked.token_ids == [7, 9, 8, 10, 11] and ranked.parents == [-1, -1, 0, 0, 2]
    assert ranked.chances == sorted(ranked.chances, reverse=True)


def test_a_tries_trials_are_the_siblings_tried_down_the_accepted_path():
    parents = [-1, 0, -1, 0, 1]
    assert sibling_trials(parents, []) == 2         # both first guesses wrong
    assert sibling_trials(parents, [2]) == 2        # the second right (it has no children)
    assert sibling_trials(parents, [0]) == 1 + 2    # the first right, then both its children wrong
    assert sibling_trials(parents, [0, 3]) == 1 + 2
    assert sibling_trials(parents, [0, 1, 4]) == 1 + 1 + 1
    assert [sibling_trials([-1, 0, 1], [0, 1, 2][:n]) for n in range(4)] == [1, 2, 3, 3]  # a chain: min(k, n + 1)
    estimate = AcceptanceEstimate()
    estimate.observe_trie(Proposal(unverified_guesses=(5, 6, 7)), Verdict(emitted=[6]))  # left out of verification
    assert (estimate.successes, estimate.trials) == (1, 2)
    estimate = AcceptanceEstimate()
    estimate.observe_trie(Proposal([5, 6, 7], [-1, -1, 0]), Verdict(emitted=[9], path=[]))
    assert (estimate.successes, estimate.trials) == (0, 2)
