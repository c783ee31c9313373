"""The draft-model proposer: a small Llama with its own paged KV (and prefix cache) guesses k tokens autoregressively.

Each step's first draft forward feeds every token whose draft K/V is missing (the prompt, the token after a
rejection, or ``[d_k, bonus]`` after a full acceptance), then k-1 one-token forwards each feed the previous guess.
Guess ``d_j`` is the argmax of the draft's ``q_j`` when greedy, else drawn from it: with ``"acceptance":
"rejection"`` from a seed stream of the draft's own, ``q_j`` going to the rejection sampler; with ``"coupled"`` by the
exponential race with the target's own numbers at that position, verified by matching (output equals plain seeded
sampling's). Trees (``tree_top_k > 1``): each frontier node branches on its ``tree_top_k`` most probable tokens and the
``tree_budget`` best children by cumulative log-probability are kept, one draft forward a level; verified one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.cache.kv_cache import KVCache
from nanospec.kernels.sampling import sample_from_probs
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.config import LlamaConfig
from nanospec.model.llama import Llama
from nanospec.model.loader import OpenCheckpoint, open_checkpoint
from nanospec.model.parallel import ParallelGroup, check_shardable
from nanospec.model.quantization import int4_group_size
from nanospec.model.runner import ModelRunner
from nanospec.sequence import Sequence
from nanospec.sampling.tensors import SamplingTensors, draw_tokens
from nanospec.speculative.cost import time_forwards, timing_context
from nanospec.speculative.policy import AcceptanceEstimate, chain_ranking
from nanospec.speculative.proposal import Proposal, Verdict, tree_depths, tree_mask
from nanospec.speculative.proposer import Proposer
from nanospec.tokenizer import Tokenizer

DRAFT_SEED_SALT = 0x5EED_D4AF7  # the draft's random stream differs from the target's for the same request
MAX_RETRY_AFTER = 64  # the most steps a stopped draft waits before the policy weighs it again


@dataclass
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # draft K/V exists for token_ids[:num_cached]
    num_reusable: int = 0  # of this step's guesses, how many (the first) have draft K/V in sequence order
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # the chain's alpha
    steps_undrafted: int = 0  # steps in a row the policy chose not to draft
    retry_after: int = 1  # undrafted steps after which the estimate returns to its prior (see commit)


def check_draft_config(draft: LlamaConfig, target: LlamaConfig, model, max_model_len: int | None = None) -> None:
    """ValueError for the draft model `model` (config `draft`) that cannot draft for the `target`: another vocabulary
    size, or a context shorter than ``max_model_len``."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {str(model)!r} has a vocabulary of {draft.vocab_size} tokens but the "
                         f"target has {target.vocab_size}: they must share one vocabulary")
    if max_model_len is not None and max_model_len > draft.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} is longer than the draft model's context "
                         f"({draft.max_position_embeddings} tokens)")


def check_draft_tokenizer(draft: Tokenizer, target: Tokenizer, model) -> None:
    """ValueError for the draft model `model` whose tokenizer `draft` splits text otherwise than the `target`'s."""
    probe = "Hello, world! 123 ünïcödé <|im_start|>"
    if draft.encode(probe) != target.encode(probe):
        raise ValueError(f"the draft model {str(model)!r} tokenizes text differently from the target: "
                         f"they must share one vocabulary")


def check_draft_shardable(draft: LlamaConfig, model, tp_size: int, group_size: int | None = None) -> None:
    """ValueError, naming the draft model `model`, when ``draft_tensor_parallel_size`` `tp_size` does not split its
    heads (or, given its int4 `group_size`, its groups)."""
    if tp_size > 1:
        try:
            check_shardable(draft, tp_size, "draft_tensor_parallel_size", group_size)
        except ValueError as e:
            raise ValueError(f"the draft model {str(model)!r}: {e}") from None


class DraftProposer(Proposer):
    def __init__(self, config, target_config, target_tokenizer, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, max_model_len: int | None = None,
                 tp: ParallelGroup | None = None, enable_prefix_caching: bool = True,
                 draft: OpenCheckpoint | None = None):
        """``draft``: the draft model ``config.model`` already opened (its config read, no weight); None opens it."""
        self.tree_top_k = config.tree_top_k
        self.tree_budget = config.tree_budget
        self.coupled = config.acceptance == "coupled"
        if draft is None:
            draft = open_checkpoint(config.model)
        check_draft_config(draft.config, target_config, config.model)
        # its tokenizer is compared with the target's before any of its weights is read
        checkpoint = draft.load(dtype, config.quantization,
                                check_tokenizer=lambda t: check_draft_tokenizer(t, target_tokenizer, config.model))
        if tp is not None:  # (the heads were checked from the config alone; the int4 groups need the tensors)
            check_draft_shardable(checkpoint.config, config.model, tp.size, int4_group_size(checkpoint.tensors))
        self.dtype = dtype
        self.max_len = max_model_len  # (the workers build their shards with the same RoPE table)
        self.model = Llama(checkpoint.config, checkpoint.tensors, device, dtype, max_len=max_model_len, tp=tp)
        del checkpoint
        c = self.model.config
        self.max_model_len = c.max_position_embeddings
        self.k = config.num_speculative_tokens
        self.max_tokens_per_step = self.k if self.tree_top_k == 1 else self.tree_budget
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.kv_cache = KVCache(c.num_hidden_layers, num_blocks, block_size, self.model.num_kv_heads, c.head_dim,
                                self.model.dtype, device)
        # eager: a draft forward runs on batches built on the device; on the workers too, when sharded
        self.runner = ModelRunner(self.model, self.kv_cache, max_num_seqs=1, max_query_len=1,
                                  max_model_len=self.max_model_len, enforce_eager=True)
        self.sharded = tp is not None and tp.size > 1  # then build_engine sends self.runner's calls to the workers too

    def start(self, seq: Sequence) -> None:
        seq.spec_state = DraftState()

    def rank(self, seqs: list[Sequence], depths: list[int]) -> list[list[tuple[float, int]]]:
        """Before any draft forward runs: node ``j`` (a chain's depth ``j``, a tree's ``j``-th node), ``alpha^j``."""
        return [chain_ranking(seq.spec_state.acceptance.alpha(), self.max_tokens_per_step) for seq in seqs]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        active = [i for i, k in enumerate(ks) if k > 0]
        if self.tree_top_k > 1:
            trees = iter(self._propose_trees([seqs[i] for i in active], [ks[i] for i in active]))
            return [next(trees) if k > 0 else Proposal() for k in ks]
        states: dict[int, DraftState] = {i: seqs[i].spec_state for i in active}
        for i in active:
            self._reserve(seqs[i], seqs[i].num_tokens + ks[i])
        feed = {i: seqs[i].token_ids[states[i].num_cached:] for i in active}
        starts = {i: states[i].num_cached for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        drawn: list[tuple[list[int], torch.Tensor]] = []  # per draft step: its rows and their guesses (on device)
        for j in range(max(ks, default=0)):
            rows = [i for i in active if ks[i] > j]
            batch = build_forward_batch([feed[i] for i in rows], [starts[i] for i in rows],
                                        [states[i].block_table for i in rows], self.block_size,
                                        [[len(feed[i]) - 1] for i in rows], self.model.device)
            if j > 0:  # each row feeds its previous guess, still on the device
                previous_rows, previous = drawn[-1]
                where = {i: r for r, i in enumerate(previous_rows)}
                batch.input_ids = previous[torch.tensor([where[i] for i in rows], device=previous.device)]
            logits, _ = self.runner.execute(batch)
            guesses, q = self._draw([seqs[i] for i in rows], logits, j)
            drawn.append((rows, guesses))
            for r, i in enumerate(rows):
                if q is not None and not seqs[i].params.greedy:
                    probs[i].append(q[r])
                starts[i] += len(feed[i])
                feed[i] = [0]  # a placeholder: the guess itself stays on the device
        tokens: list[list[int]] = [[] for _ in seqs]
        if drawn:  # the guesses come to the host once, after the last draft step
            host = torch.cat([guesses for _, guesses in drawn]).tolist()
            for rows, _ in drawn:
                for i, token in zip(rows, host):
                    tokens[i].append(token)
                host = host[len(rows):]
        for i in active:
            states[i].num_cached = seqs[i].num_tokens + ks[i] - 1
            states[i].num_reusable = ks[i] - 1  # d_1 .. d_{k-1} were fed, d_k was not
        return [Proposal.chain(t, torch.stack(probs[i]) if probs.get(i) else None) for i, t in enumerate(tokens)]

    def _propose_trees(self, seqs: list[Sequence], max_depths: list[int]) -> list[Proposal]:
        """A tree per sequence, at most ``max_depths[i]`` deep (> 0)."""
        if not seqs:
            return []
        states: list[DraftState] = [s.spec_state for s in seqs]
        # nodes per tree: the budget, or what the context (the shorter of max_len and the draft's) has left to feed
        context = min(self.max_len or self.max_model_len, self.max_model_len)
        budgets = [min(self.tree_budget, context - s.num_tokens - 1) for s in seqs]
        for seq, budget in zip(seqs, budgets):
            self._reserve(seq, seq.num_tokens + budget)
        feed = [seq.token_ids[st.num_cached:] for seq, st in zip(seqs, states)]  # backfill, ends with the root
        batch = build_forward_batch(feed, [st.num_cached for st in states], [st.block_table for st in states],
                                    self.block_size, [[len(f) - 1] for f in feed], self.model.device)
        logprobs = torch.log_softmax(self.runner.execute(batch)[0], dim=-1)
        for seq, st in zip(seqs, states):
            st.num_cached = seq.num_tokens  # the root's draft K/V now exists; tree nodes are scratch
            st.num_reusable = 0
        tokens: list[list[int]] = [[] for _ in seqs]
        parents: list[list[int]] = [[] for _ in seqs]
        # frontier per sequence: (node index or -1 for the root, cumulative log-prob, log-prob row)
        frontier = [[(-1, 0.0, logprobs[i])] for i in range(len(seqs))]
        for depth in range(1, self.k + 1):
            grown = []
            frontier = [nodes if depth <= max_depths[i] else [] for i, nodes in enumerate(frontier)]
            # the top tokens after every frontier node of every tree: one topk, one read for the level
            entries = [(i, node, score) for i in range(len(seqs)) for node, score, _ in frontier[i]]
            top = torch.topk(torch.stack([row for i in range(len(seqs)) for _, _, row in frontier[i]]), self.tree_top_k)
            host = torch.cat([top.values.double(), top.indices.double()], dim=1).tolist()
            children_of: dict[int, list] = {i: [] for i in range(len(seqs))}
            for (i, node, score), values in zip(entries, host):
                log_probs, ids = values[: self.tree_top_k], values[self.tree_top_k:]
                children_of[i] += [(score + lp, node, int(t)) for lp, t in zip(log_probs, ids)]
            for i in range(len(seqs)):
                if not frontier[i]:
                    continue
                children = sorted(children_of[i], key=lambda c: -c[0])
                frontier[i] = []
                for score, node, token in children[: budgets[i] - len(tokens[i])]:
                    tokens[i].append(token)
                    parents[i].append(node)
                    frontier[i].append((len(tokens[i]) - 1, score, None))
                if frontier[i] and depth < max_depths[i]:
                    grown.append(i)
            if depth == self.k or not grown:
                break
            # one draft forward over each grown tree so far; log-probs for its newest level
            batch = build_forward_batch(
                [tokens[i] for i in grown], [seqs[i].num_tokens for i in grown], [states[i].block_table for i in grown],
                self.block_size, [[n for n, _, _ in frontier[i]] for i in grown], self.model.device,
                positions=[[seqs[i].num_tokens + d for d in tree_depths(parents[i])] for i in grown],
                tree_masks=[tree_mask(parents[i]) for i in grown])
            rows = iter(torch.log_softmax(self.runner.execute(batch)[0], dim=-1))
            for i in grown:
                frontier[i] = [(n, score, next(rows)) for n, score, _ in frontier[i]]
        return [Proposal(t, p) for t, p in zip(tokens, parents)]

    def _reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Room for ``num_tokens`` of draft K/V; a sequence's first blocks come from the prefix cache."""
        st: DraftState = seq.spec_state
        if st.block_table:
            self.block_manager.reserve(st.block_table, num_tokens)
            return
        prefix = self.block_manager.cached_prefix(seq.token_ids)
        st.num_cached = self.block_manager.allocate(st.block_table, prefix, seq.num_tokens, num_tokens)

    def measure_cost(self) -> float:
        """Seconds of one single-token draft forward after 64 cached tokens (fewer where the context is shorter)."""
        model = self.model
        context = timing_context(self.block_manager, 1, len(model.cos_sin_cache))  # the positions its RoPE covers
        return time_forwards(lambda batch: self.runner.execute(batch)[0], self.block_manager, [(1, 1)],
                             device=model.device, batch_device=model.device, context=context)[0]

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Guess j for every sequence (on the device) and, when rejection-sampling, the draft's ``q`` ``[S, V]``."""
        depths = [[j]] * len(seqs)  # guess j is drawn at position num_tokens + j
        if self.coupled or all(s.params.greedy for s in seqs):
            return draw_tokens(logits, seqs, depths), None
        t = SamplingTensors.of(seqs, logits.device, depths=depths, seed_salt=DRAFT_SEED_SALT)
        q = t.probs(logits)
        return sample_from_probs(q, t.seeds, t.offsets), q

    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Learn from the step's outcome; drop the draft K/V of rejected guesses (a tree's whole: the next step
        backfills the accepted path). After ``retry_after`` steps without drafting the estimate returns to the prior;
        ``retry_after`` doubles (up to ``MAX_RETRY_AFTER``) after a drafted step with no guess accepted, else is 1."""
        st: DraftState = seq.spec_state
        if proposal.token_ids:
            st.acceptance.observe_trie(proposal, verdict)
            st.steps_undrafted = 0
            st.retry_after = 1 if verdict.num_accepted else min(2 * st.retry_after, MAX_RETRY_AFTER)
        else:
            st.steps_undrafted += 1
            if st.steps_undrafted >= st.retry_after:
                st.acceptance, st.steps_undrafted = AcceptanceEstimate(), 0
        keep = seq.num_tokens - len(verdict.emitted) + min(verdict.num_accepted, st.num_reusable)
        st.num_cached = min(st.num_cached, keep)
        self.block_manager.truncate(st.block_table, st.num_cached)
        self.block_manager.cache_full_blocks(st.block_table, seq.token_ids, st.num_cached)

    def preempt(self, seq: Sequence) -> None:
        st: DraftState = seq.spec_state
        self.block_manager.free(st.block_table)
        st.num_cached = 0

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
