"""The draft-model proposer: a small Llama with its own paged KV guesses k tokens autoregressively.

Each step, per sequence, the draft's KV covers ``num_cached`` tokens of ``token_ids``. Its first
forward is a ragged prefill over every token whose draft KV is missing: the whole prompt the first
time, the one new token after a rejection, and ``[d_k, bonus]`` after all k drafts were accepted
(the draft never ran on its own last guess ``d_k``: **backfill**). Then k-1 one-token forwards
follow, each feeding the previous guess. Guess ``d_j`` is the argmax of the draft's distribution
``q_j`` for greedy requests, otherwise a sample from ``q_j`` (same temperature / top-k / top-p as
the target, uniforms from the request seed on a stream of its own); ``q_j`` goes to the rejection
sampler. After verification the draft KV of rejected guesses is rolled back with the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.cache.kv_cache import KVCache
from nanospec.engine import Proposal
from nanospec.forward_batch import build_forward_batch
from nanospec.kernels.sampling import probs_from_logits, sample_from_probs
from nanospec.model.llama import Llama
from nanospec.model.loader import load_checkpoint
from nanospec.sequence import Sequence
from nanospec.spec.proposer import Proposer

DRAFT_SEED_SALT = 0x5EED_D4AF7  # the draft's random stream differs from the target's for the same request


@dataclass
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # draft K/V exists for token_ids[:num_cached]


class DraftProposer(Proposer):
    def __init__(self, config, target_config, target_tokenizer, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        from nanospec.llm import resolve_dtype

        if config.dtype is not None:
            dtype = resolve_dtype(config.dtype, device)
        checkpoint = load_checkpoint(config.model, dtype)
        if checkpoint.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"the draft model {config.model!r} has a vocabulary of {checkpoint.config.vocab_size} "
                             f"tokens but the target has {target_config.vocab_size}: they must share one vocabulary")
        probe = "Hello, world! 123 ünïcödé <|im_start|>"
        if checkpoint.tokenizer.encode(probe) != target_tokenizer.encode(probe):
            raise ValueError(f"the draft model {config.model!r} tokenizes text differently from the target: "
                             f"they must share one vocabulary")
        self.model = Llama(checkpoint.config, checkpoint.tensors, device, dtype)
        del checkpoint
        c = self.model.config
        self.k = config.num_speculative_tokens
        self.max_tokens_per_step = self.k
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size)
        self.kv_cache = KVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                                self.model.dtype, device)

    def start(self, seq: Sequence) -> None:
        seq.spec_state = DraftState()

    def propose(self, seqs: list[Sequence]) -> list[Proposal]:
        states: list[DraftState] = [s.spec_state for s in seqs]
        for seq, st in zip(seqs, states):  # room for the sequence and k-1 fed guesses
            self.block_manager.reserve(st.block_table, seq.num_tokens + self.k)
        feed = [seq.token_ids[st.num_cached:] for seq, st in zip(seqs, states)]
        starts = [st.num_cached for st in states]
        guesses: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(self.k):
            batch = build_forward_batch(feed, starts, [st.block_table for st in states], self.block_size,
                                        [[len(f) - 1] for f in feed], self.model.device)
            logits = self.model.compute_logits(self.model.forward(batch, self.kv_cache))
            tokens, q = self._draw(seqs, logits, j)
            for i, t in enumerate(tokens):
                guesses[i].append(t)
                if q is not None:
                    probs[i].append(q[i])
                starts[i] += len(feed[i])
            feed = [[t] for t in tokens]
        for seq, st in zip(seqs, states):
            st.num_cached = seq.num_tokens + self.k - 1
        return [Proposal(g, torch.stack(p) if p else None) for g, p in zip(guesses, probs)]

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, j: int):
        """Guess j for every sequence and, if any samples, the draft distributions ``q`` ``[S, V]``."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1).tolist(), None
        dev = logits.device
        q = probs_from_logits(logits,
                              torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=dev),
                              torch.tensor([s.params.top_k for s in seqs], dtype=torch.int32, device=dev),
                              torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=dev))
        seeds = torch.tensor([s.seed ^ DRAFT_SEED_SALT for s in seqs], dtype=torch.int64, device=dev)
        offsets = torch.tensor([s.num_tokens + j for s in seqs], dtype=torch.int64, device=dev)
        return sample_from_probs(q, seeds, offsets).tolist(), q

    def commit(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        """Drop the draft K/V of rejected guesses (called before the emitted tokens are appended)."""
        st: DraftState = seq.spec_state
        st.num_cached = min(st.num_cached, seq.num_tokens + num_accepted)
        self.block_manager.truncate(st.block_table, st.num_cached)

    def preempt(self, seq: Sequence) -> None:
        st: DraftState = seq.spec_state
        self.block_manager.free(st.block_table)
        st.num_cached = 0

    def free(self, seq: Sequence) -> None:
        self.block_manager.free(seq.spec_state.block_table)
        seq.spec_state = None
