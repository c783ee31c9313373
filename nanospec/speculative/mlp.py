"""The MLP speculator as a proposer: guesses from the target's own hidden state, with no extra target pass.

Every step's forward already computes, for each sequence, the target's final hidden state ``h`` (after its final
norm) at the row whose logits drew the sequence's last emitted token ``t_0``: the root's row when no guess was
accepted, else the last accepted node's; after a prefill (or a recompute after preemption), the last prompt row.
Because this proposer ``needs_hidden_states``, the engine asks the runner for them, the Speculator picks that row
of every sequence in one gather and hands it over in the verdict (``Verdict.hidden_state``, kept on the device),
and the next step's guesses start from ``(h, t_0)`` (:mod:`nanospec.model.mlp_speculator`):

    state_0 = h  (h / rms(h) / sqrt(2) with scale_input)
    for i = 0 .. k-1:   state_i+1 = GELU(LN_i(proj_i(state_i) + (emb_weight / state_weight) * emb_i(t_i)))
                        t_i+1     = argmax head_i(state_i+1)
    proposal            the chain t_1 .. t_k

So guessing costs only the speculator's ``k`` small stages, batched over the step's sequences, and one device read
of the guesses; that cost is measured at start-up (:meth:`MLPSpeculatorProposer.measure_cost`) and weighed by the
goodput policy like a draft forward. The guesses are one-hot: verification is the matched rule, so greedy output
and seeded sampling are exactly plain decoding's, whatever the speculator's weights.

Per sequence the proposer keeps ``h`` on the device and how many tokens the sequence had when ``h`` was taken; a
sequence whose state is missing or stale (just added, preempted, a failed step) guesses nothing until its next step
has run. ``speculative_config``: ``{"method": "mlp_speculator", "model": PATH, "num_speculative_tokens": k}``;
without ``model``, the speculator shipped for the embedded SmolLM2-135M-Instruct
(``nanospec/speculators/smollm2-135m-instruct``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanospec.device import resolve_dtype
from nanospec.model.mlp_speculator import MLPSpeculator, load_mlp_speculator
from nanospec.sequence import Sequence
from nanospec.speculative.cost import best_seconds
from nanospec.speculative.proposal import Proposal, Verdict
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
    hidden: torch.Tensor  # [emb_dim] on the device: the target's final hidden state behind the last token
    num_tokens: int       # the sequence's length when it was taken (its last token is t_0)


class MLPSpeculatorProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, speculator: MLPSpeculator, num_speculative_tokens: int | None = None):
        """``num_speculative_tokens``: the most guesses a step verifies (default and at most: the speculator's
        ``n_predict``, its number of stages)."""
        n_predict = speculator.config.n_predict
        k = n_predict if not num_speculative_tokens else num_speculative_tokens
        if k > n_predict:
            raise ValueError(f"speculative_config['num_speculative_tokens'] = {k} exceeds the MLP speculator's "
                             f"n_predict ({n_predict}): it guesses at most {n_predict} tokens")
        self.model = speculator
        self.device = speculator.proj[0].weight.device
        self.k = k
        self.max_tokens_per_step = k

    @classmethod
    def from_config(cls, config, target_config, device: torch.device, dtype: torch.dtype) -> MLPSpeculatorProposer:
        """Load ``config.model`` (or the shipped speculator) for the target, in ``config.dtype`` or the target's."""
        path = speculator_path(config.model, target_config)
        if config.dtype is not None:
            dtype = resolve_dtype(config.dtype, device)
        speculator = load_mlp_speculator(path, emb_dim=target_config.hidden_size, vocab_size=target_config.vocab_size,
                                         device=device, dtype=dtype)
        return cls(speculator, config.num_speculative_tokens)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """One batched pass of the stages over every sequence with a current state; one read of the guesses."""
        proposals = [Proposal() for _ in seqs]
        ready = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0 and self._has_current_state(seq)]
        if not ready:
            return proposals
        hidden = torch.stack([seqs[i].spec_state.hidden for i in ready])
        last_tokens = torch.tensor([seqs[i].token_ids[-1] for i in ready], dtype=torch.int64).to(self.device)
        guesses = self.model.propose(hidden, last_tokens, max(ks[i] for i in ready)).tolist()
        for i, row in zip(ready, guesses):
            proposals[i] = Proposal.chain(row[: ks[i]])
        return proposals

    @staticmethod
    def _has_current_state(seq: Sequence) -> bool:
        state: MLPState | None = seq.spec_state
        return state is not None and state.num_tokens == seq.num_tokens

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Keep the hidden state behind the sequence's new last token for the next step's guesses."""
        seq.spec_state = MLPState(verdict.hidden_state, seq.num_tokens) if verdict.hidden_state is not None else None

    def preempt(self, seq: Sequence) -> None:
        seq.spec_state = None

    def measure_cost(self) -> float:
        """Seconds one guess costs on this device: a batch-1 proposal of ``k`` guesses, read back as in a step,
        over ``k``."""
        c = self.model.config
        hidden = torch.randn(1, c.emb_dim, device=self.device, dtype=self.model.proj[0].weight.dtype)
        last_token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.model.propose(hidden, last_token, self.k).tolist()  # warm-up
        return best_seconds(lambda: self.model.propose(hidden, last_token, self.k).tolist(), self.device) / self.k
