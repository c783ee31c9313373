"""The verification step of speculative decoding, for a whole batch at once.

Sequence ``b`` proposed drafts ``d_1..d_k`` (k may be 0) and the target forward produced logits at
its last ``k+1`` rows: ``p_1..p_k`` judge the drafts, ``p_{k+1}`` gives the bonus token. Per row:

* greedy (temperature 0): accept while ``d_i == argmax p_i``; emit ``argmax p_i`` at the first
  mismatch, or the bonus ``argmax p_{k+1}`` when every draft is accepted;
* sampling: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
  emit a token from ``norm(max(p_i - q_i, 0))``; after k acceptances emit the bonus from ``p_{k+1}``
  (``q`` one-hot at ``d_i`` for draft-free proposers). This leaves the output distributed exactly
  as ``p`` (Leviathan et al. 2023, Chen et al. 2023).

Both run as one kernel launch each (``nanospec.kernels.rejection``). Sequences that do not
speculate take the plain sampler. Uniforms are drawn at (request seed, position of the token), so
a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from nanospec.kernels.rejection import greedy_verify, rejection_sample
from nanospec.kernels.sampling import probs_from_logits


def verify(seqs, proposals, logits: torch.Tensor, ks: list[int], speculating: list[bool], sample_fn) -> list[list[int]]:
    """Emitted tokens per sequence. ``logits`` rows: ``ks[i] + 1`` consecutive rows per sequence."""
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k + 1)
    emitted: list[list[int] | None] = [None] * len(seqs)

    plain = [i for i, spec in enumerate(speculating) if not spec]
    if plain:
        rows = torch.tensor([starts[i] for i in plain], device=logits.device)
        for i, t in zip(plain, sample_fn([seqs[i] for i in plain], logits[rows])):
            emitted[i] = [t]

    for greedy_group in (True, False):
        group = [i for i, spec in enumerate(speculating) if spec and seqs[i].params.greedy == greedy_group]
        if group:
            for i, tokens in zip(group, _verify_group(seqs, proposals, logits, ks, starts, group, greedy_group)):
                emitted[i] = tokens
    return emitted


def _verify_group(seqs, proposals, logits, ks, starts, group, greedy_group: bool) -> list[list[int]]:
    device = logits.device
    k_max = max(ks[i] for i in group)
    B, V = len(group), logits.shape[-1]
    # row index of (b, j) in `logits`; positions past k_b repeat the bonus row (ignored by the kernels)
    row_index = torch.tensor([[starts[i] + min(j, ks[i]) for j in range(k_max + 1)] for i in group], device=device)
    drafts = torch.tensor([proposals[i].token_ids + [0] * (k_max - ks[i]) for i in group], dtype=torch.int64,
                          device=device).view(B, k_max)
    num_drafts = torch.tensor([ks[i] for i in group], dtype=torch.int64, device=device)
    if greedy_group:
        target_argmax = logits.argmax(dim=-1)[row_index]
        out = greedy_verify(target_argmax, drafts, num_drafts)
    else:
        params = [seqs[i].params for i in group]
        per_row = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device).repeat_interleave(k_max + 1)  # noqa: E731
        probs = probs_from_logits(logits[row_index.flatten()],
                                  per_row([p.temperature for p in params], torch.float32),
                                  per_row([p.top_k for p in params], torch.int32),
                                  per_row([p.top_p for p in params], torch.float32)).view(B, k_max + 1, V)
        draft_probs = None
        if any(proposals[i].draft_probs is not None for i in group):
            draft_probs = torch.zeros((B, k_max, V), dtype=torch.float32, device=device)
            for b, i in enumerate(group):
                if ks[i]:
                    draft_probs[b, : ks[i]] = proposals[i].draft_probs
        seeds = torch.tensor([seqs[i].seed for i in group], dtype=torch.int64, device=device)
        offsets = torch.tensor([seqs[i].num_tokens for i in group], dtype=torch.int64, device=device)
        out = rejection_sample(probs, drafts, draft_probs, num_draft_tokens=num_drafts, seeds=seeds, offsets=offsets)
    return [[t for t in row if t >= 0] for row in out.tolist()]
