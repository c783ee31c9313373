"""What a proposer guesses for one sequence, what verification decides, and how both sit in the step batch.

A **proposal** is a token tree under the sequence's root (its last committed token). Node ``i`` holds
``token_ids[i]`` and hangs under node ``parents[i] < i``, or under the root when ``parents[i] == -1``.
A chain ``d_1 .. d_k`` is the tree ``parents = [-1, 0, 1, ..., k - 2]``. The first ``num_candidates``
nodes are the guesses the target verifies; the nodes after them are only fed, so that the target's
argmax at each comes back to the proposer (lookahead's Jacobi window). Their parents are the root or
other such nodes, never a candidate.

**Layout in the step batch** (:func:`build_step_batch`, the one place rows, positions and masks come
from). A sequence feeds its uncached tokens, then every node of its proposal (a proposal is only made
in decode, where the root is the one uncached token). Node ``i`` is stored at ``root + 1 + i``, sits at
position ``root + depth(i)`` and sees the cached context, the root and its own ancestors (a bitmask;
a chain needs none: it is causal). The sequence's logits rows are the root's and then every node's,
in node order: the distribution after the root judges the depth-1 nodes, the one after node ``i``
judges ``i``'s children.

A **verdict** is what verification decided: the accepted path (node indices, a child of the root
first) and the tokens emitted, the path's tokens and then one token of the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanospec.kernels.attention_mask import tree_depths, tree_mask_from_parents
from nanospec.model.forward_batch import ForwardBatch, build_forward_batch
from nanospec.outputs import TokenLogprob
from nanospec.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    num_candidates: int | None = None  # None: every node is a candidate
    draft_probs: torch.Tensor | None = None  # [num_candidates, V]: what each guess was sampled from (None: one-hot)
    # the first guesses (the root's children) of a proposal left out of verification: checked against the outcome
    unverified_guesses: tuple[int, ...] = ()
    # a ranked tree's (the nodes best first): each candidate's chance to lie on the accepted path (policy.py)
    chances: list[float] | None = None

    def __post_init__(self):
        if self.num_candidates is None:
            self.num_candidates = len(self.token_ids)
        if len(self.parents) != len(self.token_ids):
            raise ValueError(f"a proposal needs one parent per token: {len(self.token_ids)} tokens, "
                             f"{len(self.parents)} parents")

    @classmethod
    def chain(cls, token_ids: list[int], draft_probs: torch.Tensor | None = None) -> Proposal:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs=draft_probs)

    @property
    def depths(self) -> list[int]:
        """Depth of every node (the root's children are at depth 1)."""
        return [d + 1 for d in tree_depths(self.parents)]

    @property
    def is_chain(self) -> bool:
        """Every node is a candidate and the child of the one before: the causal layout, no mask needed."""
        return self.num_candidates == len(self.token_ids) and all(p == i - 1 for i, p in enumerate(self.parents))

    def max_depth(self) -> int:
        """The depth of the deepest candidate (0 without candidates)."""
        return max(self.depths[: self.num_candidates], default=0)

    def paths(self) -> list[list[int]]:
        """For each candidate node, the tokens from the root's child down to the node itself."""
        paths: list[list[int]] = []
        for token, parent in zip(self.token_ids[: self.num_candidates], self.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        return paths

    def first_guesses(self) -> tuple[int, ...]:
        """The candidates at depth 1 (the root's children)."""
        return tuple(t for t, p in zip(self.token_ids[: self.num_candidates], self.parents) if p == -1)

    def layout(self) -> tuple[list[int], torch.Tensor]:
        """(position offsets from the root, ancestor bitmask) over the root and every node, root first."""
        parents = [-1] + [p + 1 for p in self.parents]
        return tree_depths(parents), tree_mask_from_parents(parents)

    def truncated(self, max_depth: int, max_nodes: int) -> Proposal:
        """This proposal with only the candidates at depth <= ``max_depth``, at most ``max_nodes`` of them (the
        first ones, so still a tree: a parent comes before its children), and the fed-only nodes only if they
        still fit in ``max_nodes`` with them."""
        depths = self.depths
        keep = [i for i in range(self.num_candidates) if depths[i] <= max_depth][:max_nodes]
        extra = range(self.num_candidates, len(self.token_ids))
        if len(keep) + len(extra) > max_nodes:
            extra = range(0)
        if len(keep) == self.num_candidates and len(extra) == len(self.token_ids) - self.num_candidates:
            return self
        nodes = keep + list(extra)
        new_index = {old: new for new, old in enumerate(nodes)}
        new_index[-1] = -1
        probs = None
        if self.draft_probs is not None:  # only chains carry them, so the kept candidates are a prefix
            probs = self.draft_probs[: len(keep)]
        chances = [self.chances[i] for i in keep] if self.chances is not None else None
        return Proposal([self.token_ids[i] for i in nodes], [new_index[self.parents[i]] for i in nodes],
                        num_candidates=len(keep), draft_probs=probs, chances=chances)


@dataclass
class Verdict:
    emitted: list[int]            # the accepted path's tokens, then the target's own token after it
    path: list[int] = field(default_factory=list)  # node indices of the accepted path, the root's child first
    extra_argmax: list[int] | None = None  # the target's argmax at each fed-only node
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asks for them
    # the target's final hidden state ([hidden], on the device) at the row whose logits drew the last emitted
    # token: the root's when no guess was accepted, else the last accepted node's (for a proposer that reads it)
    hidden_state: torch.Tensor | None = None
    ahead: list[list[int]] | None = None  # what the proposer computed from this outcome on the device, read with it

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class TokenTrie:
    """Token sequences merged under one root, shared prefixes once (the n-gram and lookahead trees).

    Node ``i`` holds ``token_ids[i]`` under node ``parents[i]`` (-1: the root); the children of a node carry
    distinct tokens; nodes are numbered in insertion order, so a parent comes before its children.
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent node, token) -> child node

    @property
    def full(self) -> bool:
        return self.budget is not None and len(self.token_ids) >= self.budget

    def insert(self, tokens) -> bool:
        """Add the path ``tokens`` from the root (up to the budget); whether it added a node."""
        parent, added = -1, False
        for token in tokens:
            child = self._children.get((parent, token))
            if child is None:
                if self.full:
                    break
                child = len(self.token_ids)
                self._children[(parent, token)] = child
                self.token_ids.append(token)
                self.parents.append(parent)
                added = True
            parent = child
        return added


def build_step_batch(seqs: list[Sequence], proposals: list[Proposal], block_size: int) -> ForwardBatch:
    """One ragged batch for the step, on the host: each sequence's uncached tokens, then its proposal, laid out
    as above (the model runner takes it to the device)."""
    token_lists, starts, logits_rows, positions, masks = [], [], [], [], []
    for seq, proposal in zip(seqs, proposals):
        uncached = seq.token_ids[seq.num_cached_tokens:]
        token_lists.append(uncached + proposal.token_ids)
        starts.append(seq.num_cached_tokens)
        root_row = len(uncached) - 1
        logits_rows.append(range(root_row, root_row + 1 + len(proposal.token_ids)))
        if proposal.is_chain:
            positions.append(None)
            masks.append(None)
        else:
            offsets, mask = proposal.layout()
            positions.append([seq.num_tokens - 1 + o for o in offsets])
            masks.append(mask)
    return build_forward_batch(token_lists, starts, [s.block_table for s in seqs], block_size, logits_rows, "cpu",
                               positions=positions, tree_masks=masks)
