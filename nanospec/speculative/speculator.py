"""The Speculator: everything speculative about an engine step. ``propose``: which sequences guess, how deep (context,
max_tokens, the goodput policy), and their token trees; ``verify``: one pass over the target's logits
(:mod:`nanospec.speculative.verify`) and the step's one device read, then the accepted path's K/V moves next to the
root; ``commit``: the outcome goes back to the proposer. Without a proposer it proposes nothing and verify is plain
sampling.
"""

from __future__ import annotations

import torch

from nanospec.cache.block_manager import BlockManager, slots_of
from nanospec.model.runner import ModelRunner
from nanospec.sequence import Sequence
from nanospec.speculative.cost import forward_shapes, run_one_forward, time_forwards, timing_context
from nanospec.speculative.cost_cache import cached_forward_costs, cost_key
from nanospec.speculative.policy import GoodputPolicy
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.proposer import Proposer
from nanospec.speculative.verify import verify

DENSE_COUNTS = 16  # the token counts up to which every forward is timed at start-up


class Speculator:
    def __init__(self, proposer: Proposer | None, runner: ModelRunner, block_manager: BlockManager, *,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, adaptive: bool = True):
        self.proposer = proposer
        self.runner = runner
        self.model = runner.model
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.max_tokens_per_step = proposer.max_tokens_per_step if proposer is not None else 0
        # the deepest position a guess can reach (a tree's nodes beside each other share a depth)
        self.max_guess_depth = min(getattr(proposer, "k", self.max_tokens_per_step), 64)
        self.needs_hidden_states = proposer is not None and proposer.needs_hidden_states
        self.policy: GoodputPolicy | None = None
        if proposer is None:
            return
        proposer.bind(runner)
        step_tokens = min(self.max_tokens_per_step + 2, max_model_len)  # (a step holds no more than the context)
        if block_manager.blocks_for(step_tokens) > block_manager.num_blocks:
            raise ValueError(f"the KV pool ({block_manager.num_blocks} blocks of {self.block_size} tokens) cannot "
                             f"hold one speculative step ({step_tokens} tokens); raise num_blocks / block_size or "
                             f"lower num_speculative_tokens")
        if adaptive:
            self.policy = self._calibrated_policy(block_manager, max_num_seqs, max_num_batched_tokens)

    def _calibrated_policy(self, block_manager: BlockManager, max_num_seqs: int,
                           max_num_batched_tokens: int) -> GoodputPolicy:
        """The goodput policy over measured costs (:mod:`nanospec.speculative.cost_cache`): the target over 1..k+1
        tokens and the batch sizes this engine can run, and one depth of guessing (the faster of two timings)."""
        k = self.max_tokens_per_step
        # every count of a few tokens; above DENSE_COUNTS, every fourth (and k + 1) with the policy interpolating
        dense = min(k + 1, DENSE_COUNTS)
        sparse = list(range(4 * (dense // 4 + 1), k + 1, 4)) + ([k + 1] if k + 1 > dense else [])
        batches: list[int] = []  # batches of sequences k + 1 tokens each, as many as the engine can run
        while (m := (k + 1) * 2 ** (len(batches) + 1)) <= min(max_num_seqs * (k + 1), max_num_batched_tokens, 256,
                                                             self.max_model_len // 2):
            batches.append(m)
        larger = sparse + batches
        counts = list(range(1, dense + 1)) + larger
        execute = lambda batch: self.runner.execute(batch)[0]  # noqa: E731
        per_seq = max(1, min(k + 1, self.max_model_len - 1))
        context = timing_context(block_manager, per_seq, self.max_model_len)
        max_seqs = block_manager.num_free_blocks // block_manager.blocks_for(context + per_seq)
        shapes = forward_shapes(counts, per_seq, max_seqs)

        def key() -> dict | None:  # (under tensor parallelism the collectives are timed too: not cached)
            if self.model.tp is not None:
                return None
            runner = "graphs" if self.runner.use_graphs else "eager" if self.runner.enforce_eager else "static"
            return cost_key(self.model, runner=runner, block_size=self.block_size, context=context)

        def measure(missing: list[tuple[int, int]]) -> list[float]:
            return time_forwards(execute, block_manager, missing, device=self.model.device, batch_device="cpu",
                                 context=context)

        guess_cost = self.proposer.measure_cost()
        probe = lambda: run_one_forward(execute, block_manager, "cpu")  # noqa: E731
        costs, measured = cached_forward_costs(key, shapes, measure, probe, self.model.device)
        if measured:
            guess_cost = min(guess_cost, self.proposer.measure_cost())
        return GoodputPolicy(k, costs[:dense], guess_cost, larger_forwards=dict(zip(larger, costs[dense:])))

    # ---------------------------------------------------------------- a sequence's life
    def speculates(self, seq: Sequence) -> bool:
        return self.proposer is not None and seq.params.speculate

    def start(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.start(seq)

    def num_lookahead_slots(self, seq: Sequence) -> int:
        """KV slots a sequence needs this step beyond its own tokens: room for a proposal when it is in decode, no
        more than the context has left. A sequence is in decode from its first output token on (a one-token prompt
        at once), so that the steps it guesses at, and seeded tokens that depend on the guesses, do not depend on the
        prefix cache."""
        in_decode = seq.num_tokens - seq.num_cached_tokens == 1 and (seq.num_output_tokens > 0 or seq.num_tokens == 1)
        if not (in_decode and self.speculates(seq)):
            return 0
        return min(self.max_tokens_per_step, self.room(seq))

    def room(self, seq: Sequence) -> int:
        """How many guesses the context has left room to feed after ``seq``'s last token."""
        return max(self.max_model_len - seq.num_tokens - 1, 0)

    def preempt(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.preempt(seq)

    def free(self, seq: Sequence) -> None:
        if self.speculates(seq):
            self.proposer.free(seq)

    def reset_prefix_cache(self) -> bool:
        return self.proposer is None or self.proposer.reset_prefix_cache()

    # ---------------------------------------------------------------- the step
    def propose(self, seqs: list[Sequence]) -> list[Proposal]:
        """One proposal per sequence (empty where it does not guess), cut to what pays, what the context holds and
        what max_tokens can still emit."""
        proposals = [Proposal() for _ in seqs]
        guessing = [i for i, s in enumerate(seqs) if self.num_lookahead_slots(s) > 0]
        if not guessing:
            return proposals
        guessers = [seqs[i] for i in guessing]
        # the deepest guess each may verify (the proposer's most, what max_tokens can still emit) and its room
        rooms = [self.room(s) for s in guessers]
        depths = [max(0, min(self.max_tokens_per_step, room, s.params.max_tokens - s.num_output_tokens - 1))
                  for s, room in zip(guessers, rooms)]
        counts = rooms
        if self.policy is not None:  # the prefix of each ranking that pays; the first c nodes lie at most c deep
            num_tokens = sum(s.num_new_tokens for s in seqs)
            counts = self.policy.choose_nodes(self.proposer.rank(guessers, depths), num_tokens, len(seqs))
            depths = [min(count, depth) for count, depth in zip(counts, depths)]
        vocab = self.model.config.vocab_size
        for i, proposal, depth, count, room in zip(guessing, self.proposer.propose(guessers, depths), depths, counts,
                                                   rooms):
            bad = next((t for t in proposal.fed()[0] if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{type(self.proposer).__name__} proposed token id {bad}, outside the vocabulary "
                                 f"[0, {vocab})")
            proposals[i] = self._verified_part(proposal, depth, min(count, room), room)
        return proposals

    @staticmethod
    def _verified_part(proposal: Proposal, max_depth: int, max_nodes: int, room: int) -> Proposal:
        """The nodes to verify (at most ``room`` fed); when none, the first guesses are still checked against the
        outcome."""
        verified = proposal.truncated(max_depth, max_nodes, room)
        if not verified.token_ids:
            verified.unverified_guesses = proposal.first_guesses()
        return verified

    def verify(self, seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
               hidden: torch.Tensor | None = None) -> list[Verdict]:
        """Each sequence's verdict, with what the proposer read from the forward (``Verdict.ahead``), from one device
        read; then the accepted path's K/V moves from root + 1 + node to root + 1 .. root + depth."""
        outcome = verify(seqs, proposals, logits, self.runner.to_device)
        ahead = self.proposer.read_forward(proposals, logits, hidden, outcome) if self.proposer is not None else []
        verdicts = outcome.read(ahead)  # the step's one device read
        src, dst = [], []
        for seq, verdict in zip(seqs, verdicts):
            root = seq.num_tokens - 1
            moves = [(root + 1 + node, root + 1 + depth) for depth, node in enumerate(verdict.path) if node != depth]
            src += slots_of(seq.block_table, self.block_size, [a for a, _ in moves])
            dst += slots_of(seq.block_table, self.block_size, [b for _, b in moves])
        if src:  # through the runner: under tensor parallelism every rank moves its own heads' K/V
            self.runner.copy_kv_slots(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
        return verdicts

    def read_chunks(self, seqs: list[Sequence], first_row: int) -> None:
        """After a forward in which ``seqs`` ran a chunk of their prompts, from row ``first_row`` on."""
        if self.proposer is not None:
            self.proposer.read_chunks(seqs, first_row)

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """After ``seq`` grew by ``verdict.emitted`` (and did not finish)."""
        if self.speculates(seq):
            self.proposer.commit(seq, proposal, verdict)
