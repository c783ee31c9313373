"""The n-gram proposer wired into the engine: one incremental n-gram index per sequence."""

from __future__ import annotations

from nanospec.engine import Proposal
from nanospec.sequence import Sequence
from nanospec.spec.ngram import NgramProposer
from nanospec.spec.proposer import Proposer


class NgramSpeculator(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.ngram = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        self.max_tokens_per_step = num_speculative_tokens

    def start(self, seq: Sequence) -> None:
        seq.spec_state = self.ngram.new_index(seq.token_ids)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        # guesses are free: always return the full proposal, the engine verifies ks[i] of them
        return [Proposal(self.ngram.propose(seq.spec_state)) for seq in seqs]

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None:
        seq.spec_state.extend(new_tokens)
