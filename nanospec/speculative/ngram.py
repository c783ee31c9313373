"""N-gram (prompt lookup) proposer: speculate by copying what followed an earlier occurrence of the suffix.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the first n whose last n tokens also end at an
earlier position e wins (the most recent e), and the guess is ``tokens[e : e + k]``. :class:`NgramIndex` keeps the
end positions of every n-gram, so a lookup costs O(n_max^2 + k) whatever the length. With ``max_candidates > 1`` the
continuations of several occurrences merge into a token trie of at most ``budget`` nodes. :class:`LookupChain` joins
the chain to a model's ranked guesses (the MLP speculator's, an EAGLE-3 head's).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from itertools import islice

from nanospec.sequence import Sequence
from nanospec.speculative.policy import AcceptanceEstimate, accepted_depth
from nanospec.speculative.proposal import Proposal, TokenTrie, Verdict
from nanospec.speculative.proposer import Proposer

# Earlier occurrences scanned per wanted candidate: a run of one token costs O(max_candidates), not O(length).
OCCURRENCES_SCANNED_PER_CANDIDATE = 8


class NgramIndex:
    """A request's tokens and, per n-gram, the increasing positions ``p`` with ``tokens[p - n:p] == ngram``."""

    def __init__(self, min_n: int, max_n: int, token_ids: Tokens[int] = ()):
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the sequence so far (change it through ``extend``)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(token_ids)

    def extend(self, token_ids: Tokens[int]) -> None:
        """Append tokens to the sequence and index the n-grams that end at each of them."""
        tokens = self.tokens
        for token in token_ids:
            tokens.append(int(token))
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)

    def match(self) -> list[int]:
        """The end positions of the longest suffix n-gram that also ends earlier (the last: the suffix itself); []
        when none does."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            positions = self.ends[tuple(tokens[len(tokens) - n :])]
            if len(positions) > 1:
                return positions
        return []


@dataclass
class NgramState:
    index: NgramIndex
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # the chain's alpha
    proposal: Proposal | None = None  # this step's, once made (rank and propose both ask), until its outcome


@dataclass
class LookupChain:
    """A sequence's prompt-lookup chain beside a model's ranked guesses: the chain's depth ``d`` token has chance
    ``a^d``, ``a`` its acceptance estimated on the outcomes of the steps that verified it."""
    index: NgramIndex
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    chain: list[int] = field(default_factory=list)  # the chain last joined

    def join(self, chance: dict[tuple[int, ...], float], proposer: NgramProposer, k: int) -> None:
        """Add the chain behind the sequence's last token, ``k`` deep, to ``chance`` (path -> chance; a path on both
        keeps the larger chance)."""
        self.chain = proposer.chain(self.index, k)
        a = self.acceptance.alpha()
        for d in range(1, len(self.chain) + 1):
            path = tuple(self.chain[:d])
            chance[path] = max(chance.get(path, 0.0), a ** d)

    def observe(self, verified: list[tuple[int, ...]], emitted: list[int]) -> None:
        """After a step that checked the ``verified`` paths and emitted ``emitted``."""
        chain = [p for p in verified if list(p) == self.chain[: len(p)]]
        if chain:
            self.acceptance.observe(len(chain), accepted_depth(chain, emitted))
        self.index.extend(emitted)


class NgramProposer(Proposer):
    """Prompt lookup from one incremental index per sequence, its chain or trie ranked by
    :func:`~nanospec.speculative.policy.trie_chances` of its acceptance (a chain's depth ``j``: ``alpha^j``)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 max_candidates: int = 1, tree_budget: int | None = None):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min = {prompt_lookup_min}, got "
                             f"{prompt_lookup_max}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_candidates = max_candidates
        self.tree_budget = tree_budget or num_speculative_tokens * max_candidates
        self.max_tokens_per_step = num_speculative_tokens if max_candidates == 1 else self.tree_budget

    def new_index(self, prompt_ids: list[int]) -> NgramIndex:
        """Per-sequence state; feed it the accepted output with `extend`."""
        return NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max, prompt_ids)

    def new_chain(self, prompt_ids: list[int]) -> LookupChain:
        """Per-sequence state of a chain joined to another proposer's guesses."""
        return LookupChain(self.new_index(prompt_ids))

    def chain(self, index: NgramIndex, k: int | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        k = self.num_speculative_tokens if k is None else k
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        positions = index.match()
        return index.tokens[positions[-2] : positions[-2] + k] if positions else []

    def tree(self, index: NgramIndex, budget: int) -> tuple[list[int], list[int]]:
        """A trie of continuations, most recent occurrence first, paths at most k long, at most `budget` nodes."""
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        positions = index.match()
        if not positions or budget == 0:
            return [], []
        trie = TokenTrie(budget)
        num_candidates = 0
        max_scanned = self.max_candidates * OCCURRENCES_SCANNED_PER_CANDIDATE
        for start in islice(reversed(positions), 1, 1 + max_scanned):  # most recent first, suffix skipped
            num_candidates += trie.insert(index.tokens[start : start + self.num_speculative_tokens])
            if num_candidates == self.max_candidates or trie.full:
                break
        return trie.token_ids, trie.parents

    # ---------------------------------------------------------------- as the engine's proposer
    def start(self, seq: Sequence) -> None:
        seq.spec_state = NgramState(self.new_index(seq.token_ids))

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[Proposal]:
        for seq in seqs:
            st: NgramState = seq.spec_state
            if st.proposal is None:
                tree = (Proposal.chain(self.chain(st.index)) if self.max_candidates == 1
                        else Proposal(*self.tree(st.index, self.tree_budget)))
                st.proposal = tree.ranked_as_trie(st.acceptance.alpha())
        return [seq.spec_state.proposal for seq in seqs]

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        st: NgramState = seq.spec_state
        st.acceptance.observe_trie(proposal, verdict)
        st.index.extend(verdict.emitted)
        st.proposal = None
