"""The engine loop: one step = schedule, propose, one target forward, verify, commit.

    seqs     = scheduler.schedule()              which sequences run, KV blocks reserved
    k        = policy.choose_ks(seqs)            how many guesses pay off in this batch on this machine (goodput)
    drafts   = proposer.propose(seqs, k)         candidate tokens (+ draft probs) per sequence
    batch    = [uncached tokens + drafts]        one ragged batch: prefill, decode and verify alike
    logits   = model(batch)                      ONE target pass
    tokens   = verify(logits, drafts)            greedy / rejection sampling (plain sampling if no drafts)
    commit                                       append tokens, roll back rejected KV, stop checks

Each sequence's new tokens are ``token_ids[num_cached_tokens:]`` followed by its drafts ``d_1..d_k``.
The target's logits at those last k+1 rows give ``p_1..p_{k+1}``: ``p_i`` judges ``d_i`` and
``p_{k+1}`` gives the bonus token when every draft is accepted. After verification the K/V of the
rejected drafts is dead: ``num_cached_tokens`` moves to just before the newly emitted token and
the blocks past it return to the pool.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from nanospec.cache.block_manager import BlockManager, slots_of
from nanospec.cache.kv_cache import KVCache
from nanospec.forward_batch import build_forward_batch
from nanospec.kernels.attention_mask import tree_depths, tree_mask_from_parents
from nanospec.kernels.kv_store import copy_kv_slots
from nanospec.kernels.sampling import greedy, sample
from nanospec.model.llama import Llama
from nanospec.outputs import RequestOutput
from nanospec.sampling_params import SamplingParams
from nanospec.scheduler import Scheduler
from nanospec.sequence import Sequence
from nanospec.spec.policy import AcceptanceEstimate, GoodputPolicy, best_seconds
from nanospec.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 8192


@dataclass
class Proposal:
    """What one sequence feeds after its root (the last committed token) for verification.

    ``token_ids``: the candidates, a chain ``d_1..d_k`` or, with ``parents``, a token tree
    (``parents[i]`` is the index of node i's parent in ``token_ids``, -1 for the root).
    ``draft_probs`` ``[k, V]``: the distributions a chain was sampled from (None: one-hot).
    ``lookahead_tokens``: fed after the candidates but not verified (lookahead decoding's Jacobi
    window); then ``mask`` (bitmask over root + candidates + lookahead tokens) and ``positions``
    (offsets from the root's position, root first) give the layout, and the target's argmax at
    those rows goes back to the proposer.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None
    lookahead_tokens: list[int] = field(default_factory=list)
    mask: torch.Tensor | None = None
    positions: list[int] | None = None
    unverified_guess: int | None = None  # a free guess not worth verifying; checked against the outcome

    @property
    def is_chain(self) -> bool:
        return self.parents is None and not self.lookahead_tokens

    @property
    def num_fed(self) -> int:
        return len(self.token_ids) + len(self.lookahead_tokens)

    def layout(self) -> tuple[torch.Tensor, list[int]]:
        """(bitmask, position offsets) over root + candidates + lookahead tokens."""
        if self.mask is not None:
            return self.mask, self.positions
        chain = range(-1, len(self.token_ids) - 1)  # node i's parent is node i - 1
        parents = [-1] + [p + 1 for p in (self.parents if self.parents is not None else chain)]
        return tree_mask_from_parents(parents), tree_depths(parents)


@dataclass
class StepResult:
    """What verification decided for one sequence."""

    emitted: list[int]                   # accepted candidates, then the corrected or bonus token
    path: list[int] | None = None        # tree: indices (into token_ids) of the accepted nodes, root to leaf
    lookahead_argmax: list[int] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer, config: EngineConfig, proposer=None, seed: int = 0,
                 adaptive_speculation: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.proposer = proposer
        mc = model.config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.kv_cache = KVCache(mc.num_hidden_layers, config.num_blocks, config.block_size, mc.num_key_value_heads,
                                mc.head_dim, model.dtype, model.device)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_lookahead_slots=self._num_lookahead_slots, on_preempt=self._on_preempt)
        self.sequences: dict[int, Sequence] = {}
        self.stats = EngineStats()
        self._next_id = 0
        self._seed_rng = random.Random(seed)
        self.policy = None
        if proposer is not None and self.block_manager.blocks_for(proposer.max_tokens_per_step + 2) > config.num_blocks:
            raise ValueError(f"the KV pool ({config.num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                             f"speculative step ({proposer.max_tokens_per_step + 2} tokens); raise num_blocks / "
                             f"block_size or lower num_speculative_tokens")
        if proposer is not None and adaptive_speculation and proposer.adaptive_k:
            k = proposer.max_tokens_per_step
            # T(m) for one sequence's verify (m = 1..k+1) and, sparser, for the batches this engine can run
            larger = []
            while (m := (k + 1) * 2 ** (len(larger) + 1)) <= min(config.max_num_seqs * (k + 1),
                                                                config.max_num_batched_tokens, 256,
                                                                config.max_model_len // 2):
                larger.append(m)
            costs = self.measure_forward_cost(list(range(1, k + 2)) + larger)
            self.policy = GoodputPolicy(k, costs[:k + 1], proposer.measure_cost(),
                                        larger_forwards=dict(zip(larger, costs[k + 1:])))

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate and queue a request; returns its id. Raises ValueError before any work."""
        self.validate_prompt(prompt_token_ids, params)
        seq = Sequence(self._next_id, prompt_token_ids, params,
                       params.seed if params.seed is not None else self._seed_rng.getrandbits(63))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        if self._speculates(seq):
            self.proposer.start(seq)
            seq.acceptance = AcceptanceEstimate()
        self._next_id += 1
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is out of the vocabulary [0, {vocab})")
        max_len = self.config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but the context holds {max_len} "
                             f"(prompt + at least one generated token)")
        lifetime = min(len(prompt_token_ids) + params.max_tokens, max_len) + self._max_lookahead()
        need = self.block_manager.blocks_for(lifetime)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"the KV pool is too small for this request: it needs {need} blocks of "
                             f"{self.config.block_size} tokens ({lifetime} tokens) but the pool has "
                             f"{self.block_manager.num_blocks}; raise num_blocks / kv_cache_memory or lower max_tokens")

    def abort(self, request_id: int) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- speculation hooks
    def _speculates(self, seq: Sequence) -> bool:
        return self.proposer is not None and seq.params.speculate

    def _max_lookahead(self) -> int:
        return self.proposer.max_tokens_per_step if self.proposer is not None else 0

    def _num_lookahead_slots(self, seq: Sequence) -> int:
        in_decode = seq.num_tokens - seq.num_cached_tokens == 1
        return self.proposer.max_tokens_per_step if in_decode and self._speculates(seq) else 0

    def _choose_ks(self, seqs: list[Sequence], spec_seqs: list[int]) -> list[int]:
        """Guesses for each speculating sequence ``seqs[i]``, ``i`` in ``spec_seqs``, given the whole batch."""
        if self.policy is None:
            return [self.proposer.max_tokens_per_step] * len(spec_seqs)
        num_tokens = sum(s.num_tokens - s.num_cached_tokens for s in seqs)
        return self.policy.choose_ks([seqs[i].acceptance for i in spec_seqs], num_tokens, len(seqs))

    def measure_forward_cost(self, token_counts: list[int], context: int = 64) -> list[float]:
        """Seconds of one target forward over each of ``token_counts`` new tokens after ``context`` cached ones
        (fewer when the pool is small: the largest counts it cannot hold are timed at what it can)."""
        bm = self.block_manager
        longest = min(max(token_counts), bm.num_free_blocks * bm.block_size, self.config.max_model_len)
        if bm.blocks_for(context + longest) > bm.num_free_blocks or context + longest > self.config.max_model_len:
            context = 0
        table: list[int] = []
        bm.reserve(table, context + longest)
        run = lambda tokens, start: self.model.forward(  # noqa: E731
            build_forward_batch([[0] * tokens], [start], [table], bm.block_size, [[tokens - 1]], self.model.device),
            self.kv_cache)
        if context:
            run(context, 0)
        device = self.model.device
        costs = [best_seconds(lambda: self.model.compute_logits(run(min(m, longest), context)), device,
                              repeats=3 if m <= 16 else 1)
                 for m in token_counts]
        bm.free(table)
        return costs

    def _on_preempt(self, seq: Sequence) -> None:
        if self._speculates(seq):
            self.proposer.preempt(seq)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return []

        # 1. propose: guesses only for sequences in decode (one uncached token), as many as pay off
        proposals = [Proposal([]) for _ in seqs]
        spec_seqs = [i for i, s in enumerate(seqs) if self._num_lookahead_slots(s) > 0]
        if spec_seqs:
            ks = self._choose_ks(seqs, spec_seqs)
            for i, k, proposal in zip(spec_seqs, ks, self.proposer.propose([seqs[i] for i in spec_seqs], ks)):
                room = self.config.max_model_len - seqs[i].num_tokens - 1
                if proposal.is_chain:  # no guess past the context or past max_tokens (one token always comes)
                    k = min(k, max(room, 0), seqs[i].params.max_tokens - seqs[i].num_output_tokens - 1)
                    if k == 0 and proposal.token_ids:
                        proposal.unverified_guess = proposal.token_ids[0]
                    proposal.token_ids = proposal.token_ids[:k]
                    if proposal.draft_probs is not None:
                        proposal.draft_probs = proposal.draft_probs[:k]
                elif proposal.num_fed > room:  # a tree or window reaching past the context: skip this step
                    proposal = Proposal([])
                proposals[i] = proposal

        # 2. one ragged batch: uncached tokens, then candidates (and lookahead tokens); logits from the root on
        token_lists, starts, logits_rows, positions, masks = [], [], [], [], []
        for seq, proposal in zip(seqs, proposals):
            uncached = seq.token_ids[seq.num_cached_tokens:]
            tokens = uncached + proposal.token_ids + proposal.lookahead_tokens
            token_lists.append(tokens)
            starts.append(seq.num_cached_tokens)
            logits_rows.append(list(range(len(uncached) - 1, len(tokens))))
            if proposal.is_chain:
                positions.append(None)
                masks.append(None)
            else:  # in decode, so the root is the only uncached token
                mask, offsets = proposal.layout()
                positions.append([seq.num_cached_tokens + o for o in offsets])
                masks.append(mask)
        batch = build_forward_batch(token_lists, starts, [s.block_table for s in seqs], self.config.block_size,
                                    logits_rows, self.model.device, positions=positions, tree_masks=masks)

        # 3. ONE target forward
        t1 = time.perf_counter()
        logits = self.model.compute_logits(self.model.forward(batch, self.kv_cache))
        self.stats.forward_seconds += time.perf_counter() - t1

        # 4. verify (or sample), 5. commit
        results = self._verify(seqs, proposals, logits)
        outputs = []
        for seq, proposal, result in zip(seqs, proposals, results):
            outputs.append(self._commit(seq, proposal, result))
        self.stats.num_steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        return outputs

    def _verify(self, seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor) -> list[StepResult]:
        """What each sequence emits this step: accepted candidates, then one corrected or bonus token."""
        if not any(self._speculates(s) for s in seqs):
            return [StepResult([t]) for t in self._sample(seqs, logits)]
        from nanospec.spec.verify import verify  # greedy / rejection sampling, chains and trees

        return verify(seqs, proposals, logits, [self._speculates(s) for s in seqs], self._sample)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row of ``logits`` (row r belongs to ``seqs[r]``, drawn at its current length)."""
        if all(s.params.greedy for s in seqs):
            return greedy(logits).tolist()
        dev = logits.device
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.int32, device=dev)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=dev)
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        offsets = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64, device=dev)
        return sample(logits, temperature, top_k, top_p, seeds, offsets).tolist()

    def _commit(self, seq: Sequence, proposal: Proposal, result: StepResult) -> RequestOutput:
        tokens, num_accepted = result.emitted, result.num_accepted
        k = len(proposal.token_ids)
        if result.path is not None:
            self._compact_accepted_path(seq, result.path)
        seq.num_steps += 1
        seq.num_draft_tokens += k
        self.stats.num_draft_tokens += k
        self.stats.num_verify_steps += k > 0
        # K/V now exists for every old token and the accepted drafts; the emitted last token has none yet
        seq.num_cached_tokens = seq.num_tokens + num_accepted
        if self._speculates(seq):
            self.proposer.commit(seq, proposal, result)
            decay = self.policy.decay if self.policy is not None else 1.0
            if k and proposal.is_chain:
                seq.acceptance.observe(k, num_accepted, decay)
            elif proposal.unverified_guess is not None:
                seq.acceptance.observe(1, int(proposal.unverified_guess == tokens[0]), decay)

        eos = set() if seq.params.ignore_eos else set(self.tokenizer.eos_token_ids)
        finish_reason = None
        new_tokens = []
        for t in tokens:
            new_tokens.append(t)
            if t in eos:
                finish_reason = "stop"
                break
            if seq.num_output_tokens + len(new_tokens) >= seq.params.max_tokens:
                finish_reason = "length"
                break
            if seq.num_tokens + len(new_tokens) >= self.config.max_model_len:
                finish_reason = "length"
                break
        seq.token_ids.extend(new_tokens)
        seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
        self.stats.num_generated_tokens += len(new_tokens)
        num_accepted_emitted = min(num_accepted, len(new_tokens))  # not the drafts cut off by eos or max_tokens
        seq.num_accepted_tokens += num_accepted_emitted
        self.stats.num_accepted_tokens += num_accepted_emitted
        if self._speculates(seq):
            self.proposer.extend(seq, new_tokens)

        delta = seq.detokenizer.add(new_tokens)
        if finish_reason is not None:  # release text held back for an unfinished character
            delta += seq.detokenizer.flush()
        previous_len = len(seq.text)
        seq.text += delta
        for stop in seq.params.stop_list:
            # a stop string may straddle the previous delta: search from just before it
            idx = seq.text.find(stop, max(0, previous_len - len(stop) + 1))
            if idx >= 0:
                seq.text = seq.text[:idx]
                finish_reason = "stop"
                break
        # stream only text that cannot turn out to be the start of a stop string
        streamable = len(seq.text) if finish_reason is not None else \
            len(seq.text) - _stop_prefix_len(seq.text, seq.params.stop_list)
        delta = seq.text[seq.num_text_streamed:streamable]
        seq.num_text_streamed = max(seq.num_text_streamed, streamable)
        if finish_reason is not None:
            self._finish(seq, finish_reason)
        else:
            self.block_manager.truncate(seq.block_table, seq.num_tokens)
        return self._output(seq, delta)

    def _compact_accepted_path(self, seq: Sequence, path: list[int]) -> None:
        """Move the K/V of an accepted tree path (node i sits at root + 1 + i) to the slots right after the root."""
        root = seq.num_tokens - 1
        src = [root + 1 + node for node in path]
        dst = [root + 1 + depth for depth in range(len(path))]
        moves = [(a, b) for a, b in zip(src, dst) if a != b]
        if not moves:
            return
        bs, table, device = self.config.block_size, seq.block_table, self.model.device
        src_slots = torch.tensor(slots_of(table, bs, [a for a, _ in moves]), dtype=torch.int64, device=device)
        dst_slots = torch.tensor(slots_of(table, bs, [b for _, b in moves]), dtype=torch.int64, device=device)
        for layer in range(self.model.config.num_hidden_layers):
            copy_kv_slots(*self.kv_cache.layer(layer), src_slots, dst_slots)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self._speculates(seq):
            self.proposer.free(seq)

    def _output(self, seq: Sequence, delta: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, text=seq.text,
            token_ids=seq.output_token_ids, finish_reason=seq.finish_reason, num_steps=seq.num_steps,
            num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens, delta_text=delta)

    def pop_finished(self, request_id: int) -> None:
        self.sequences.pop(request_id, None)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string (held back)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
