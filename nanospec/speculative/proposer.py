"""What the speculator asks of a proposer: a ranked token tree per sequence (a chain is a tree).
``bind`` hands it the target's runner once; per sequence: ``start``, ``rank`` (each node's chance, for the goodput
policy) then ``propose`` each decode step, ``read_forward`` on the device after verification (its values come back as
``Verdict.ahead``), ``read_chunks`` after a step that ran a chunk of its prompt, ``commit`` after the sequence grew,
``preempt`` when its KV is dropped, ``free`` when it ends.
"""

from __future__ import annotations

import abc

import torch

from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict


class Proposer(abc.ABC):
    max_tokens_per_step: int  # the most nodes one proposal feeds: KV slots to reserve beyond the root
    max_model_len: int | None = None  # the longest sequence it can guess for (a draft model's context); None: any
    needs_hidden_states = False  # the step's forward returns the target's final hidden states, for read_forward

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """Per sequence, (chance, depth) of each node it would propose at most ``depths[i]`` deep, best first. The
        depth is what the policy prices as guessing (``depth * D``); a third value, where given, is the tokens the
        node feeds (1 otherwise)."""
        return [p.ranking(depth) for p, depth in zip(self.propose(seqs, depths), depths)]

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        """One proposal per sequence, ``depths[i]`` deep (the speculator cuts what is deeper)."""

    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        """Device tensors ``[B, ...]`` computed after verification, row ``b`` landing in ``Verdict.ahead``."""
        return []

    def read_chunks(self, seqs: list[Sequence], first_row: int) -> None:
        """After a forward in which ``seqs`` ran a chunk of their prompts (``num_new_tokens`` rows each, in order from
        row ``first_row``), drawing nothing."""

    def bind(self, runner) -> None:
        """Before the first step: the target's runner."""

    def measure_cost(self) -> float:
        """Seconds one depth of guesses costs; 0 for proposers that need no model."""
        return 0.0

    def start(self, seq: Sequence) -> None:
        pass

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        pass

    def preempt(self, seq: Sequence) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        self.preempt(seq)
        seq.spec_state = None

    def reset_prefix_cache(self) -> bool:
        """Forget cached K/V of its own; whether it did."""
        return True
