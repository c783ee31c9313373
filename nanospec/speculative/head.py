"""A proposer whose model drafts on the device after verification (``read_forward``, no extra target pass): at
``commit`` the paths it drafted, with the prompt-lookup chain joined where there is one, are ranked by chance into the
next step's proposal. The MLP speculator and EAGLE-3 head proposers differ only in how they draft and score.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from nanospec.sequence import Sequence
from nanospec.speculative.ngram import LookupChain, NgramProposer
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

    def forget(self) -> None:
        self.ranked, self.drafted_paths = None, frozenset()


class HeadProposer(Proposer):
    """Subclasses set ``k`` (the deepest guess), ``adaptive``, ``prompt_lookup`` and implement
    :meth:`_drafted_chances`; ``extra_forwards``: model forwards a drafted guess costs beyond its depth."""
    k: int
    adaptive: bool
    prompt_lookup: NgramProposer | None
    extra_forwards = 0
    state_class = HeadState

    def start(self, seq: Sequence) -> None:
        seq.spec_state = self.state_class(
            lookup=self.prompt_lookup.new_chain(seq.token_ids) if self.prompt_lookup else None)

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        """Each sequence's ranked tree, whole, made when its last outcome came (none if its state is missing or
        stale): the speculator cuts it to ``depths``."""
        return [st.ranked if (st := seq.spec_state) is not None and st.ranked is not None
                and st.num_tokens == seq.num_tokens else Proposal() for seq in seqs]

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """Each node's chance and, as its depth, the model forwards verifying it costs: the deepest drafted guess on
        its path plus ``extra_forwards`` (the n-gram chain's guesses cost nothing to make)."""
        return [proposal.model_ranking(_drafted_paths(seq), depth, self.extra_forwards)
                for seq, proposal, depth in zip(seqs, self.propose(seqs, depths), depths)]

    def draft_depth(self, seqs: list[Sequence], proposals: list[Proposal]) -> int:
        """How deep to draft after this step: ``k``, or when adaptive one depth deeper than the deepest drafted guess
        the step verified (at most ``k``)."""
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
        """The next proposal: the paths drafted in ``ahead`` (read_forward's; None: no proposal) with the n-gram
        chain's, ranked."""
        if ahead is None:
            return st.forget()
        chance = self._drafted_chances(st, ahead)
        st.drafted_paths = frozenset(chance)
        if st.lookup is not None:
            st.lookup.join(chance, self.prompt_lookup, self.k)
        st.ranked = Proposal.ranked(chance) if chance else None

    @abc.abstractmethod
    def _drafted_chances(self, st: HeadState, ahead: list) -> dict[tuple[int, ...], float]:
        """Each path drafted in ``ahead`` (read_forward's values for the sequence), with its chance."""

    def preempt(self, seq: Sequence) -> None:
        seq.spec_state.forget()


def _drafted_paths(seq: Sequence) -> frozenset:
    return seq.spec_state.drafted_paths if seq.spec_state is not None else frozenset()
