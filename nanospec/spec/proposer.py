"""What the engine asks of a proposer (n-gram, draft model, ...).

The engine calls, per speculating sequence: ``start`` when it is added; ``propose`` each decode step
(batched; returns one ``Proposal`` per sequence, ``len(token_ids) <= max_tokens_per_step``);
``commit`` after verification with the number of drafts accepted; ``extend`` with the tokens the
sequence grew by; ``preempt`` when its KV is dropped for recompute; ``free`` when it finishes.
"""

from __future__ import annotations

from nanospec.sequence import Sequence


class Proposer:
    max_tokens_per_step: int  # KV slots to reserve per step beyond the sequence's own next token

    def start(self, seq: Sequence) -> None: ...

    def propose(self, seqs: list[Sequence]) -> list: ...

    def commit(self, seq: Sequence, proposal, num_accepted: int) -> None: ...

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None: ...

    def preempt(self, seq: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...
