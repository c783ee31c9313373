"""How many guesses to verify: the goodput rule (Liu et al. 2024, "SmartSpec"), for the whole batch.

Each ranked node has a chance ``c`` to lie on the accepted path (a chain's depth ``j``: ``alpha^j``). Verifying a set
of nodes of ``S`` sequences yields ``S + sum c`` tokens in expectation and costs ``T(M + n) + d * D``: ``T(m)`` the
target's forward over ``m`` tokens (``M`` fed without guesses, ``n`` nodes), ``D`` one depth of guessing, ``d`` the
most depths of guessing a node taken costs (its depth, unless its proposer's ranking says otherwise); ``n`` counts
every token a node brings (lookahead's first node: the window too). :meth:`GoodputPolicy.choose_nodes` takes nodes in
order of chance and keeps the prefix that maximises the ratio.
``alpha`` per request: ``(S + PRIOR_WEIGHT * prior) / (N + PRIOR_WEIGHT)`` over decayed counts of accepted and tried
guesses. Outputs are unaffected: only how many candidates are checked changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_WEIGHT = 2.0
CHAIN_PRIOR = 0.6  # a chain's alpha before it has been tried
CALIBRATION_PRIOR = 0.7  # a scored tree's c before it has been tried
DECAY = 0.8        # an estimate's counts decay by this a step


@dataclass
class AcceptanceEstimate:
    successes: float = 0.0
    trials: float = 0.0

    def alpha(self, prior: float = CHAIN_PRIOR) -> float:
        return (self.successes + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)

    def observe(self, num_tried: int, num_accepted: int, decay: float = DECAY) -> None:
        """``num_tried`` drafts were checked in order; the first ``num_accepted`` matched."""
        self.observe_expected(min(num_tried, num_accepted + 1), num_accepted, decay)

    def observe_expected(self, expected: float, num_accepted: int, decay: float = DECAY) -> None:
        """Guesses predicted to give ``expected`` accepted tokens gave ``num_accepted``."""
        self.successes = decay * self.successes + num_accepted
        self.trials = decay * self.trials + expected

    def observe_trie(self, proposal, verdict) -> None:
        """After a step of a chain or a trie ranked by :func:`trie_chances`: each sibling tried in rank order on the
        way down the accepted path is a trial, each depth accepted a success; unverified, its first guesses."""
        if proposal.token_ids:
            self.observe_expected(sibling_trials(proposal.parents, verdict.path), verdict.num_accepted)
        elif proposal.unverified_guesses:
            guesses, token = proposal.unverified_guesses, verdict.emitted[0]  # siblings, tried in order
            accepted = token in guesses
            self.observe_expected(guesses.index(token) + 1 if accepted else len(guesses), int(accepted))


def accepted_depth(paths: list[tuple[int, ...]], emitted: list[int]) -> int:
    """The longest of ``paths`` that the emitted tokens begin with (0: none)."""
    return max((len(p) for p in paths if list(p) == emitted[:len(p)]), default=0)


@dataclass
class TreeCalibration:
    """A scored tree's chances (scores ``s``: summed log-probabilities along a path): ``min(1, c * exp(s))``, ``c``
    the accepted depth over the ``exp(s)`` of the verified nodes, estimated per sequence."""
    c: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    paths: dict[tuple[int, ...], float] = field(default_factory=dict)  # the last tree's paths: exp(s)

    def observe(self, verified: list[tuple[int, ...]], emitted: list[int]) -> None:
        drafted = [p for p in verified if p in self.paths]
        if drafted:
            self.c.observe_expected(sum(self.paths[p] for p in drafted), accepted_depth(drafted, emitted))

    def chances(self, paths: list[tuple[int, ...]], scores: list[float]) -> list[float]:
        """Each node's chance in a new tree, whose paths the next :meth:`observe` checks."""
        self.paths = {path: math.exp(s) for path, s in zip(paths, scores)}
        c = self.c.alpha(CALIBRATION_PRIOR)
        return [min(1.0, c * math.exp(s)) for s in scores]


def chain_ranking(alpha: float, k: int) -> list[tuple[float, int]]:
    """A chain's nodes as the policy sees them: depth ``j`` lies on the accepted path with chance ``alpha^j``."""
    return [(alpha ** j, j) for j in range(1, k + 1)]


def trie_chances(parents: list[int], alpha: float) -> list[float]:
    """Each node's chance to lie on the accepted path when each candidate among siblings, in order, is right with
    chance ``alpha`` where the ones before it were wrong: ``chance(parent) * alpha * (1 - alpha)^r`` for the ``r``-th
    child (a chain's depth ``j``: ``alpha^j``). Siblings' chances sum to at most their parent's."""
    chances: list[float] = []
    num_children: dict[int, int] = {}
    for parent in parents:
        r = num_children[parent] = num_children.get(parent, -1) + 1
        chances.append((chances[parent] if parent >= 0 else 1.0) * alpha * (1 - alpha) ** r)
    return chances


def sibling_trials(parents: list[int], path: list[int]) -> int:
    """The candidates :func:`trie_chances`' model tried for an accepted ``path`` (node indices, root's child first):
    at each depth accepted the siblings up to the accepted one, then every child of the last accepted node."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    trials, parent = 0, -1
    for node in path:
        trials += children[parent].index(node) + 1
        parent = node
    return trials + len(children.get(parent, ()))


def non_decreasing_fit(values: list[float]) -> list[float]:
    """Isotonic regression (pool adjacent violators): the non-decreasing sequence closest to ``values``."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(count)]


class GoodputPolicy:
    def __init__(self, max_k: int, target_cost: list[float], draft_cost: float = 0.0,
                 larger_forwards: dict[int, float] | None = None):
        """``target_cost[m - 1]``: the time of a target forward over m = 1, 2, ... tokens; ``larger_forwards``: more
        token counts and their times, together reaching max_k + 1 tokens or more. The points are made non-decreasing,
        interpolated linearly, extrapolated along the last two."""
        measured = sorted({**{m + 1: t for m, t in enumerate(target_cost)}, **(larger_forwards or {})}.items())
        reach = measured[-1][0] if measured else 0
        if reach < max_k + 1:
            raise ValueError(f"need target costs up to {max_k + 1} tokens, got costs up to {reach}")
        self.max_k = max_k
        self.target_cost = target_cost
        self.points = list(zip([m for m, _ in measured], non_decreasing_fit([t for _, t in measured])))
        self.draft_cost = draft_cost

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

    def choose_nodes(self, chances: list[list[tuple]], num_tokens: int, num_seqs: int) -> list[int]:
        """How many of each sequence's nodes to verify: ``chances[i]`` lists (chance, depth) best first, or (chance,
        depth, tokens) for a node that feeds ``tokens`` tokens (1 otherwise); the forward already feeds ``num_tokens``
        tokens of ``num_seqs`` sequences."""
        nodes = sorted(((node[0], -j, i, node[1], node[2] if len(node) > 2 else 1)
                        for i, node_list in enumerate(chances) for j, node in enumerate(node_list)), reverse=True)
        expected, longest, fed = float(num_seqs), 0, num_tokens
        best_n, best = 0, expected / self.forward_cost(num_tokens)
        for n, (chance, _, _, depth, tokens) in enumerate(nodes, 1):
            expected += chance
            longest = max(longest, depth)
            fed += tokens
            goodput = expected / (self.forward_cost(fed) + longest * self.draft_cost)
            if goodput > best:
                best, best_n = goodput, n
        counts = [0] * len(chances)
        for _, _, i, _, _ in nodes[:best_n]:
            counts[i] += 1
        return counts
