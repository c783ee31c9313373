"""Lookahead decoding (Fu et al. 2024): Jacobi iteration on a 2-D window feeds an n-gram pool, no draft model.

Window size W, n-gram size N, guess set size G, L = N - 1 levels. A sequence whose root sits at position P feeds the
root, the verification trie (the pool's continuations of the root) and the window (fed, not verified); every token
sees itself and its ancestors and sits at P + depth. Window token (l, c) sits at P + l + c and sees
``root -> (0,1) .. (0,c) -> (1,c) .. (l,c)``; column c read top to bottom, then its last token's argmax, is an n-gram
for the pool. Then the window moves one position on: level l takes level l + 1 (level 0 without its column 0), the
last level takes the argmaxes. A fresh window holds level 0 only (W + L - 2 prompt tokens drawn by a seeded RNG) and
grows a level a step. The pool keeps per token at most G continuations, most recent first: the window's n-grams and
the committed text's. The output does not depend on the window: the verifier checks every guess.

The trie is ranked as an n-gram trie is (:func:`~nanospec.speculative.policy.trie_chances`), its first node bringing
the window into the forward: where the policy verifies none of it, no window runs and the pool grows from the committed
text alone.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from nanospec.sequence import Sequence
from nanospec.speculative.policy import AcceptanceEstimate
from nanospec.speculative.proposal import Proposal, TokenTrie, Verdict
from nanospec.speculative.proposer import Proposer

WINDOW_SEED = 0  # the RNG that fills a fresh window from the prompt: the same prompt gives the same window


@dataclass
class LookaheadStep:
    """One step's tokens, root first: the verification trie, then the window level by level, each under
    ``parents[i]``."""
    tokens: list[int]
    parents: list[int]
    num_tree_nodes: int  # root + verification nodes (they come first)

    @property
    def lookahead_rows(self) -> range:
        """Indices of the window's tokens in ``tokens``."""
        return range(self.num_tree_nodes, len(self.tokens))


@dataclass
class LookaheadState:
    """Per sequence: the window (``levels[0]`` without column 0), the n-gram pool (oldest first) and the committed tail
    ``recent``."""
    levels: list[list[int]]
    pool: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)
    recent: list[int] = field(default_factory=list)
    root_in_recent: bool = False
    step: LookaheadStep | None = None  # the step proposed, until its outcome is committed
    proposal: LookaheadProposal | None = None  # its nodes (rank and propose both ask), as long
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # the trie's alpha

    @property
    def width(self) -> int:
        return len(self.levels[0]) + 1

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        """Continuations of ``token`` in the pool, most recently seen first."""
        return list(reversed(self.pool.get(token, ())))


class LookaheadDecoder:
    def __init__(self, window_size: int, ngram_size: int, guess_set_size: int, *, seed_pool_from_prompt: bool = True):
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if ngram_size < 3:
            raise ValueError(f"ngram_size must be >= 3 (the window needs two levels), got {ngram_size}")
        if guess_set_size < 1:
            raise ValueError(f"guess_set_size must be >= 1, got {guess_set_size}")
        self.window_size = window_size
        self.ngram_size = ngram_size
        self.guess_set_size = guess_set_size
        self.num_levels = ngram_size - 1
        self.seed_pool_from_prompt = seed_pool_from_prompt

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step feeds (root included): a full trie plus the widest window of warm-up."""
        W, L = self.window_size, self.num_levels
        widest_window = max((W + L - 1 - f) * (f + 1) - 1 for f in range(L))  # f + 1 levels, width W + L - 1 - f
        return 1 + self.guess_set_size * (self.ngram_size - 1) + widest_window

    def new_state(self, prompt_ids: list[int]) -> LookaheadState:
        """State for a sequence whose committed text is ``prompt_ids``; its first root is the token after them."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty: the window is filled from the prompt")
        rng = random.Random(WINDOW_SEED)
        prompt = [int(t) for t in prompt_ids]
        state = LookaheadState(levels=[[rng.choice(prompt) for _ in range(self.window_size + self.num_levels - 2)]])
        if self.seed_pool_from_prompt:
            self._add_committed(state, prompt)
        else:
            state.recent = prompt[-(self.ngram_size - 1) :]
        return state

    def build_step(self, state: LookaheadState, root: int) -> LookaheadStep:
        """The tokens and tree of one forward for a sequence whose last committed token is ``root``."""
        if state.root_in_recent and root != state.recent[-1]:
            raise ValueError(f"root {root} is not the last committed token {state.recent[-1]}")
        trie = TokenTrie()
        for continuation in state.candidates(root):
            trie.insert(continuation)
        tokens = [root] + trie.token_ids
        parents = [-1] + [p + 1 for p in trie.parents]
        num_tree_nodes = len(tokens)

        width = state.width
        for level, level_tokens in enumerate(state.levels):
            first_column = 1 if level == 0 else 0
            for column, token in enumerate(level_tokens, start=first_column):
                below = (level, column - 1) if level == 0 else (level - 1, column)  # the token just before it
                tokens.append(token)
                parents.append(_window_row(num_tree_nodes, width, *below))
        return LookaheadStep(tokens, parents, num_tree_nodes)

    def update(self, state: LookaheadState, step: LookaheadStep, lookahead_argmax: list[int],
               accepted: list[int]) -> None:
        """Advance the window and grow the pool after the forward of ``step``: ``lookahead_argmax`` at each window row,
        ``accepted`` the tokens committed."""
        levels = state.levels
        if len(lookahead_argmax) != len(step.lookahead_rows):
            raise ValueError(f"lookahead_argmax has {len(lookahead_argmax)} tokens, the step has "
                             f"{len(step.lookahead_rows)} lookahead rows")
        if step.tokens[step.lookahead_rows.start :] != [t for level in levels for t in level]:
            raise ValueError("step was not built from this state's current window")
        if not accepted:
            raise ValueError("accepted must hold at least the token emitted this step")
        root = step.tokens[0]
        width = state.width
        last_level_argmax = [int(t) for t in lookahead_argmax[len(lookahead_argmax) - len(levels[-1]) :]]

        if len(levels) == self.num_levels:
            for column in range(width):
                key = root if column == 0 else levels[0][column - 1]
                continuation = tuple(levels[level][column] for level in range(1, self.num_levels))
                self._insert(state, key, continuation + (last_level_argmax[column],))
            state.levels = [levels[1][1:], *levels[2:], last_level_argmax]
        else:
            # warm-up: every level drops its first column; the argmax of columns 1.. becomes a new level
            state.levels = [level[1:] for level in levels] + [last_level_argmax[-(width - 1) :]]

        committed = [int(t) for t in accepted]
        self._add_committed(state, committed if state.root_in_recent else [root, *committed])
        state.root_in_recent = True

    def _add_committed(self, state: LookaheadState, tokens: list[int]) -> None:
        """Add the n-grams of the committed text that end at each of ``tokens`` (which extend it)."""
        context = self.ngram_size - 1
        recent = state.recent
        for token in tokens:
            if len(recent) == context:
                self._insert(state, recent[0], (*recent[1:], token))
                recent.pop(0)
            recent.append(token)

    def _insert(self, state: LookaheadState, key: int, continuation: tuple[int, ...]) -> None:
        continuations = state.pool.setdefault(key, OrderedDict())
        continuations[continuation] = None
        continuations.move_to_end(continuation)
        if len(continuations) > self.guess_set_size:
            continuations.popitem(last=False)


def _window_row(num_tree_nodes: int, width: int, level: int, column: int) -> int:
    """Index in the step's tokens of window cell (level, column); cell (0, 0) is the root (index 0)."""
    if level == 0:
        return 0 if column == 0 else num_tree_nodes + column - 1
    return num_tree_nodes + (width - 1) + (level - 1) * width + column


@dataclass
class LookaheadProposal(Proposal):
    """The trie (verified), then the window (fed, not verified); ``window_parents`` number the fed nodes, the trie
    first."""
    window_tokens: list[int] = field(default_factory=list)
    window_parents: list[int] = field(default_factory=list)

    def fed(self) -> tuple[list[int], list[int]]:
        return self.token_ids + self.window_tokens, self.parents + self.window_parents

    @property
    def is_chain(self) -> bool:
        return not self.window_tokens and super().is_chain

    def ranking(self, max_depth: int) -> list[tuple]:
        """The trie's, its first node feeding the window too: (chance, depth, 1 + window)."""
        nodes = super().ranking(max_depth)
        if nodes:
            nodes[0] = (*nodes[0], 1 + len(self.window_tokens))
        return nodes

    def truncated(self, max_depth: int, max_nodes: int, room: int) -> Proposal:
        """The trie cut as any tree is; the window stays where ``max_nodes`` > 0 and it fits in ``room`` beside the
        trie."""
        tree = Proposal.truncated(self, max_depth, max_nodes, room)
        if max_nodes == 0 or len(tree.token_ids) + len(self.window_tokens) > room:
            return Proposal(tree.token_ids, tree.parents)
        shift = len(tree.token_ids) - len(self.token_ids)  # window nodes hang under the root or one another
        return LookaheadProposal(tree.token_ids, tree.parents, window_tokens=self.window_tokens,
                                 window_parents=[p + shift if p >= 0 else p for p in self.window_parents])


class LookaheadProposer(Proposer):
    def __init__(self, window_size: int, ngram_size: int, guess_set_size: int):
        self.decoder = LookaheadDecoder(window_size, ngram_size, guess_set_size)
        self.max_tokens_per_step = self.decoder.max_step_tokens - 1

    def start(self, seq: Sequence) -> None:
        seq.spec_state = self.decoder.new_state(seq.token_ids)

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        for seq in seqs:
            st: LookaheadState = seq.spec_state
            if st.proposal is None:
                step = st.step = self.decoder.build_step(st, seq.token_ids[-1])
                n = step.num_tree_nodes - 1
                tokens, parents = step.tokens[1:], [p - 1 for p in step.parents[1:]]
                trie = Proposal(tokens[:n], parents[:n]).ranked_as_trie(st.acceptance.alpha())  # (the window's
                st.proposal = LookaheadProposal(trie.token_ids, trie.parents, trie.chances,  # parents are the root
                                                window_tokens=tokens[n:], window_parents=parents[n:])  # or its rows)
        return [seq.spec_state.proposal for seq in seqs]

    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        """The target's argmax at each window row, ``[B, widest window]``."""
        windows = [len(p.window_tokens) if isinstance(p, LookaheadProposal) else 0 for p in proposals]
        width = max(windows, default=0)
        if not width:
            return []
        rows = [[first + 1 + len(p.token_ids) + i if i < n else first for i in range(width)]
                for first, p, n in zip(verification.first_rows, proposals, windows)]
        return [logits[torch.tensor(rows, device=logits.device)].argmax(dim=-1)]

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        st: LookaheadState = seq.spec_state
        st.acceptance.observe_trie(proposal, verdict)
        window = len(proposal.window_tokens) if isinstance(proposal, LookaheadProposal) else 0
        if st.step is not None and window:
            self.decoder.update(st, st.step, verdict.ahead[0][:window], verdict.emitted)
        else:  # the prefill, or a step whose window did not fit before the end of the context: no window ran
            self.decoder._add_committed(st, [int(t) for t in verdict.emitted])
            st.root_in_recent = True
        st.step = st.proposal = None
