"""How many tokens to guess: the goodput rule (Liu et al. 2024, "SmartSpec"), for the whole batch.

If each draft is accepted with probability ``alpha`` (independently), verifying ``k`` drafts yields
on average ``E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)`` tokens and costs
``C(k) = T(k+1) + k * D``, where ``T(m)`` is the target's forward time over ``m`` tokens and ``D``
one draft forward (0 for the n-gram proposer). Alone, a sequence verifies the ``k`` in ``0..K``
that maximises ``E(k) / C(k)``. In a batch every guess shares one forward: with ``M`` tokens fed
without guesses and ``S`` sequences (each emits a token), guess ``j`` of sequence ``i`` adds
``alpha_i^j`` expected tokens and one token to the forward, so the engine takes guesses in order of
that chance and keeps the prefix that maximises ``(S + sum of chances) / (T(M + n) + max_i k_i D)``.
At batch 1 this is the rule above. ``T`` and ``D`` are measured on this machine when the engine
starts: on a GPU ``T`` is flat until the batch is large and speculation pays; on the 2-core CI CPU
in fp32 (SmolLM2, warm) a forward over 3-6 tokens costs about what one over a single token does, over 8
~1.1 single ones, over 16 ~1.5 and over 32 ~3, so past a few a guess must be right often enough to pay
for its share, and in a batch of 16 far more often.

**Ranked trees** (the MLP speculator's beam): a proposer that can say, for every node of its tree, the chance
that the node lies on the accepted path hands the nodes over best first (a parent is never less likely than its
child, so every prefix is a tree). The same rule then runs over nodes instead of depths: node ``j`` of sequence
``i`` adds its chance ``c_ij`` and one token, ``longest`` is the deepest node taken, and each sequence verifies
a prefix of its list. It holds because at most one node per depth is accepted: the expected number of accepted
guesses is the sum of the verified nodes' chances. On a GPU, where ``T`` is flat, a wide tree is verified
whole; on a CPU only the few nodes likely enough to pay for their token. A chain is the list
``(alpha, alpha^2, ..)``.

``alpha`` is estimated per request from its own history: decayed counts of accepted and tried
drafts, shrunk towards a prior, ``alpha = (S + PRIOR_WEIGHT * prior) / (N + PRIOR_WEIGHT)``. The
counts decay every step, so a request that stopped speculating drifts back to the prior and probes
again. Greedy and sampled outputs are unaffected: only how many candidates are checked changes.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_WEIGHT = 2.0


@dataclass
class AcceptanceEstimate:
    successes: float = 0.0
    trials: float = 0.0

    def alpha(self, prior: float) -> float:
        return (self.successes + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)

    def observe(self, num_tried: int, num_accepted: int, decay: float) -> None:
        """``num_tried`` drafts were checked in order; the first ``num_accepted`` matched."""
        self.observe_expected(min(num_tried, num_accepted + 1), num_accepted, decay)

    def observe_expected(self, expected: float, num_accepted: int, decay: float) -> None:
        """As a calibration: guesses predicted to give ``expected`` accepted tokens gave ``num_accepted``
        (``alpha`` is then the ratio of the two, decayed and shrunk towards the prior)."""
        self.successes = decay * self.successes + num_accepted
        self.trials = decay * self.trials + expected


def non_decreasing_fit(values: list[float]) -> list[float]:
    """Isotonic regression (pool adjacent violators): the non-decreasing sequence closest to ``values`` in
    squared error, each run of values that would fall replaced by the run's mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(count)]


class GoodputPolicy:
    def __init__(self, max_k: int, target_cost: list[float], draft_cost: float = 0.0, prior: float = 0.6,
                 decay: float = 0.8, larger_forwards: dict[int, float] | None = None):
        """``target_cost[m - 1]`` is the measured time of a target forward over ``m`` tokens, m = 1..max_k+1
        (``max_k``: the most guesses, or nodes, one sequence verifies); ``draft_cost``: one depth of guessing;
        ``larger_forwards`` maps larger token counts to their measured times (batches). A forward over more
        tokens never costs less, so the points are first made non-decreasing by isotonic regression (the
        least-squares non-decreasing fit: runs of points that fall are replaced by their mean); then between
        points the cost is interpolated linearly, past the last one extrapolated along the last two."""
        if len(target_cost) < max_k + 1:
            raise ValueError(f"need target costs for 1..{max_k + 1} tokens, got {len(target_cost)}")
        self.max_k = max_k
        self.target_cost = target_cost
        measured = sorted({**{m + 1: t for m, t in enumerate(target_cost)}, **(larger_forwards or {})}.items())
        self.points = list(zip([m for m, _ in measured], non_decreasing_fit([t for _, t in measured])))
        self.draft_cost = draft_cost
        self.prior = prior
        self.decay = decay

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    def forward_cost(self, num_tokens: int) -> float:
        """``T(num_tokens)`` from the measured points."""
        points = self.points
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (m0, t0), (m1, t1) in zip(points, points[1:]):
            if num_tokens <= m1:
                return t0 + (t1 - t0) * (num_tokens - m0) / (m1 - m0)
        (m0, t0), (m1, t1) = points[-2:] if len(points) > 1 else (points[0], (points[0][0] + 1, points[0][1]))
        return t1 + max(t1 - t0, 0.0) * (num_tokens - m1) / (m1 - m0)

    def choose_k(self, estimate: AcceptanceEstimate) -> int:
        """A sequence alone in its forward: the ``k`` that maximises ``E(k) / C(k)``."""
        return self.choose_ks([estimate], 1, 1)[0]

    def choose_ks(self, estimates: list[AcceptanceEstimate], num_tokens: int, num_seqs: int) -> list[int]:
        """Guesses per speculating sequence (chains) when the forward already feeds ``num_tokens`` tokens of
        ``num_seqs`` sequences (the speculating ones included): guess ``j`` is accepted with chance ``alpha^j``."""
        alphas = [e.alpha(self.prior) for e in estimates]
        return self.choose_nodes([[(alpha ** j, j) for j in range(1, self.max_k + 1)] for alpha in alphas],
                                 num_tokens, num_seqs)

    def choose_nodes(self, chances: list[list[tuple[float, int]]], num_tokens: int, num_seqs: int) -> list[int]:
        """How many of each sequence's nodes to verify: ``chances[i]`` lists sequence ``i``'s nodes best first, each
        as (chance it is on the accepted path, depth), a parent before its children; the forward already feeds
        ``num_tokens`` tokens of ``num_seqs`` sequences. Nodes are taken in order of chance over the whole batch
        (a sequence's own in its order) while the goodput ``(S + sum of chances) / (T(M + n) + longest D)`` grows
        to its best."""
        nodes = sorted(((chance, -j, i, depth) for i, node_list in enumerate(chances)
                        for j, (chance, depth) in enumerate(node_list)), reverse=True)
        counts = [0] * len(chances)
        expected, longest = float(num_seqs), 0
        best_n, best = 0, expected / self.forward_cost(num_tokens)
        for n, (chance, _, i, depth) in enumerate(nodes, 1):
            counts[i] += 1
            expected += chance
            longest = max(longest, depth)
            goodput = expected / (self.forward_cost(num_tokens + n) + longest * self.draft_cost)
            if goodput > best:
                best, best_n = goodput, n
        counts = [0] * len(chances)
        for _, _, i, _ in nodes[:best_n]:
            counts[i] += 1
        return counts
