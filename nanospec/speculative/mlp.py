"""The MLP speculator as a proposer: guesses from the target's own hidden state, with no extra target pass.

Every step's forward already computes, for each sequence, the target's final hidden state ``h`` (after its final
norm) at the row whose logits drew the sequence's last emitted token ``t_0``: the root's row when no guess was
accepted, else the last accepted node's; after a prefill (or a recompute after preemption), the last prompt row.
Because this proposer ``needs_hidden_states``, the engine asks the runner for them. During verification, on the
device and before the step's one read, the Speculator picks that row of every sequence in one gather and this
proposer runs its stages from ``(h, t_0)`` (:meth:`guess_ahead`, :mod:`nanospec.model.mlp_speculator`):

    state_0 = h  (h / rms(h) / sqrt(2) with scale_input)
    for i = 0 .. k-1:   state_i+1 = GELU(LN_i(proj_i(state_i) + (emb_weight / state_weight) * emb_i(t_i)))
                        t_i+1     = argmax head_i(state_i+1)
    proposal            the chain t_1 .. t_k

The guesses come back with the verdicts (``Verdict.ahead``), and the next step's :meth:`propose` only slices them:
guessing costs the speculator's ``k`` small stages, batched over the step's sequences, and no device read of its
own. That cost is measured at start-up (:meth:`MLPSpeculatorProposer.measure_cost`) and weighed by the goodput
policy like a draft forward; with the policy the beam goes only one depth deeper than the step verified (a
sequence the policy has stopped pays for one stage, not ``k``, and the beam deepens by at most one a step).
The guesses are one-hot: verification is the matched rule, so greedy output and
seeded sampling are exactly plain decoding's, whatever the speculator's weights.

**Candidate trees** (``tree_top_k: w > 1``, as IBM serves its speculators): instead of the chain, a beam search
over the stages (:meth:`MLPSpeculator.propose_tree`) keeps at each depth the ``w`` most probable paths, scored by
the speculator's summed log-probabilities; the target verifies all ``k * w`` nodes in its one forward. **Prompt
lookup** (``prompt_lookup: True``): the n-gram proposer's chain (:mod:`nanospec.speculative.ngram`) joins the tree
too, first, so text the answer copies from the prompt is guessed even where the speculator cannot. Either way the
goodput policy picks each step's depth, a depth costing ``w`` nodes (``w + 1`` with prompt lookup), and a
sequence it stops will still have its first guesses (depth 1 of the tree) checked against the outcome, so it resumes
when guesses improve.

Per sequence the proposer keeps ``h`` (on the device), the guesses from it, and how many tokens the sequence had
then; a sequence whose state is missing or stale (just added, preempted, a failed step) guesses nothing until its
next step has run. ``speculative_config``: ``{"method": "mlp_speculator", "model": PATH, "num_speculative_tokens": k,
"tree_top_k": w, "prompt_lookup": False}``; without ``model``, the speculator shipped for the embedded
SmolLM2-135M-Instruct (``nanospec/speculators/smollm2-135m-instruct``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanospec.device import resolve_dtype
from nanospec.model.mlp_speculator import MLPSpeculator, load_mlp_speculator
from nanospec.sequence import Sequence
from nanospec.speculative.cost import best_seconds
from nanospec.speculative.ngram import NgramIndex, NgramProposer
from nanospec.speculative.proposal import Proposal, TokenTrie, Verdict
from nanospec.speculative.proposer import Proposer

SHIPPED_SPECULATORS = Path(__file__).resolve().parents[1] / "speculators"
SHIPPED_FOR_EMBEDDED = SHIPPED_SPECULATORS / "smollm2-135m-instruct"
# The embedded model's shape (SmolLM2-135M-Instruct): a target of this shape (the embedded GGUF, an HF or converted
# copy) gets the shipped speculator when speculative_config names no model.
EMBEDDED_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3}


def is_embedded_shape(target_config) -> bool:
    return all(getattr(target_config, name) == value for name, value in EMBEDDED_SHAPE.items())


def speculator_path(model: str | None, target_config) -> Path:
    """The speculator directory: ``model``, or for the embedded model's shape the shipped one (a clear error when
    the target is another model or the shipped directory is missing)."""
    if model is not None:
        return Path(model)
    if not is_embedded_shape(target_config):
        c = target_config
        raise ValueError(f"speculative_config for method 'mlp_speculator' needs 'model': the directory of an MLP "
                         f"speculator for this target (config.json + model.safetensors, emb_dim {c.hidden_size}, "
                         f"vocab_size {c.vocab_size}). Only the embedded SmolLM2-135M-Instruct has a shipped one, and "
                         f"this target (hidden_size {c.hidden_size}, {c.num_hidden_layers} layers, vocab_size "
                         f"{c.vocab_size}) is not it")
    if not (SHIPPED_FOR_EMBEDDED / "config.json").is_file():
        raise FileNotFoundError(f"the MLP speculator shipped for the embedded SmolLM2-135M-Instruct is missing from "
                                f"this installation ({SHIPPED_FOR_EMBEDDED}); pass speculative_config['model'], the "
                                f"directory of one (python -m nanospec.train_speculator trains one)")
    return SHIPPED_FOR_EMBEDDED


@dataclass
class MLPState:
    hidden: torch.Tensor | None = None  # [emb_dim] on the device: the target's final hidden state behind the last token
    num_tokens: int = 0                 # the sequence's length when it was taken (its last token is t_0)
    beam: list[list[int]] | None = None  # the beam from it, computed during verification: [token ids, parents]
    lookup: NgramIndex | None = None    # the sequence's n-gram index, with prompt lookup


class MLPSpeculatorProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, speculator: MLPSpeculator, num_speculative_tokens: int | None = None, tree_top_k: int = 1,
                 prompt_lookup: NgramProposer | None = None):
        """``num_speculative_tokens``: the deepest guess a step verifies (default and at most: the speculator's
        ``n_predict``, its number of stages); ``tree_top_k``: the beam width (1: a chain); ``prompt_lookup``: an
        n-gram proposer whose chain joins the tree."""
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
        self.nodes_per_depth = tree_top_k + (prompt_lookup is not None)
        self.max_tokens_per_step = k * self.nodes_per_depth

    @classmethod
    def from_config(cls, config, target_config, device: torch.device, dtype: torch.dtype) -> MLPSpeculatorProposer:
        """Load ``config.model`` (or the shipped speculator) for the target, in ``config.dtype`` or the target's."""
        path = speculator_path(config.model, target_config)
        if config.dtype is not None:
            dtype = resolve_dtype(config.dtype, device)
        speculator = load_mlp_speculator(path, emb_dim=target_config.hidden_size, vocab_size=target_config.vocab_size,
                                         device=device, dtype=dtype)
        lookup = None
        if config.prompt_lookup:
            lookup = NgramProposer(speculator.config.n_predict, config.prompt_lookup_min, config.prompt_lookup_max)
        return cls(speculator, config.num_speculative_tokens, config.tree_top_k, lookup)

    def start(self, seq: Sequence) -> None:
        seq.spec_state = MLPState(lookup=self.prompt_lookup.new_index(seq.token_ids) if self.prompt_lookup else None)

    def guess_ahead(self, hidden_states: torch.Tensor, last_tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """During verification, on the device: every sequence's beam, ``min(depth, k)`` deep, from the state behind
        its last emitted token; it comes back in the verdicts' read, for the next step's proposal."""
        return list(self.model.propose_tree(hidden_states, last_tokens, min(depth, self.k), self.width))

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Each sequence's beam, computed during the last verification, cut to ``ks[i]`` depths (or as deep as it
        was computed); no device work. A sequence the policy gives ``k = 0`` still gets its first depth, which the
        speculator checks without verifying it."""
        proposals = [Proposal() for _ in seqs]
        for i, seq in enumerate(seqs):
            if not self._has_current_state(seq):
                continue
            k = max(ks[i], 1)
            tokens, parents = (nodes[: k * self.width] for nodes in seq.spec_state.beam)
            proposals[i] = Proposal(tokens, parents) if self.prompt_lookup is None else \
                self._with_prompt_lookup(seq, k, tokens, parents)
        return proposals

    def _with_prompt_lookup(self, seq: Sequence, k: int, tokens: list[int], parents: list[int]) -> Proposal:
        """The n-gram chain (up to ``k`` tokens), then the beam's paths, merged into one trie."""
        trie = TokenTrie()
        trie.insert(self.prompt_lookup.chain(seq.spec_state.lookup, k))
        for path in Proposal(tokens, parents).paths():
            trie.insert(path)
        return Proposal(trie.token_ids, trie.parents)

    @staticmethod
    def _has_current_state(seq: Sequence) -> bool:
        state: MLPState | None = seq.spec_state
        return state is not None and state.beam is not None and state.num_tokens == seq.num_tokens

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Keep the hidden state behind the sequence's new last token, and the beam from it, for the next step."""
        state: MLPState = seq.spec_state
        state.hidden, state.beam, state.num_tokens = verdict.hidden_state, verdict.ahead, seq.num_tokens
        if state.lookup is not None:
            state.lookup.extend(verdict.emitted)

    def preempt(self, seq: Sequence) -> None:
        seq.spec_state.hidden = seq.spec_state.beam = None

    def measure_cost(self) -> float:
        """Seconds one depth of guesses costs on this device: a batch-1 beam ``k`` deep, read back as in a step,
        over ``k``."""
        c = self.model.config
        hidden = torch.randn(1, c.emb_dim, device=self.device, dtype=self.model.proj[0].weight.dtype)
        last_token = torch.zeros(1, dtype=torch.int64, device=self.device)

        def beam():
            return torch.stack(self.model.propose_tree(hidden, last_token, self.k, self.width)).tolist()

        beam()  # warm-up
        return best_seconds(beam, self.device) / self.k
