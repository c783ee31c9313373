"""The verification step of speculative decoding, for a whole batch at once.

Sequence ``b`` fed its root (the last committed token) and candidates; the target forward produced
logits at the root and at every candidate. For a chain ``d_1..d_k`` the root's logits give ``p_1``,
``d_i``'s give ``p_{i+1}``:

* greedy (temperature 0): accept while ``d_i == argmax p_i``; emit ``argmax p_i`` at the first
  mismatch, or the bonus ``argmax p_{k+1}`` when every draft is accepted;
* sampling: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
  emit a token from ``norm(max(p_i - q_i, 0))``; after k acceptances emit the bonus from ``p_{k+1}``
  (``q`` one-hot at ``d_i`` for draft-free proposers). This leaves the output distributed exactly
  as ``p`` (Leviathan et al. 2023, Chen et al. 2023).

A token tree is walked from the root: greedy follows the target argmax; sampling tries a node's
children in turn (one-hot: accept with ``p(t)``, else zero ``t`` and renormalise) and draws from the
residual when all are rejected (SpecInfer's multi-candidate rule, still exactly ``p``).

Each kind is one kernel launch (``nanospec.kernels.rejection`` / ``tree_rejection``). Sequences that
do not speculate take the plain sampler. Uniforms are drawn at (request seed, position of the
token), so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from nanospec.engine import StepResult
from nanospec.kernels.rejection import greedy_verify, rejection_sample
from nanospec.kernels.sampling import probs_from_logits
from nanospec.kernels.tree_rejection import greedy_tree_verify, tree_rejection_sample


def verify(seqs, proposals, logits: torch.Tensor, speculating: list[bool], sample_fn) -> list[StepResult]:
    """One StepResult per sequence. ``logits`` rows: root, candidates, lookahead tokens, per sequence."""
    starts = [0]
    for p in proposals:
        starts.append(starts[-1] + 1 + p.num_fed)
    results: list[StepResult | None] = [None] * len(seqs)

    plain = [i for i, spec in enumerate(speculating) if not spec]
    if plain:
        rows = torch.tensor([starts[i] for i in plain], device=logits.device)
        for i, t in zip(plain, sample_fn([seqs[i] for i in plain], logits[rows])):
            results[i] = StepResult([t])

    for is_chain in (True, False):
        for greedy in (True, False):
            group = [i for i, spec in enumerate(speculating)
                     if spec and proposals[i].is_chain == is_chain and seqs[i].params.greedy == greedy]
            if group:
                run = _verify_chains if is_chain else _verify_trees
                for i, result in zip(group, run(seqs, proposals, logits, starts, group, greedy)):
                    results[i] = result

    for i, p in enumerate(proposals):
        if p.lookahead_tokens:
            first = starts[i] + 1 + len(p.token_ids)
            results[i].lookahead_argmax = logits[first:first + len(p.lookahead_tokens)].argmax(dim=-1).tolist()
    return results


def _target_probs(seqs, group, logits, rows: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width, V]`` processed target distributions at ``rows`` (``[B, width]`` row indices)."""
    device = logits.device
    params = [seqs[i].params for i in group]
    per_row = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device).repeat_interleave(width)  # noqa: E731
    probs = probs_from_logits(logits[rows.flatten()], per_row([p.temperature for p in params], torch.float32),
                              per_row([p.top_k for p in params], torch.int32),
                              per_row([p.top_p for p in params], torch.float32))
    return probs.view(len(group), width, -1)


def _seeds_offsets(seqs, group, device):
    seeds = torch.tensor([seqs[i].seed for i in group], dtype=torch.int64, device=device)
    offsets = torch.tensor([seqs[i].num_tokens for i in group], dtype=torch.int64, device=device)
    return seeds, offsets


def _verify_chains(seqs, proposals, logits, starts, group, greedy: bool) -> list[StepResult]:
    device = logits.device
    ks = [len(proposals[i].token_ids) for i in group]
    k_max = max(ks)
    B, V = len(group), logits.shape[-1]
    # row of (b, j) in `logits`; positions past k_b repeat the bonus row (ignored by the kernels)
    rows = torch.tensor([[starts[i] + min(j, k) for j in range(k_max + 1)] for i, k in zip(group, ks)], device=device)
    drafts = torch.tensor([proposals[i].token_ids + [0] * (k_max - k) for i, k in zip(group, ks)], dtype=torch.int64,
                          device=device).view(B, k_max)
    num_drafts = torch.tensor(ks, dtype=torch.int64, device=device)
    if greedy:
        out = greedy_verify(logits.argmax(dim=-1)[rows], drafts, num_drafts)
    else:
        draft_probs = None
        if any(proposals[i].draft_probs is not None for i in group):
            draft_probs = torch.zeros((B, k_max, V), dtype=torch.float32, device=device)
            for b, (i, k) in enumerate(zip(group, ks)):
                if k:
                    draft_probs[b, :k] = proposals[i].draft_probs
        seeds, offsets = _seeds_offsets(seqs, group, device)
        out = rejection_sample(_target_probs(seqs, group, logits, rows, k_max + 1), drafts, draft_probs,
                               num_draft_tokens=num_drafts, seeds=seeds, offsets=offsets)
    return [StepResult([t for t in row if t >= 0]) for row in out.tolist()]


def _verify_trees(seqs, proposals, logits, starts, group, greedy: bool) -> list[StepResult]:
    """Trees: node 0 is the root, node n > 0 is candidate n - 1 (one-hot candidates)."""
    device = logits.device
    sizes = [1 + len(proposals[i].token_ids) for i in group]
    n_max = max(sizes)
    rows = torch.tensor([[starts[i] + min(j, n - 1) for j in range(n_max)] for i, n in zip(group, sizes)],
                        device=device)
    node_tokens, parents = [], []
    for i, n in zip(group, sizes):
        p = proposals[i]
        tree_parents = p.parents if p.parents is not None else list(range(-1, n - 2))
        node_tokens.append([0] + p.token_ids + [0] * (n_max - n))
        parents.append([-1] + [q + 1 for q in tree_parents] + [0] * (n_max - n))
    node_tokens = torch.tensor(node_tokens, dtype=torch.int64, device=device)
    parents = torch.tensor(parents, dtype=torch.int64, device=device)
    num_nodes = torch.tensor(sizes, dtype=torch.int64, device=device)
    if greedy:
        path, emitted = greedy_tree_verify(logits.argmax(dim=-1)[rows], node_tokens, parents, num_nodes)
    else:
        seeds, offsets = _seeds_offsets(seqs, group, device)
        path, emitted = tree_rejection_sample(_target_probs(seqs, group, logits, rows, n_max), node_tokens, parents,
                                              num_nodes, None, seeds=seeds, offsets=offsets)
    return [StepResult([t for t in e if t >= 0], path=[n - 1 for n in pth if n >= 0])
            for pth, e in zip(path.tolist(), emitted.tolist())]
