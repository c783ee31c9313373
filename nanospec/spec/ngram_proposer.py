"""The n-gram proposer wired into the engine: one incremental n-gram index per sequence.

With ``max_candidates > 1`` it proposes a token tree: up to that many different continuations of
the matched suffix (one per earlier occurrence), merged into a trie of at most ``tree_budget`` nodes.
"""

from __future__ import annotations

from nanospec.engine import Proposal
from nanospec.sequence import Sequence
from nanospec.spec.ngram import NgramProposer
from nanospec.spec.proposer import Proposer


class NgramSpeculator(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_candidates: int = 1, tree_budget: int | None = None):
        self.ngram = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, max_candidates)
        self.tree_budget = tree_budget or num_speculative_tokens * max_candidates
        self.max_tokens_per_step = num_speculative_tokens if max_candidates == 1 else self.tree_budget
        self.adaptive_k = max_candidates == 1

    def start(self, seq: Sequence) -> None:
        seq.spec_state = self.ngram.new_index(seq.token_ids)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        # guesses are free: always return the full proposal, the engine verifies what pays off
        if self.ngram.max_candidates == 1:
            return [Proposal(self.ngram.propose(seq.spec_state)) for seq in seqs]
        proposals = []
        for seq in seqs:
            tokens, parents = self.ngram.propose_tree(seq.spec_state, self.tree_budget)
            proposals.append(Proposal(tokens, parents=parents) if tokens else Proposal([]))
        return proposals

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None:
        seq.spec_state.extend(new_tokens)
