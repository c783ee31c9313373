"""Verification for a whole batch: what each sequence emits this step.

``p_c`` is the target's distribution after tree node ``c``, at position ``num_tokens + depth(c)``, each row
processed as plain decoding would (:mod:`nanospec.sampling`: ``min_tokens`` ban and penalties over the path).

**Matched** (guesses made without sampling): at every node the target draws its own token as plain sampling would,
``s_c = argmax_v p_c(v) / E_v``, ``E_v = -log(uniform(seed, position, v))`` (argmax when greedy). From the root,
move to the child whose token is ``s_cur``; when none matches, emit ``s_cur`` and stop. Every emitted token is plain
seeded sampling's, for any k, tree or batch.

**Rejection sampling** (a draft that sampled from ``q``): accept child ``t`` with probability ``min(1, p(t) / q(t))``,
replace ``p`` by ``norm(max(p - q, 0))`` after a rejection, emit a draw from the residual when every child fails
(Leviathan et al. 2023; SpecInfer for trees; :mod:`nanospec.kernels.tree_rejection`).
:func:`verify` returns device tensors; the Speculator reads them in the step's one device read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from nanospec.kernels.tree_rejection import tree_rejection_sample
from nanospec.kernels.tree_verify import greedy_tree_verify
from nanospec.sampling.logprobs import gather_logprobs, token_logprobs
from nanospec.sampling.penalties import (add_logit_bias, apply_penalties, ban_bad_words,
                                         ban_stop_tokens_before_min_tokens, keep_allowed_tokens)
from nanospec.sampling.tensors import SamplingTensors, draw_tokens
from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict


@dataclass
class Verification:
    """A step's outcome on the device: ``path`` / ``emitted`` ``[B, N]`` (-1 padded); ``pad[b, j]`` indexes ``rows``
    (the logits rows) for sequence ``b``'s root (j = 0) or node ``j``; ``first_rows[b]``: its root's logits row."""
    seqs: list[Sequence]
    path: torch.Tensor
    emitted: torch.Tensor
    rows: torch.Tensor
    pad: torch.Tensor
    first_rows: list[int]
    logprobs: list[torch.Tensor]  # gather_logprobs of every emitted token, when a request asks ([] otherwise)
    num_top: int | None

    def last_emitted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, on the device: the logits row its last emitted token was drawn from, and that token."""
        node = self.path.max(dim=1, keepdim=True).values.clamp(min=0)
        rows = self.rows[self.pad.gather(1, node).squeeze(1)]
        emitted = self.emitted
        last = emitted.gather(1, ((emitted >= 0).sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
        return rows, last

    def read(self, ahead: list[torch.Tensor] = ()) -> list[Verdict]:
        """The verdicts, in one device read with ``ahead`` (device tensors ``[B, ...]`` computed from this outcome,
        row ``b`` landing in verdict ``b``'s ``ahead``)."""
        num_seqs, width = self.path.shape
        paths, emits, *values = read_once([self.path.flatten(), self.emitted.flatten(), *(t.flatten() for t in ahead),
                                           *self.logprobs])
        ahead_values, logprob_values = values[:len(ahead)], values[len(ahead):]
        verdicts = []
        for b, seq in enumerate(self.seqs):
            row = slice(b * width, (b + 1) * width)
            verdict = Verdict([t for t in emits[row] if t >= 0], [n - 1 for n in paths[row] if n >= 0])
            if ahead:
                verdict.ahead = [v[b * (t.numel() // num_seqs):(b + 1) * (t.numel() // num_seqs)]
                                 for v, t in zip(ahead_values, ahead)]
            k = seq.params.logprobs
            if k is not None:
                slots = range(b * width, b * width + len(verdict.emitted))
                verdict.logprobs = token_logprobs(emits, slots, logprob_values, self.num_top, k)
            verdicts.append(verdict)
        return verdicts


def verify(seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
           to_device: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> Verification:
    """Each sequence's outcome, on the device. ``logits``: per sequence its root's row, then one per fed node (the bans
    and penalties are applied in place). ``to_device`` moves host tensors in one copy."""
    device = logits.device
    first_rows = list(accumulate((1 + len(p.fed()[0]) for p in proposals), initial=0))
    sizes = [1 + len(p.token_ids) for p in proposals]  # the root and the tree's nodes
    paths = [[[]] + p.paths() for p in proposals]  # the guessed tokens above each row
    depths = [[len(path) for path in seq_paths] for seq_paths in paths]
    seq_rows = [list(range(start, start + n)) for start, n in zip(first_rows, sizes)]
    n_max = max(sizes)
    first = [sum(sizes[:b]) for b in range(len(seqs))]  # where each sequence's rows start in rows_t

    # built on the host and moved in one copy: the rows of the roots and nodes, and each tree's nodes (padded)
    host = [torch.tensor([r for rows in seq_rows for r in rows], dtype=torch.int64),
            torch.tensor([[f + min(j, n - 1) for j in range(n_max)] for f, n in zip(first, sizes)], dtype=torch.int64),
            torch.tensor([[0] + p.token_ids + [0] * (n_max - n) for p, n in zip(proposals, sizes)], dtype=torch.int64),
            torch.tensor([[-1] + [q + 1 for q in p.parents] + [0] * (n_max - n) for p, n in zip(proposals, sizes)],
                         dtype=torch.int64),
            torch.tensor(sizes, dtype=torch.int64)]
    rows_t, pad, node_tokens, parents, num_nodes = to_device(host) if to_device else [t.to(device) for t in host]

    num_top = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    # log-probabilities from the raw logits, before the bans, biases and penalties
    raw = torch.log_softmax(logits[rows_t].float(), dim=-1) if num_top is not None else None
    keep_allowed_tokens(logits, seqs, seq_rows)
    ban_bad_words(logits, seqs, seq_rows, paths)
    ban_stop_tokens_before_min_tokens(logits, seqs, seq_rows, depths)
    add_logit_bias(logits, seqs, seq_rows)
    apply_penalties(logits, seqs, seq_rows, paths)

    # the target's own token at the root and at every node: plain sampling at that node's position
    target_tokens = draw_tokens(logits[rows_t], seqs, depths)
    path, emitted = greedy_tree_verify(target_tokens[pad], node_tokens, parents, num_nodes)

    sampled = [b for b, p in enumerate(proposals) if p.draft_probs is not None]
    if sampled:  # their walks by rejection sampling instead
        n, index = max(sizes[b] for b in sampled), torch.tensor(sampled, device=device)
        t = SamplingTensors.of([seqs[b] for b in sampled], device, depths=[[0] * n] * len(sampled))
        probs = t.probs(logits[rows_t[pad[index, :n]].flatten()]).view(len(sampled), n, -1)
        draft_probs = torch.zeros_like(probs)
        for i, b in enumerate(sampled):
            draft_probs[i, 1:sizes[b]] = proposals[b].draft_probs
        path[index], emitted[index] = -1, -1
        path[index, :n], emitted[index, :n] = tree_rejection_sample(
            probs, node_tokens[index, :n], parents[index, :n], num_nodes[index], draft_probs,
            seeds=t.seeds.view(len(sampled), n)[:, 0], offsets=t.offsets.view(len(sampled), n)[:, 0])
    logprobs = []
    if raw is not None:  # the token at depth d was drawn from the row of the path's node at depth d - 1
        drawn_at = torch.cat([torch.zeros_like(path[:, :1]), path[:, :-1]], dim=1).clamp(min=0)
        logprobs = gather_logprobs(raw, pad.gather(1, drawn_at).flatten(), emitted.clamp(min=0).flatten(), num_top)
    return Verification(seqs, path, emitted, rows_t, pad, first_rows[:-1], logprobs, num_top)


def read_once(tensors: list[torch.Tensor]) -> list[list]:
    """Every tensor's values on the host in one device read (through float64 when some are floating point)."""
    floating = any(t.is_floating_point() for t in tensors)
    flat = torch.cat([t.double() for t in tensors] if floating else tensors).tolist()
    values, start = [], 0
    for t in tensors:
        chunk, start = flat[start: start + t.numel()], start + t.numel()
        values.append(chunk if t.is_floating_point() else [int(x) for x in chunk])
    return values
