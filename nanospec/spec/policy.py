"""How many tokens to guess: the goodput rule (Liu et al. 2024, adapted to batch-1 cost curves).

If each draft is accepted with probability ``alpha`` (independently), verifying ``k`` drafts yields
on average ``E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)`` tokens and costs
``C(k) = T(k+1) + k * D``, where ``T(m)`` is the target's forward time over ``m`` tokens and ``D``
one draft forward (0 for the n-gram proposer). Each step every speculating sequence verifies the
``k`` in ``0..K`` that maximises ``E(k) / C(k)``. ``T`` and ``D`` are measured on this machine when
the engine starts: on a GPU ``T`` is flat and speculation always pays; on the 2-core CI CPU in fp32
(SmolLM2) a forward over 2 tokens costs ~1.1 single ones and over 8 ~1.4, so a guess must be right
often enough to pay for its share (with ``alpha`` below ~0.1, not even one does).

``alpha`` is estimated per request from its own history: decayed counts of accepted and tried
drafts, shrunk towards a prior, ``alpha = (S + PRIOR_WEIGHT * prior) / (N + PRIOR_WEIGHT)``. The
counts decay every step, so a request that stopped speculating drifts back to the prior and probes
again. Greedy and sampled outputs are unaffected: only how many candidates are checked changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

PRIOR_WEIGHT = 2.0


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (synchronising CUDA around each)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class AcceptanceEstimate:
    successes: float = 0.0
    trials: float = 0.0

    def alpha(self, prior: float) -> float:
        return (self.successes + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)

    def observe(self, num_tried: int, num_accepted: int, decay: float) -> None:
        """``num_tried`` drafts were checked in order; the first ``num_accepted`` matched."""
        self.successes = decay * self.successes + num_accepted
        self.trials = decay * self.trials + min(num_tried, num_accepted + 1)


class GoodputPolicy:
    def __init__(self, max_k: int, target_cost: list[float], draft_cost: float = 0.0, prior: float = 0.6,
                 decay: float = 0.8):
        """``target_cost[m - 1]`` is the measured time of a target forward over ``m`` tokens, m = 1..max_k+1."""
        if len(target_cost) < max_k + 1:
            raise ValueError(f"need target costs for 1..{max_k + 1} tokens, got {len(target_cost)}")
        self.max_k = max_k
        self.target_cost = target_cost
        self.draft_cost = draft_cost
        self.prior = prior
        self.decay = decay

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    def cost(self, k: int) -> float:
        return self.target_cost[k] + k * self.draft_cost

    def choose_k(self, estimate: AcceptanceEstimate) -> int:
        alpha = estimate.alpha(self.prior)
        return max(range(self.max_k + 1), key=lambda k: (self.expected_tokens(alpha, k) / self.cost(k), -k))
