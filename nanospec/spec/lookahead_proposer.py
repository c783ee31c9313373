"""Lookahead decoding wired into the engine: each step one forward holds the verification branch
(candidate n-grams from the pool, as a token tree) and the lookahead branch (the Jacobi window);
the target's argmax over the window feeds the pool (see ``nanospec.spec.lookahead``)."""

from __future__ import annotations

from dataclasses import dataclass

from nanospec.engine import Proposal
from nanospec.sequence import Sequence
from nanospec.spec.lookahead import LookaheadDecoder, LookaheadState, LookaheadStep
from nanospec.spec.proposer import Proposer


@dataclass
class _SeqLookahead:
    state: LookaheadState
    step: LookaheadStep | None = None


class LookaheadSpeculator(Proposer):
    adaptive_k = False  # the window must run every step to keep its Jacobi iteration going

    def __init__(self, window_size: int, ngram_size: int, guess_set_size: int):
        self.decoder = LookaheadDecoder(window_size, ngram_size, guess_set_size)
        self.max_tokens_per_step = self.decoder.max_step_tokens - 1

    def start(self, seq: Sequence) -> None:
        seq.spec_state = _SeqLookahead(self.decoder.new_state(seq.token_ids))

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = []
        for seq in seqs:
            st: _SeqLookahead = seq.spec_state
            step = st.step = self.decoder.build_step(st.state, seq.token_ids[-1])
            n = step.num_tree_nodes
            proposals.append(Proposal(step.tokens[1:n], parents=[p - 1 for p in step.tree_parents[1:]],
                                      lookahead_tokens=step.tokens[n:], mask=step.mask, positions=step.positions))
        return proposals

    def commit(self, seq: Sequence, proposal: Proposal, result) -> None:
        st: _SeqLookahead = seq.spec_state
        if st.step is not None and result.lookahead_argmax is not None:
            self.decoder.update(st.state, st.step, result.lookahead_argmax, result.emitted)
        else:
            self.decoder.commit_without_step(st.state, result.emitted)
        st.step = None
