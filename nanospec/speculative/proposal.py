"""Proposals, verdicts, and their layout in the step batch.

A **proposal** is a token tree under the sequence's root: node ``i`` holds ``token_ids[i]`` under ``parents[i] < i``
(-1: the root); a chain is ``parents = [-1, 0, 1, ...]``. A **ranked** one lists its nodes best first with their
``chances`` to lie on the accepted path. In the batch (:func:`build_step_batch`) a sequence feeds its uncached
tokens, then every fed node: node ``i`` is stored at ``root + 1 + i``, sits at position ``root + depth(i)`` and sees
the context and its ancestors. A **verdict** is the accepted path (node indices) and the emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanospec.kernels.attention_mask import num_words
from nanospec.model.forward_batch import ForwardBatch, build_forward_batch
from nanospec.outputs import TokenLogprob
from nanospec.sequence import Sequence
from nanospec.speculative.policy import trie_chances


def tree_mask(parents: list[int]) -> torch.Tensor:
    """The attention bitmask (:mod:`nanospec.kernels.attention_mask`) of a tree: each node sees itself and its
    ancestors."""
    words, bitsets = num_words(len(parents)), []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"parent of node {node} is {parent}: it must be -1 or an earlier node")
        bitsets.append((bitsets[parent] if parent >= 0 else 0) | (1 << node))
    # each row's words, least significant first, read as int64 (bit 63 the sign bit) on a little-endian host
    data = bytearray(b"".join(bits.to_bytes(8 * words, "little") for bits in bitsets))
    if not data:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.frombuffer(data, dtype=torch.int64).view(len(parents), words)


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (roots 0) of a tree given by ``parents[i] < i`` (-1: a root)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class Proposal:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    chances: list[float] | None = None  # a ranked tree's: each node's chance to lie on the accepted path
    draft_probs: torch.Tensor | None = None  # [nodes, V]: what each guess was sampled from (None: one-hot)
    # the first guesses (the root's children) of a proposal left out of verification: checked against the outcome
    unverified_guesses: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.parents) != len(self.token_ids):
            raise ValueError(f"a proposal needs one parent per token: {len(self.token_ids)} tokens, "
                             f"{len(self.parents)} parents")

    @classmethod
    def chain(cls, token_ids: list[int], draft_probs: torch.Tensor | None = None) -> Proposal:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs=draft_probs)

    @classmethod
    def ranked(cls, chance: dict[tuple[int, ...], float]) -> Proposal:
        """The tree of the paths in ``chance`` (each with its prefixes), best first and shorter first on ties: a path
        never more likely than its prefix keeps every prefix of the list a tree."""
        paths = sorted(chance, key=lambda path: (-chance[path], len(path)))
        index = {path: i for i, path in enumerate(paths)}
        return cls([path[-1] for path in paths], [index.get(path[:-1], -1) for path in paths],
                   chances=[chance[path] for path in paths])

    def fed(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of every node the step feeds: the tree, then any nodes fed but not verified."""
        return self.token_ids, self.parents

    @property
    def depths(self) -> list[int]:
        """Depth of every node (the root's children are at depth 1)."""
        return [d + 1 for d in tree_depths(self.parents)]

    @property
    def is_chain(self) -> bool:
        """Every fed node is the child of the one before: causal, no mask needed."""
        return all(p == i - 1 for i, p in enumerate(self.fed()[1]))

    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def paths(self) -> list[list[int]]:
        """For each node, the tokens from the root's child down to the node itself."""
        paths: list[list[int]] = []
        for token, parent in zip(self.token_ids, self.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        return paths

    def model_depths(self, drafted: frozenset) -> list[int]:
        """Per node, how deep a model drafted to guess it: the longest prefix of its path among ``drafted`` (the
        paths the model drafted; 0 where none is, as for an n-gram chain's own guesses)."""
        return [max((j for j in range(1, len(path) + 1) if tuple(path[:j]) in drafted), default=0)
                for path in self.paths()]

    def model_depth(self, drafted: frozenset) -> int:
        """The deepest of the model's guesses (``drafted``: the paths it drafted) in this proposal."""
        return max(self.model_depths(drafted), default=0)

    def ranked_as_trie(self, alpha: float) -> Proposal:
        """This tree (a trie: no two siblings alike) ranked by its nodes' :func:`trie_chances` for ``alpha``."""
        paths = [tuple(path) for path in self.paths()]
        return Proposal.ranked(dict(zip(paths, trie_chances(self.parents, alpha))))

    def ranking(self, max_depth: int) -> list[tuple]:
        """(chance, depth) of each node at most ``max_depth`` deep, best first, for the policy."""
        return [(c, d) for c, d in zip(self.chances or (), self.depths) if d <= max_depth]

    def model_ranking(self, drafted: frozenset, max_depth: int, extra_forwards: int = 0) -> list[tuple[float, int]]:
        """(chance, cost) of each node at most ``max_depth`` deep, best first, for the policy: the cost is the model
        forwards verifying the node costs, its :meth:`model_depths` plus ``extra_forwards``, or 0 where that depth is 0
        (the n-gram chain's own guesses cost nothing to make)."""
        return [(chance, d + extra_forwards if d else 0) for chance, d, depth
                in zip(self.chances or (), self.model_depths(drafted), self.depths) if depth <= max_depth]

    def first_guesses(self) -> tuple[int, ...]:
        return tuple(t for t, p in zip(self.token_ids, self.parents) if p == -1)

    def checked_paths(self) -> list[tuple[int, ...]]:
        """The paths verified, or when none was, the first guesses checked against the outcome."""
        return [tuple(path) for path in self.paths()] or [(t,) for t in self.unverified_guesses]

    def truncated(self, max_depth: int, max_nodes: int, room: int) -> Proposal:
        """This proposal with only the nodes at depth <= ``max_depth``, at most ``max_nodes`` of them (the first
        ones, so still a tree: a parent comes before its children), feeding at most ``room`` tokens."""
        depths = self.depths
        keep = [i for i in range(len(self.token_ids)) if depths[i] <= max_depth][:min(max_nodes, room)]
        if len(keep) == len(self.token_ids):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        new_index[-1] = -1
        probs = self.draft_probs[: len(keep)] if self.draft_probs is not None else None  # (chains only: a prefix)
        chances = [self.chances[i] for i in keep] if self.chances is not None else None
        return Proposal([self.token_ids[i] for i in keep], [new_index[self.parents[i]] for i in keep], chances, probs)


@dataclass
class Verdict:
    emitted: list[int]            # the accepted path's tokens, then the target's own token after it
    path: list[int] = field(default_factory=list)  # node indices of the accepted path, the root's child first
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asks for them
    ahead: list[list] | None = None  # what the proposer read from this step's forward (Proposer.read_forward)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class TokenTrie:
    """Token sequences merged under one root, shared prefixes once; a parent comes before its children."""

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
    """One ragged batch for the step, on the host: each sequence's new tokens, then its proposal (a prompt's chunk
    that draws nothing wants no logits)."""
    token_lists, starts, logits_rows, positions, masks = [], [], [], [], []
    for seq, proposal in zip(seqs, proposals):
        new = seq.token_ids[seq.num_cached_tokens:seq.num_cached_tokens + seq.num_new_tokens]
        fed, fed_parents = proposal.fed()
        token_lists.append(new + fed)
        starts.append(seq.num_cached_tokens)
        root_row = len(new) - 1
        first_row = 0 if seq.needs_prompt_logprobs else root_row  # (the prompt rows come first, see Engine)
        logits_rows.append(range(first_row, root_row + 1 + len(fed)) if not seq.is_prefill_chunk else range(0))
        if proposal.is_chain:  # causal: the default positions and mask
            positions.append(None)
            masks.append(None)
        else:
            parents = [-1] + [p + 1 for p in fed_parents]  # the root, then every fed node
            positions.append([seq.num_tokens - 1 + d for d in tree_depths(parents)])
            masks.append(tree_mask(parents))
    return build_forward_batch(token_lists, starts, [s.block_table for s in seqs], block_size, logits_rows, "cpu",
                               positions=positions, tree_masks=masks)
