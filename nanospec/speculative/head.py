"""Proposers whose model drafts on the device after verification (``read_forward``): at ``commit`` the paths drafted,
with any prompt-lookup chain joined, are ranked by chance into the next proposal (the MLP speculator, EAGLE-3)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanospec.sequence import Sequence
from nanospec.speculative.ngram import LookupChain
from nanospec.speculative.policy import TreeCalibration
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.proposer import Proposer


@dataclass
class HeadState:
    num_tokens: int = 0                  # the sequence's length at its last outcome
    ranked: Proposal | None = None       # the drafted paths and the n-gram chain's, ranked: the next proposal
    drafted_paths: frozenset = frozenset()  # the paths of ``ranked`` the model drafted
    lookup: LookupChain | None = None    # the sequence's n-gram chain, with prompt lookup
    calibration: TreeCalibration = field(default_factory=TreeCalibration)  # a scored tree's chances


class HeadProposer(Proposer):
    """Subclasses set ``k`` (the deepest guess), ``adaptive``, ``prompt_lookup``, and draft in ``read_forward``;
    ``extra_forwards``: the model forwards a drafted guess costs beyond its depth."""
    extra_forwards = 0
    state_class = HeadState

    def start(self, seq: Sequence) -> None:
        seq.spec_state = self.state_class(
            lookup=self.prompt_lookup.new_chain(seq.token_ids) if self.prompt_lookup else None)

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        """Each sequence's ranked tree made at its last outcome, whole (none if its state is missing or stale)."""
        return [st.ranked if (st := seq.spec_state) is not None and st.ranked is not None
                and st.num_tokens == seq.num_tokens else Proposal() for seq in seqs]

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """Each node's chance and, as its depth, the model forwards verifying it costs: the deepest drafted guess on
        its path plus ``extra_forwards`` (the n-gram chain's guesses cost nothing to make)."""
        return [proposal.model_ranking(_drafted_paths(seq), depth, self.extra_forwards)
                for seq, proposal, depth in zip(seqs, self.propose(seqs, depths), depths)]

    def draft_depth(self, seqs: list[Sequence], proposals: list[Proposal]) -> int:
        """``k``, or when adaptive one past the deepest drafted guess the step verified (at most ``k``)."""
        if not self.adaptive:
            return self.k
        return min(max((p.model_depth(_drafted_paths(s)) for s, p in zip(seqs, proposals)), default=0) + 1, self.k)

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Learn the chances from the outcome; rank what read_forward drafted behind the new last token."""
        st: HeadState = seq.spec_state
        verified = proposal.checked_paths()
        self._observe(st, verified, verdict.emitted)
        if st.lookup is not None:
            st.lookup.observe(verified, verdict.emitted)
        st.num_tokens = seq.num_tokens
        self._rank_drafted(st, verdict.ahead)

    def _observe(self, st: HeadState, verified: list[tuple[int, ...]], emitted: list[int]) -> None:
        """Calibrate the drafted paths' chances on the outcome (``verified``: the paths checked)."""
        st.calibration.observe(verified, emitted)

    def _rank_drafted(self, st: HeadState, ahead: list | None) -> None:
        """Rank the paths drafted in ``ahead`` (None: no proposal) with the n-gram chain's: the next proposal."""
        chance = self._drafted_chances(st, ahead) if ahead is not None else {}
        st.drafted_paths = frozenset(chance)
        if st.lookup is not None and ahead is not None:
            st.lookup.join(chance, self.prompt_lookup, self.k)
        st.ranked = Proposal.ranked(chance) if chance else None

    def _drafted_chances(self, st: HeadState, ahead: list) -> dict[tuple[int, ...], float]:
        """The paths drafted in ``ahead`` (here a scored tree: token ids, parents, scores), each with its chance."""
        token_ids, parents, scores = ahead
        paths = [tuple(path) for path in Proposal(token_ids, parents).paths()]
        return dict(zip(paths, st.calibration.chances(paths, scores)))

    def preempt(self, seq: Sequence) -> None:
        seq.spec_state.ranked, seq.spec_state.drafted_paths = None, frozenset()


def _drafted_paths(seq: Sequence) -> frozenset:
    return seq.spec_state.drafted_paths if seq.spec_state is not None else frozenset()
