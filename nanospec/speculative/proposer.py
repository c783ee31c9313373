"""What the speculator asks of a proposer (n-gram, lookahead, draft model, ...).

Per speculating sequence: ``start`` when it is added; ``propose`` each decode step (batched, with
the number of guesses ``ks`` the step will verify per sequence: a proposer whose guesses cost a
forward each makes that many; one whose guesses are free may return more, and the speculator keeps
what it verifies; where it verifies none, it checks the first guesses, depth 1, against the outcome);
``commit`` after the sequence grew by the tokens its verdict emitted (not called for a sequence that finished);
``preempt`` when its KV is dropped for recompute; ``free`` when it finishes. Hooks a proposer has no
use for keep these do-nothing defaults. A proposer with ``needs_hidden_states`` (the MLP speculator) finds in
each verdict it is given the target's final hidden state behind the last emitted token (``Verdict.hidden_state``),
and ``Verdict.ahead``: what its ``guess_ahead`` made of those states on the device during verification, read in
the same device read as the verdicts (so its next proposal needs no read of its own).
"""

from __future__ import annotations

import abc

import torch

from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict


class Proposer(abc.ABC):
    max_tokens_per_step: int  # the most nodes one proposal holds: KV slots to reserve beyond the root
    adaptive_k = True  # the speculator may verify fewer depths than proposed (nanospec.speculative.policy)
    # True: its proposals are ranked trees (nodes best first, with ``Proposal.chances``), all it guessed: the policy
    # verifies a prefix of each; False: the policy picks each sequence's depth first and ``propose`` guesses that deep
    ranks_nodes = False
    max_model_len: int | None = None  # the longest sequence it can guess for (a draft model's context); None: any
    needs_hidden_states = False  # True: verdicts carry the target's hidden state behind the last emitted token

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """One proposal per sequence."""

    def guess_ahead(self, hidden_states: torch.Tensor, last_tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """For ``needs_hidden_states``: on the device, from each sequence's hidden state ``[B, H]`` and last emitted
        token ``[B]``, tensors ``[B, ...]`` that come back in the verdicts as ``Verdict.ahead``; guesses
        ``depth`` deep at most (the deepest the next step may verify)."""
        return []

    def measure_cost(self) -> float:
        """Seconds one guess costs (a draft forward); 0 for proposers that need no model."""
        return 0.0

    def start(self, seq: Sequence) -> None:
        return None

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        return None

    def preempt(self, seq: Sequence) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        seq.spec_state = None
