"""Verification for a whole batch: what each sequence emits this step.

Every proposal is a token tree under the sequence's root (a chain is a tree). The target forward gave
logits at the root and at every node; the distribution after node ``c`` is ``p_c`` (the root's is
``p_0``). The tree is walked from the root:

* greedy (temperature 0): move to the child whose token is ``argmax p_cur``; when there is none, emit
  ``argmax p_cur`` and stop. For a chain ``d_1..d_k``: accept while ``d_i == argmax p_{i-1}``, then emit
  the target's token (the correction, or the bonus after all k).
* sampling: try the children of ``cur`` in turn, accepting ``t`` with probability
  ``min(1, p(t) / q(t))`` and replacing ``p`` by the residual ``norm(max(p - q, 0))`` after each
  rejection (``q`` one-hot at ``t`` for guesses that were not sampled: accept with ``p(t)``, then zero
  ``t`` and renormalise); move on at an acceptance, and when every child is rejected emit a token
  drawn from the residual (from ``p_cur`` itself at a leaf: the bonus token). The output is
  distributed exactly as ``p`` (Leviathan et al. 2023, Chen et al. 2023 for a chain; SpecInfer's
  multi-candidate rule for trees).

Each is one kernel launch for the batch (:mod:`nanospec.kernels.tree_rejection`). Sequences that do not
speculate take the plain sampler. Random numbers are drawn at (request seed, position of the token),
so a seeded request gives the same tokens whatever else is in the batch. Fed-only nodes (lookahead's
window) are not verified: their argmax goes back to the proposer.
"""

from __future__ import annotations

import torch

from nanospec.kernels.sampling import greedy, sample
from nanospec.kernels.tree_rejection import greedy_tree_verify, tree_rejection_sample
from nanospec.sequence import Sequence
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.sampling import SamplingTensors


def verify(seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
           speculating: list[bool]) -> list[Verdict]:
    """One verdict per sequence. ``logits`` rows: per sequence its root's, then one per node."""
    starts = [0]
    for p in proposals:
        starts.append(starts[-1] + 1 + len(p.token_ids))
    verdicts: list[Verdict | None] = [None] * len(seqs)

    plain = [i for i, spec in enumerate(speculating) if not spec]
    if plain:
        rows = torch.tensor([starts[i] for i in plain], device=logits.device)
        for i, token in zip(plain, sample_tokens([seqs[i] for i in plain], logits[rows])):
            verdicts[i] = Verdict([token])
    for is_greedy in (True, False):
        group = [i for i, spec in enumerate(speculating) if spec and seqs[i].params.greedy == is_greedy]
        if group:
            for i, verdict in zip(group, _walk_trees(seqs, proposals, logits, starts, group, is_greedy)):
                verdicts[i] = verdict

    for i, p in enumerate(proposals):
        if p.num_candidates < len(p.token_ids):
            first = starts[i] + 1 + p.num_candidates
            verdicts[i].extra_argmax = logits[first:starts[i + 1]].argmax(dim=-1).tolist()
    return verdicts


def sample_tokens(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Plain sampling: one token per row of ``logits`` (row r belongs to ``seqs[r]``, drawn at its length)."""
    if all(s.params.greedy for s in seqs):
        return greedy(logits).tolist()
    t = SamplingTensors.of(seqs, logits.device)
    return sample(logits, t.temperature, t.top_k, t.top_p, t.seeds, t.offsets).tolist()


def _walk_trees(seqs, proposals, logits, starts, group, is_greedy: bool) -> list[Verdict]:
    """Tree node 0 is the root, node n > 0 is the proposal's candidate n - 1."""
    device = logits.device
    sizes = [1 + proposals[i].num_candidates for i in group]
    n_max = max(sizes)
    rows = torch.tensor([[starts[i] + min(j, n - 1) for j in range(n_max)] for i, n in zip(group, sizes)],
                        device=device)
    node_tokens, parents = [], []
    for i, n in zip(group, sizes):
        p = proposals[i]
        node_tokens.append([0] + p.token_ids[: n - 1] + [0] * (n_max - n))
        parents.append([-1] + [q + 1 for q in p.parents[: n - 1]] + [0] * (n_max - n))
    node_tokens = torch.tensor(node_tokens, dtype=torch.int64, device=device)
    parents = torch.tensor(parents, dtype=torch.int64, device=device)
    num_nodes = torch.tensor(sizes, dtype=torch.int64, device=device)
    if is_greedy:
        path, emitted = greedy_tree_verify(logits.argmax(dim=-1)[rows], node_tokens, parents, num_nodes)
    else:
        draft_probs = None
        if any(proposals[i].draft_probs is not None for i in group):
            draft_probs = torch.zeros((len(group), n_max, logits.shape[-1]), dtype=torch.float32, device=device)
            for b, (i, n) in enumerate(zip(group, sizes)):
                if proposals[i].draft_probs is not None and n > 1:
                    draft_probs[b, 1:n] = proposals[i].draft_probs
        t = SamplingTensors.of([seqs[i] for i in group], device, repeat=n_max)
        probs = t.probs(logits[rows.flatten()]).view(len(group), n_max, -1)
        path, emitted = tree_rejection_sample(probs, node_tokens, parents, num_nodes, draft_probs,
                                              seeds=t.seeds, offsets=t.offsets)
    return [Verdict([t for t in e if t >= 0], path=[n - 1 for n in pth if n >= 0])
            for pth, e in zip(path.tolist(), emitted.tolist())]
