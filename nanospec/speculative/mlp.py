"""The MLP speculator as a proposer: guesses from the target's own hidden state, with no extra target pass.

After verification, on the device and before the step's one read, its stages (:mod:`nanospec.model.mlp_speculator`)
run from ``(h, t_0)``: ``t_0`` the sequence's last emitted token, ``h`` the target's final hidden state at the row
whose logits drew it. The guesses come back in ``Verdict.ahead`` and are one-hot, so verification is the matched rule.
With ``tree_top_k`` w > 1 a beam keeps the w most probable paths per depth; with ``prompt_lookup`` the n-gram chain
joins the tree. A beam node's chance is its :class:`~nanospec.speculative.policy.TreeCalibration`'s, the chain's depth
``d`` token's ``a^d`` (``a`` its acceptance), a node on both the larger. A child is never more likely than its parent,
so sorting by chance (shorter paths first on ties) keeps every prefix a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanospec.model.mlp_speculator import MLPSpeculator
from nanospec.sequence import Sequence
from nanospec.speculative.cost import best_seconds
from nanospec.speculative.ngram import LookupChain, NgramProposer
from nanospec.speculative.policy import TreeCalibration
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.proposer import Proposer

SHIPPED_FOR_EMBEDDED = Path(__file__).resolve().parents[1] / "speculators" / "smollm2-135m-instruct"


@dataclass
class MLPState:
    num_tokens: int = 0                 # the sequence's length at its last outcome (its last token is t_0)
    beam: list[list] | None = None      # guessed then, during verification: [token ids, parents, scores]
    beam_paths: frozenset = frozenset()  # the paths of the ranked tree the beam drafted
    ranked: Proposal | None = None      # the beam and the n-gram chain, ranked: the next proposal
    lookup: LookupChain | None = None   # the sequence's n-gram chain, with prompt lookup
    calibration: TreeCalibration = field(default_factory=TreeCalibration)  # the beam's


class MLPSpeculatorProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, speculator: MLPSpeculator, num_speculative_tokens: int | None = None, tree_top_k: int = 1,
                 prompt_lookup: NgramProposer | None = None, adaptive: bool = True):
        """``num_speculative_tokens``: the deepest guess verified (default and at most ``n_predict``); ``tree_top_k``:
        the beam width; ``prompt_lookup``: an n-gram proposer whose chain joins the tree."""
        n_predict = speculator.config.n_predict
        k = n_predict if not num_speculative_tokens else num_speculative_tokens
        if k > n_predict:
            raise ValueError(f"speculative_config['num_speculative_tokens'] = {k} exceeds the MLP speculator's "
                             f"n_predict ({n_predict}): it guesses at most {n_predict} tokens")
        if not 1 <= tree_top_k <= speculator.config.num_scored:
            raise ValueError(f"speculative_config['tree_top_k'] = {tree_top_k}: the beam width must be in [1, "
                             f"{speculator.config.num_scored}] (the tokens this speculator scores)")
        self.model = speculator
        self.device = speculator.proj[0].weight.device
        self.k = k
        self.width = tree_top_k
        self.prompt_lookup = prompt_lookup
        self.adaptive = adaptive
        self.max_tokens_per_step = k * (tree_top_k + (prompt_lookup is not None))

    def start(self, seq: Sequence) -> None:
        seq.spec_state = MLPState(lookup=self.prompt_lookup.new_chain(seq.token_ids) if self.prompt_lookup else None)

    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        """On the device: the beam behind each sequence's last emitted token, ``k`` deep, or with the policy one depth
        deeper than the deepest beam guess this step verified (at most ``k``)."""
        rows, last_tokens = verification.last_emitted()
        depth = max((p.model_depth(_beam_paths(s)) for s, p in zip(verification.seqs, proposals)), default=0) + 1 \
            if self.adaptive else self.k
        return list(self.model.propose_tree(hidden[rows], last_tokens, min(depth, self.k), self.width))

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """Each node's chance and, as its depth, the beam's depths verifying it costs: the deepest beam guess on its
        path (the n-gram chain's guesses cost nothing to make)."""
        return [proposal.model_ranking(_beam_paths(seq), depth)
                for seq, proposal, depth in zip(seqs, self.propose(seqs, depths), depths)]

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        """Each sequence's ranked tree, made when its last outcome came (none if its state is missing or stale)."""
        return [st.ranked if (st := seq.spec_state) is not None and st.ranked is not None
                and st.num_tokens == seq.num_tokens else Proposal() for seq in seqs]

    def _ranked_tree(self, state: MLPState) -> Proposal:
        tokens, parents, scores = state.beam
        paths = [tuple(path) for path in Proposal(tokens, parents).paths()]
        chance = dict(zip(paths, state.calibration.chances(paths, scores)))
        state.beam_paths = frozenset(paths)
        if state.lookup is not None:
            state.lookup.join(chance, self.prompt_lookup, self.k)
        return Proposal.ranked(chance)

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Calibrate the beam's ``c`` and the chain's ``a`` on the outcome; rank the beam guessed behind the new last
        token for the next step."""
        state: MLPState = seq.spec_state
        verified = proposal.checked_paths()
        state.calibration.observe(verified, verdict.emitted)
        if state.lookup is not None:
            state.lookup.observe(verified, verdict.emitted)
        state.beam, state.num_tokens = verdict.ahead, seq.num_tokens
        state.ranked = self._ranked_tree(state) if state.beam is not None else None

    def preempt(self, seq: Sequence) -> None:
        seq.spec_state.beam = seq.spec_state.ranked = None
        seq.spec_state.beam_paths = frozenset()

    def measure_cost(self) -> float:
        """Seconds per depth of a batch-1 beam ``k`` deep, read back as in a step."""
        c = self.model.config
        hidden = torch.randn(1, c.emb_dim, device=self.device, dtype=self.model.proj[0].weight.dtype)
        last_token = torch.zeros(1, dtype=torch.int64, device=self.device)

        def beam():
            return [t.tolist() for t in self.model.propose_tree(hidden, last_token, self.k, self.width)]

        beam()
        return best_seconds(beam, self.device) / self.k


def _beam_paths(seq: Sequence) -> frozenset:
    return seq.spec_state.beam_paths if seq.spec_state is not None else frozenset()
