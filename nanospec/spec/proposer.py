"""What the engine asks of a proposer (n-gram, draft model, ...).

The engine calls, per speculating sequence: ``start`` when it is added; ``propose`` each decode step
(batched; one ``Proposal`` per sequence, at most ``max_tokens_per_step`` tokens); ``commit`` after
verification, with the number of drafts accepted, before the emitted tokens are appended;
``extend`` with the tokens the sequence grew by; ``preempt`` when its KV is dropped for recompute;
``free`` when it finishes. Hooks a proposer has no use for keep these do-nothing defaults.
"""

from __future__ import annotations

import abc

from nanospec.sequence import Sequence


class Proposer(abc.ABC):
    max_tokens_per_step: int  # KV slots to reserve per step beyond the sequence's own next token

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence]) -> list:
        """One ``nanospec.engine.Proposal`` per sequence."""

    def start(self, seq: Sequence) -> None:
        return None

    def commit(self, seq: Sequence, proposal, num_accepted: int) -> None:
        return None

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None:
        return None

    def preempt(self, seq: Sequence) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        seq.spec_state = None
