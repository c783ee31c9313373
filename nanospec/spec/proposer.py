"""What the engine asks of a proposer (n-gram, draft model, ...).

The engine calls, per speculating sequence: ``start`` when it is added; ``propose`` each decode step
(batched, with the number of guesses ``ks`` the engine will verify per sequence; one ``Proposal`` per
sequence; a proposer whose guesses are free may return more, up to ``max_tokens_per_step``, and the
engine checks the first of them against the outcome even when it verifies none); ``commit`` after
verification, with what was accepted, before the emitted tokens are appended;
``extend`` with the tokens the sequence grew by; ``preempt`` when its KV is dropped for recompute;
``free`` when it finishes. Hooks a proposer has no use for keep these do-nothing defaults.
"""

from __future__ import annotations

import abc

from nanospec.sequence import Sequence


class Proposer(abc.ABC):
    max_tokens_per_step: int  # KV slots to reserve per step beyond the sequence's own next token
    adaptive_k = True  # chains: the engine may verify fewer guesses than proposed (nanospec.spec.policy)

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list:
        """One ``nanospec.engine.Proposal`` per sequence."""

    def measure_cost(self) -> float:
        """Seconds one guess costs (a draft forward); 0 for proposers that need no model."""
        return 0.0

    def start(self, seq: Sequence) -> None:
        return None

    def commit(self, seq: Sequence, proposal, result) -> None:
        """``result`` is the ``nanospec.engine.StepResult``: emitted tokens, accepted tree path, lookahead argmax."""
        return None

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None:
        return None

    def preempt(self, seq: Sequence) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        seq.spec_state = None
