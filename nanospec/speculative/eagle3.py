"""An EAGLE-3 head as a proposer: a chain or a tree guessed from three of the target's hidden states, with no extra
target pass.

:meth:`Eagle3Proposer.bind` makes the target's runner keep the residual stream entering the head's auxiliary layers
(``ModelRunner.aux_hidden``). After verification, on the device and before the step's one read, the head runs over
the rows the target ran for each sequence, at the same positions: row ``j`` feeds the fused states at ``j`` (a tree's
row at depth ``d``: those of the accepted path's node at depth ``d``) and the token at ``j + 1`` (a prompt token, else
the emitted one). Rows past the last accepted one write K/V that is written again before it is read. From its output
there it drafts a chain (``k - 1`` one-row steps) or EAGLE-2's tree (:mod:`nanospec.speculative.eagle3_tree`), ``k``
deep, or with the goodput policy one depth deeper than the step verified (at most ``k``). Guesses are argmaxes mapped
to target ids: one-hot, so the matched rule verifies them and output equals plain decoding's whatever the head's
weights. With ``prompt_lookup`` the n-gram chain joins them (:class:`~nanospec.speculative.ngram.LookupChain`).

The head runs for every speculating sequence at every step, also where none of its guesses was verified, so its K/V
stays whole: one layer in a pool of its own (twice the target's blocks, no prefix caching), a block table per
sequence from ``base`` (where the target's forward started when the head first ran for it) to the last committed
token but one. Where the scratch rows past the real ones do not fit for every sequence, the last in the batch draft
nothing that step. Under tensor parallelism the head runs on the driver alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.cache.kv_cache import KVCache
from nanospec.kernels.attention_mask import pack_mask
from nanospec.kernels.rope import build_rope_cache
from nanospec.model.attention import Attention
from nanospec.model.eagle3 import Eagle3Head
from nanospec.model.forward_batch import ForwardBatch, build_forward_batch
from nanospec.sequence import Sequence
from nanospec.speculative.cost import best_seconds
from nanospec.speculative.eagle3_tree import TreeShape, grow_tree
from nanospec.speculative.head import HeadProposer, HeadState
from nanospec.speculative.ngram import NgramProposer
from nanospec.speculative.policy import AcceptanceEstimate, accepted_depth
from nanospec.speculative.proposal import Proposal, Verdict

SHIPPED_FOR_EMBEDDED = Path(__file__).resolve().parents[1] / "speculators" / "smollm2-135m-instruct-eagle3"


@dataclass
class Eagle3State(HeadState):
    block_table: list[int] = field(default_factory=list)
    base: int | None = None   # the first position the head holds K/V for (None: none yet)
    num_cached: int = 0       # the head's K/V is exact for positions base .. num_cached - 1
    drafted: int = 0          # nodes the last step drafted for it (0: none, its scratch rows did not fit the pool)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # a chain's alpha


class Eagle3Proposer(HeadProposer):
    extra_forwards = 1  # the head's run over the step's rows (priced as a depth it ran slower)
    state_class = Eagle3State

    def __init__(self, head: Eagle3Head, aux_layers: tuple[int, ...], k: int, num_blocks: int, block_size: int,
                 max_model_len: int, tree_top_k: int = 1, tree_budget: int | None = None, adaptive: bool = True,
                 prompt_lookup: NgramProposer | None = None):
        """``adaptive``: the head drafts one depth deeper than the step verified of its guesses (at most ``k``), else
        ``k`` deep; ``prompt_lookup``: an n-gram proposer whose chain joins the guesses."""
        c = head.config.layer
        self.head, self.aux_layers, self.k, self.adaptive = head, aux_layers, k, adaptive
        self.prompt_lookup = prompt_lookup
        self.device, self.dtype = head.fc.weight.device, head.fc.weight.dtype
        self.tree = _tree_shape(k, tree_top_k, tree_budget, head.config.draft_vocab_size)
        self.max_tokens_per_step = (self.tree.num_nodes if self.tree else k) + (k if prompt_lookup else 0)
        self.scratch = self.tree.max_rows if self.tree else k  # head K/V rows past the last accepted one
        self.block_size, self.max_model_len = block_size, max_model_len
        self.block_manager = BlockManager(2 * num_blocks, block_size)
        self.kv_cache = KVCache(1, 2 * num_blocks, block_size, c.num_key_value_heads, c.head_dim, self.dtype,
                                self.device)
        rope = build_rope_cache(c.head_dim, max_model_len + self.max_tokens_per_step + 2 * k + 2, c.rope_theta,
                                c.rope_scaling, device=self.device)
        self.attention = Attention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, rope)
        self.embed = head.embed_tokens  # None: the target's, once bound
        self.runner = None

    def bind(self, runner) -> None:
        runner.aux_layers = self.aux_layers
        self.runner = runner
        if self.embed is None:  # the target's (under tensor parallelism: its rows gathered whole on the driver)
            self.embed = runner.model.embed if runner.model.tp is None else runner.whole_embedding()

    # ---------------------------------------------------------------- a sequence's life
    def commit(self, seq: Sequence, proposal: Proposal, verdict: Verdict) -> None:
        """Learn from the outcome; rank the guesses read_forward drafted behind the new last token; the head's K/V
        then covers every token but the last."""
        super().commit(seq, proposal, verdict)
        st: Eagle3State = seq.spec_state
        if st.base is not None:  # (None: the head has not run for it)
            st.num_cached = seq.num_tokens - 1
            self.block_manager.truncate(st.block_table, st.num_cached - st.base)

    def _observe(self, st: Eagle3State, verified: list[tuple[int, ...]], emitted: list[int]) -> None:
        if self.tree is not None:
            return super()._observe(st, verified, emitted)
        head = [p for p in verified if p in st.drafted_paths]
        if head:
            st.acceptance.observe(len(head), accepted_depth(head, emitted))

    def _drafted_chances(self, st: Eagle3State, ahead: list) -> dict[tuple[int, ...], float]:
        """The paths the head drafted this step, with their chances: a chain's depth ``d`` ``alpha^d``, a tree's
        calibrated."""
        if not st.drafted:
            return {}
        if self.tree is None:
            alpha, chain = st.acceptance.alpha(), [int(t) for t in ahead[0][:st.drafted]]
            return {tuple(chain[:d]): alpha ** d for d in range(1, len(chain) + 1)}
        return super()._drafted_chances(st, [row[:st.drafted] for row in ahead])

    def preempt(self, seq: Sequence) -> None:
        st: Eagle3State = seq.spec_state
        self.block_manager.free(st.block_table)
        st.base, st.num_cached = None, 0
        super().preempt(seq)

    # ---------------------------------------------------------------- the head's K/V, on the device
    def _hold_rows(self, st: Eagle3State, c: int, size: int) -> None:
        """Room in the head's pool for the ``size`` rows the target ran from position ``c``; its K/V starts again at
        ``c`` on its first run or after a step it missed."""
        if st.base is None or st.num_cached != c:
            self.block_manager.free(st.block_table)
            st.base = c
        self.block_manager.reserve(st.block_table, c + size - st.base)

    def read_chunks(self, seqs: list[Sequence], first_row: int) -> None:
        """The head over the rows of prompt chunks: row ``j`` feeds the fused states at ``j`` and the prompt token at
        ``j + 1``, so that its K/V covers the whole prompt when the sequence starts drafting."""
        tokens, starts, tables, positions, aux_rows = [], [], [], [], []
        row = first_row
        for seq in seqs:
            st: Eagle3State | None = seq.spec_state
            c, size = seq.num_cached_tokens, seq.num_new_tokens
            if st is not None:
                self._hold_rows(st, c, size)
                tokens.append(seq.token_ids[c + 1:c + size + 1])
                starts.append(c - st.base)
                tables.append(st.block_table)
                positions.append(list(range(c, c + size)))
                aux_rows += range(row, row + size)
                st.num_cached = c + size
            row += size
        if tokens:
            batch = build_forward_batch(tokens, starts, tables, self.block_size, [[] for _ in tokens], self.device,
                                        positions=positions)
            aux_rows = torch.tensor(aux_rows, device=self.device)
            self._run(batch, self.head.fuse(self.runner.aux_hidden[aux_rows].to(self.dtype)))

    # ---------------------------------------------------------------- drafting, on the device
    def read_forward(self, proposals: list[Proposal], logits: torch.Tensor, hidden: torch.Tensor | None,
                     verification) -> list[torch.Tensor]:
        seqs = verification.seqs
        num = self.tree.num_nodes if self.tree else self.k
        out = [torch.zeros(len(seqs), num, dtype=dtype, device=self.device)
               for dtype in ((torch.int64, torch.int64, torch.float32) if self.tree else (torch.int64,))]
        sizes = [s.num_tokens - s.num_cached_tokens + len(p.fed()[0]) for s, p in zip(seqs, proposals)]
        active = [b for b, s in enumerate(seqs) if s.spec_state is not None]
        if not active:
            return out
        width = verification.emitted.shape[1]
        tokens, starts, tables, positions, logits_rows, aux_rows, emitted_at, last_rows = [], [], [], [], [], [], [], []
        node_rows, node_at, node_roots = [], [], []  # each node row of the head's batch: its path entry, its root row
        row = head_row = 0  # where the sequence's rows start in the target's batch, and in the head's
        for b, seq in enumerate(seqs):
            if b in active:
                st: Eagle3State = seq.spec_state
                c, n, size = seq.num_cached_tokens, seq.num_tokens, sizes[b]
                self._hold_rows(st, c, size)
                prompt = seq.token_ids[c + 1:n]  # the next token of each row before the root
                tokens.append(prompt + [0] * (size - len(prompt)))
                emitted_at += [-1] * len(prompt) + [b * width + d for d in range(size - len(prompt))]
                starts.append(c - st.base)
                tables.append(st.block_table)
                positions.append(list(range(c, c + size)))
                logits_rows.append(range(len(prompt), size))
                aux_rows += range(row, row + size)
                root = head_row + len(prompt)
                last_rows.append(root)  # the root's row; the last accepted row is past it
                node_rows += range(root + 1, head_row + size)
                node_at += range(b * width, b * width + size - len(prompt) - 1)
                node_roots += [row + len(prompt)] * (size - len(prompt) - 1)
                head_row += size
            row += sizes[b]
        depth = self.draft_depth(seqs, proposals)
        num_drafted = replace(self.tree, depth=depth).num_nodes if self.tree is not None else depth
        drafting = []  # (indices into active) the sequences whose scratch rows fit, first come first served
        for i, b in enumerate(active):
            st = seqs[b].spec_state
            need = seqs[b].num_cached_tokens + sizes[b] + self.scratch - st.base
            st.drafted = num_drafted if self.block_manager.can_reserve(st.block_table, need) else 0
            if st.drafted:
                self.block_manager.reserve(st.block_table, need)
                drafting.append(i)
        batch = build_forward_batch(tokens, starts, tables, self.block_size, logits_rows, self.device,
                                    positions=positions)
        emitted_at = torch.tensor(emitted_at, device=self.device)
        from_emitted = verification.emitted.flatten()[emitted_at.clamp(min=0)].clamp(min=0)
        batch.input_ids = torch.where(emitted_at >= 0, from_emitted, batch.input_ids)
        aux_rows = torch.tensor(aux_rows, device=self.device)
        if node_rows:  # depth d's row reads the target's row of the accepted path's node at depth d (a tree's too)
            node = verification.path.flatten()[torch.tensor(node_at, device=self.device)]
            node_rows = torch.tensor(node_rows, device=self.device)
            aux_rows[node_rows] = torch.where(node >= 0, torch.tensor(node_roots, device=self.device) + node,
                                              aux_rows[node_rows])
        states = self._run(batch, self.head.fuse(self.runner.aux_hidden[aux_rows].to(self.dtype)))
        index = torch.tensor(active, device=self.device)
        accepted = (verification.path[index] >= 0).sum(dim=1)  # per active sequence, on the device
        state = states[torch.tensor(last_rows, device=self.device) + accepted]
        # the last accepted row's position, in the head's storage (its table starts at base)
        last = torch.tensor([seqs[b].num_tokens - 1 - seqs[b].spec_state.base for b in active],
                            device=self.device) + accepted
        offset = torch.tensor([seqs[b].spec_state.base for b in active], device=self.device)
        tables = batch.block_tables
        if len(drafting) < len(active):
            if not drafting:
                return out
            pick = torch.tensor(drafting, device=self.device)
            tables, last, offset, state, index = tables[pick], last[pick], offset[pick], state[pick], index[pick]
        for t, value in zip(out, self._draft(tables, last, offset, state, depth)):
            t[index, :value.shape[1]] = value.to(t.dtype)
        return out

    def _draft(self, tables: torch.Tensor, last: torch.Tensor, offset: torch.Tensor, state: torch.Tensor,
               depth: int) -> tuple[torch.Tensor, ...]:
        """From the head's output at each sequence's last accepted row (storage ``last``), ``depth`` deep: the chain
        ``(guesses,)``, or the tree ``(token_ids, parents, scores)``."""
        if self.tree is not None:
            def feed(input_ids, hidden, depths, ancestors):
                batch = self._tree_batch(tables, last, offset, input_ids, depths, ancestors)
                return self._run(batch, hidden.flatten(0, 1)).view(*input_ids.shape, -1)
            return grow_tree(self.head, state, replace(self.tree, depth=depth), feed)
        guesses = [self._guess(state)]
        for step in range(1, depth):
            state = self._run(self._step_batch(tables, last + step, offset, guesses[-1]), state)
            guesses.append(self._guess(state))
        return (torch.stack(guesses, dim=1),)

    def _tree_batch(self, tables: torch.Tensor, last: torch.Tensor, offset: torch.Tensor, input_ids: torch.Tensor,
                    depths: list[int], ancestors: torch.Tensor) -> ForwardBatch:
        """``n`` rows per sequence at storage ``last + 1 ..`` (scratch), RoPE position ``offset + last + depth``, each
        seeing the context up to ``last`` and its ancestors among the rows."""
        A, n = input_ids.shape
        storage = last[:, None] + 1 + torch.arange(n, device=self.device)
        blocks = tables.gather(1, storage // self.block_size).long()
        depth = torch.tensor(depths, device=self.device)
        return ForwardBatch(input_ids=input_ids.flatten(), positions=((offset + last)[:, None] + depth).flatten(),
                            slot_mapping=(blocks * self.block_size + storage % self.block_size).flatten(),
                            block_tables=tables, seq_lens=(last + 1 + n).to(torch.int32),
                            query_start_loc=torch.arange(0, A * n + 1, n, dtype=torch.int32, device=self.device),
                            max_query_len=n, logits_indices=torch.zeros(0, dtype=torch.int64, device=self.device),
                            tree_mask=pack_mask(ancestors.flatten(0, 1)))

    def _step_batch(self, tables: torch.Tensor, storage: torch.Tensor, offset: torch.Tensor,
                    input_ids: torch.Tensor) -> ForwardBatch:
        """One row per sequence at storage index ``storage`` (RoPE position ``offset + storage``)."""
        rows = torch.arange(len(storage), device=self.device)
        blocks = tables[rows, storage // self.block_size].long()
        return ForwardBatch(input_ids=input_ids, positions=offset + storage,
                            slot_mapping=blocks * self.block_size + storage % self.block_size, block_tables=tables,
                            seq_lens=(storage + 1).to(torch.int32),
                            query_start_loc=torch.arange(len(storage) + 1, dtype=torch.int32, device=self.device),
                            max_query_len=1, logits_indices=rows)

    def _run(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The head's layer over ``batch`` on its paged K/V: prenorm outputs ``[T, hidden]``."""
        plan = self.attention.plan(batch, self.block_size)
        embeds = self.embed(batch.input_ids).to(self.dtype)
        return self.head(embeds, hidden, lambda qkv: self.attention(qkv, self.kv_cache, 0, batch, plan))

    def _guess(self, state: torch.Tensor) -> torch.Tensor:
        return self.head.to_target(self.head.logits(state).argmax(dim=-1))

    def measure_cost(self) -> float:
        """Seconds of one draft depth at batch 1 after 64 positions (fewer where the pool or the context is smaller):
        one chain step, or a whole tree over its depth."""
        room = self.block_manager.num_free_blocks * self.block_size - 1 - self.scratch
        context = min(64, self.max_model_len - 1, room)
        if context < 0:  # no sequence's scratch rows ever fit: the head never drafts
            return 0.0
        table: list[int] = []
        self.block_manager.reserve(table, context + 1 + self.scratch)
        try:
            tables = torch.tensor([table], dtype=torch.int32, device=self.device)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            state = torch.zeros(1, self.head.config.layer.hidden_size, device=self.device, dtype=self.dtype)
            if self.tree is not None:
                def step():
                    return [t.tolist() for t in self._draft(tables, zero + context, zero, state, self.k)]
            else:
                batch = self._step_batch(tables, zero + context, zero, zero)

                def step():
                    return self._guess(self._run(batch, state)).tolist()
            step()
            return best_seconds(step, self.device) / (self.k if self.tree is not None else 1)
        finally:
            self.block_manager.free(table)


def _tree_shape(k: int, width: int, budget: int | None, draft_vocab_size: int) -> TreeShape | None:
    """The tree of ``tree_top_k`` > 1 (None: a chain), checked (ValueError naming the key)."""
    if width == 1:
        if budget is not None:
            raise ValueError(f"speculative_config['tree_budget'] = {budget} needs a tree: set 'tree_top_k' > 1 "
                             f"(method 'eagle3' with tree_top_k 1 drafts a chain of num_speculative_tokens)")
        return None
    if width > draft_vocab_size:
        raise ValueError(f"speculative_config['tree_top_k'] = {width} exceeds the head's draft_vocab_size "
                         f"({draft_vocab_size})")
    shape = TreeShape(width, k, budget if budget is not None else k * width)
    if shape.budget > shape.num_generated:
        raise ValueError(f"speculative_config['tree_budget'] = {budget} exceeds the nodes a tree of tree_top_k "
                         f"{width} and num_speculative_tokens {k} generates ({shape.num_generated} = w + (k - 1) w^2)")
    return shape
