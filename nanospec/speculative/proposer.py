"""What the speculator asks of a proposer (n-gram, lookahead, draft model, MLP speculator).

Every proposer proposes a token tree per sequence (a chain is a tree). A **ranked** proposer (``ranked = True``)
lists its nodes best first with each one's chance to lie on the accepted path, and :meth:`Proposer.rank` tells the
goodput policy those chances before the step: a chain's depth ``j`` with ``alpha^j`` (``alpha`` its acceptance
estimate: a draft model's per-depth choice is a ranking too), the MLP speculator's beam by its calibrated scores.
The policy keeps the prefix of each ranking that pays, and ``propose`` is asked for that many depths (a proposer
whose guesses are free may return more; the speculator keeps what it verifies). An unranked proposer's trees are
verified whole.

Per speculating sequence: ``start`` when it is added; ``rank`` and ``propose`` each decode step (batched);
``read_forward`` on the device after verification, for a proposer that reads the step's forward (the MLP speculator
its hidden states, lookahead its window's argmax), whose values come back in the step's one read as
``Verdict.ahead``; ``commit`` after the sequence grew by the tokens its verdict emitted (not called for a sequence
that finished); ``preempt`` when its KV is dropped for recompute; ``free`` when it finishes; ``reset_prefix_cache``
when the engine forgets its cached K/V (a proposer with a KV cache of its own forgets its own). A proposal none of whose
nodes is verified still carries its first guesses (``Proposal.unverified_guesses``), checked against the outcome.
Hooks a proposer has no use for keep these do-nothing defaults.
"""

from __future__ import annotations

import abc

import torch

from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict


class Proposer(abc.ABC):
    max_tokens_per_step: int  # the most nodes one proposal feeds: KV slots to reserve beyond the root
    ranked = False  # its proposals are ranked (rank() gives the chances): the policy may verify a prefix of each
    max_model_len: int | None = None  # the longest sequence it can guess for (a draft model's context); None: any
    needs_hidden_states = False  # the step's forward returns the target's final hidden states, for read_forward

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """For a ranked proposer: per sequence, (chance, depth) of each node it would propose at most ``depths[i]``
        deep, best first (the policy's input)."""
        raise NotImplementedError(f"{type(self).__name__} does not rank its proposals")

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        """One proposal per sequence, ``depths[i]`` deep (the speculator cuts what is deeper)."""

    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        """On the device, after verification (:class:`~nanospec.speculative.verify.Verification`): tensors
        ``[B, ...]`` read in the step's one read, row ``b`` landing in sequence ``b``'s ``Verdict.ahead``."""
        return []

    def measure_cost(self) -> float:
        """Seconds one depth of guesses costs (a draft forward); 0 for proposers that need no model."""
        return 0.0

    def start(self, seq: Sequence) -> None:
        return None

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        return None

    def preempt(self, seq: Sequence) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        seq.spec_state = None

    def reset_prefix_cache(self) -> bool:
        """Forget cached K/V of its own; whether it did (False while a sequence holds some)."""
        return True
