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

from pathlib import Path

import torch

from nanospec.model.mlp_speculator import MLPSpeculator
from nanospec.speculative.cost import best_seconds
from nanospec.speculative.head import HeadProposer
from nanospec.speculative.ngram import NgramProposer
from nanospec.speculative.proposal import Proposal

SHIPPED_FOR_EMBEDDED = Path(__file__).resolve().parents[1] / "speculators" / "smollm2-135m-instruct"


class MLPSpeculatorProposer(HeadProposer):
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
        self.k, self.width, self.prompt_lookup, self.adaptive = k, tree_top_k, prompt_lookup, adaptive
        self.max_tokens_per_step = k * (tree_top_k + (prompt_lookup is not None))

    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        """On the device: the beam behind each sequence's last emitted token, :meth:`draft_depth` deep (token ids,
        parents, scores)."""
        rows, last_tokens = verification.last_emitted()
        depth = self.draft_depth(verification.seqs, proposals)
        return list(self.model.propose_tree(hidden[rows], last_tokens, depth, self.width))

    def measure_cost(self) -> float:
        """Seconds per depth of a batch-1 beam ``k`` deep, read back as in a step."""
        c = self.model.config
        hidden = torch.randn(1, c.emb_dim, device=self.device, dtype=self.model.proj[0].weight.dtype)
        last_token = torch.zeros(1, dtype=torch.int64, device=self.device)

        def beam():
            return [t.tolist() for t in self.model.propose_tree(hidden, last_token, self.k, self.width)]

        beam()
        return best_seconds(beam, self.device) / self.k

