"""The Speculator owns everything speculative about an engine step, in the order the engine asks:

    propose   which sequences guess and how deep (the goodput policy, the context, max_tokens), and the
              proposer's token tree for each (a chain is a tree); of a ranked tree (nodes best first, each
              with its chance) the policy keeps the prefix that pays
    verify    one pass over the target's logits: each sequence's accepted path and the token after it
              (plain sampling for a sequence that does not speculate); the accepted path's K/V is
              then moved next to the root, so the sequence's K/V is contiguous again; for a proposer
              that reads hidden states, each verdict gets the one behind its last emitted token, and
              the proposer's next guesses from it, read with the verdicts
    commit    the outcome goes back to the proposer (its own state, draft K/V rollback) and into the
              sequence's acceptance estimate

Without a proposer the same seam proposes nothing and verify is plain sampling.
"""

from __future__ import annotations

import torch

from nanospec.cache.block_manager import BlockManager, slots_of
from nanospec.model.runner import ModelRunner
from nanospec.sequence import Sequence
from nanospec.speculative.cost import time_forwards
from nanospec.speculative.policy import AcceptanceEstimate, GoodputPolicy
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.proposer import Proposer
from nanospec.speculative.verify import verify


class Speculator:
    def __init__(self, proposer: Proposer | None, runner: ModelRunner, block_manager: BlockManager, *,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, adaptive: bool = True):
        self.proposer = proposer
        self.runner = runner
        self.model = runner.model
        self.kv_cache = runner.kv_cache
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.max_tokens_per_step = proposer.max_tokens_per_step if proposer is not None else 0
        self.needs_hidden_states = proposer is not None and proposer.needs_hidden_states
        self.policy: GoodputPolicy | None = None
        if proposer is None:
            return
        if block_manager.blocks_for(self.max_tokens_per_step + 2) > block_manager.num_blocks:
            raise ValueError(f"the KV pool ({block_manager.num_blocks} blocks of {self.block_size} tokens) cannot "
                             f"hold one speculative step ({self.max_tokens_per_step + 2} tokens); raise num_blocks "
                             f"/ block_size or lower num_speculative_tokens")
        if adaptive and proposer.adaptive_k:
            self.policy = self._calibrated_policy(block_manager, max_num_seqs, max_num_batched_tokens)

    def _calibrated_policy(self, block_manager: BlockManager, max_num_seqs: int,
                           max_num_batched_tokens: int) -> GoodputPolicy:
        """Time the target over 1..k+1 tokens (one sequence's verify) and, sparser, over the token counts
        of the batches of verifies this engine can run (through the runner: graphs where the steps use them);
        time one depth of the proposer's guesses, before and after the target's timings, and keep the faster (a
        stall of a shared machine during one of them would otherwise price guessing several times over)."""
        guess_cost = self.proposer.measure_cost()
        k = self.max_tokens_per_step
        larger: list[int] = []
        while (m := (k + 1) * 2 ** (len(larger) + 1)) <= min(max_num_seqs * (k + 1), max_num_batched_tokens, 256,
                                                            self.max_model_len // 2):
            larger.append(m)
        costs = time_forwards(lambda batch: self.runner.execute(batch)[0], block_manager,
                              list(range(1, k + 2)) + larger, per_seq=k + 1, device=self.model.device,
                              batch_device="cpu", max_len=self.max_model_len)
        return GoodputPolicy(k, costs[:k + 1], min(guess_cost, self.proposer.measure_cost()),
                             larger_forwards=dict(zip(larger, costs[k + 1:])))

    # ---------------------------------------------------------------- a sequence's life
    def speculates(self, seq: Sequence) -> bool:
        return self.proposer is not None and seq.params.speculate

    def start(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.start(seq)
            seq.acceptance = AcceptanceEstimate()

    def num_lookahead_slots(self, seq: Sequence) -> int:
        """KV slots a sequence needs this step beyond its own tokens: room for a proposal when it is in decode."""
        in_decode = seq.num_tokens - seq.num_cached_tokens == 1
        return self.max_tokens_per_step if in_decode and self.speculates(seq) else 0

    def preempt(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.preempt(seq)

    def free(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.free(seq)

    # ---------------------------------------------------------------- the step
    def propose(self, seqs: list[Sequence]) -> list[Proposal]:
        """One proposal per sequence (empty for those that do not guess this step). A proposal is cut to the
        depth that pays (goodput policy), that the context has room for, and that max_tokens can still emit
        (one token always comes from the target)."""
        proposals = [Proposal() for _ in seqs]
        guessing = [i for i, s in enumerate(seqs) if self.num_lookahead_slots(s) > 0]
        if not guessing:
            return proposals
        guessers = [seqs[i] for i in guessing]
        # the deepest guess each may verify (the proposer's most, what max_tokens can still emit) and its room
        rooms = [max(self.max_model_len - s.num_tokens - 1, 0) for s in guessers]
        depths = [max(0, min(self.max_tokens_per_step, room, s.params.max_tokens - s.num_output_tokens - 1))
                  for s, room in zip(guessers, rooms)]
        num_tokens = sum(s.num_tokens - s.num_cached_tokens for s in seqs)
        if self.proposer.ranks_nodes:  # all it guessed, best first: the policy keeps a prefix of each
            guessed = self.proposer.propose(guessers, depths)
            if self.policy is not None:
                counts = self.policy.choose_nodes([[(c, d) for c, d in zip(p.chances or (), p.depths) if d <= depth]
                                                   for p, depth in zip(guessed, depths)], num_tokens, len(seqs))
                rooms = [min(count, room) for count, room in zip(counts, rooms)]
        else:  # the policy picks each depth first: a draft model's guesses cost a forward each
            if self.policy is not None:
                ks = self.policy.choose_ks([s.acceptance for s in guessers], num_tokens, len(seqs))
                depths = [min(k, depth) for k, depth in zip(ks, depths)]
            guessed = self.proposer.propose(guessers, depths)
        for i, proposal, depth, room in zip(guessing, guessed, depths, rooms):
            proposals[i] = self._verified_part(proposal, depth, room)
        return proposals

    def _verified_part(self, proposal: Proposal, max_depth: int, max_nodes: int) -> Proposal:
        """The candidates to verify: down to ``max_depth``, the first ``max_nodes``; none: the first guesses are
        still checked against the outcome."""
        self._check_vocabulary(proposal)
        verified = proposal.truncated(max_depth, max_nodes)
        if verified.num_candidates == 0:
            verified.unverified_guesses = proposal.first_guesses()
        return verified

    def _check_vocabulary(self, proposal: Proposal) -> None:
        vocab = self.model.config.vocab_size
        bad = next((t for t in proposal.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{type(self.proposer).__name__} proposed token id {bad}, outside the vocabulary "
                             f"[0, {vocab})")

    def verify(self, seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
               hidden: torch.Tensor | None = None) -> list[Verdict]:
        """Each sequence's verdict; an accepted path off the chain has its K/V moved next to the root. With the
        step's final hidden states (``hidden``, a row per logits row) each verdict gets its ``hidden_state``, the
        one at the row whose logits drew the last emitted token, picked on the device by one gather, and the
        proposer's guesses from it (``Proposer.guess_ahead``) come back in the verdicts' one read."""
        states: list[torch.Tensor] = []

        def guess_ahead(rows: torch.Tensor, last_tokens: torch.Tensor) -> list[torch.Tensor]:
            states.append(hidden[rows])
            # with the goodput policy, one depth deeper than this step verified: a step that verifies little pays
            # for little guessing ahead (the guesses deepen by at most one a step)
            depth = self.proposer.max_tokens_per_step if self.policy is None else \
                max((p.max_depth() for p in proposals), default=0) + 1
            return self.proposer.guess_ahead(states[0], last_tokens, depth)

        verdicts = verify(seqs, proposals, logits, self.runner.to_device, guess_ahead if hidden is not None else None)
        self._compact_accepted_paths(seqs, verdicts)
        for verdict, state in zip(verdicts, states[0].unbind(0) if states else ()):
            verdict.hidden_state = state
        return verdicts

    def _compact_accepted_paths(self, seqs: list[Sequence], verdicts: list[Verdict]) -> None:
        """Node i's K/V sits at root + 1 + i; the accepted path's moves to root + 1 .. root + depth."""
        src, dst = [], []
        for seq, verdict in zip(seqs, verdicts):
            root = seq.num_tokens - 1
            moves = [(root + 1 + node, root + 1 + depth) for depth, node in enumerate(verdict.path) if node != depth]
            src += slots_of(seq.block_table, self.block_size, [a for a, _ in moves])
            dst += slots_of(seq.block_table, self.block_size, [b for _, b in moves])
        if not src:
            return
        # through the runner: under tensor parallelism every rank moves its own heads' K/V
        self.runner.copy_kv_slots(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """After ``seq`` grew by ``verdict.emitted`` (and did not finish): tell the proposer and the estimate."""
        if not self.speculates(seq):
            return
        self.proposer.commit(seq, proposal, verdict)
        if self.proposer.ranks_nodes:  # its chances are its own to calibrate
            return
        decay = self.policy.decay if self.policy is not None else 1.0
        if proposal.num_candidates:
            seq.acceptance.observe(proposal.max_depth(), verdict.num_accepted, decay)
        elif proposal.unverified_guesses:  # as if depth 1 had been verified: a hit if the target's token is there
            seq.acceptance.observe(1, int(verdict.emitted[0] in proposal.unverified_guesses), decay)
