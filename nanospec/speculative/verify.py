"""Verification for a whole batch: what each sequence emits this step.

Every proposal is a token tree under the sequence's root (a chain is a tree; no proposal is a tree of one
node). The target forward gave logits at the root and at every node; ``p_c`` is the target's distribution
after node ``c`` (temperature, top-k, top-p applied), at position ``num_tokens + depth(c)``.

**Matched verification** (guesses made without sampling: n-gram, lookahead, draft trees, a coupled draft).
At every node the target draws its own token exactly as plain sampling would at that position: the
exponential race ``s_c = argmax_v p_c(v) / E_v`` with ``E_v = -log(uniform(seed, position, v))`` (the
argmax when greedy). The walk starts at the root and moves to the child whose token is ``s_cur``; when no
child matches it emits ``s_cur`` and stops. Every emitted token is the token plain seeded sampling draws
at its position, whatever was guessed, so the output is exactly plain decoding's, for any k, tree or batch.
A guess ``d`` is accepted with probability ``p(d)``, and a node's children together with their mass: what
rejection sampling with one-hot guesses gives.

**Rejection sampling** (a draft model that sampled its guesses from ``q``): try the children of ``cur`` in
turn, accepting ``t`` with probability ``min(1, p(t) / q(t))`` and replacing ``p`` by the residual
``norm(max(p - q, 0))`` after each rejection; at an acceptance move on; when every child is rejected, emit
a token drawn from the residual (from ``p_cur`` itself at a leaf: the bonus token). Each emitted token is
distributed exactly as ``p`` (Leviathan et al. 2023, Chen et al. 2023; SpecInfer for trees), with higher
acceptance than matching, but the tokens depend on the guesses (:mod:`nanospec.kernels.tree_rejection`).

``min_tokens``: a row whose token would be output token number ``< min_tokens`` cannot end the request,
so its stop tokens get probability 0 before anything is drawn, row by row (speculation stays lossless).
Penalties (repetition, frequency, presence) likewise: each row counts the output up to its own node
(:mod:`nanospec.speculative.penalties`).

Log-probabilities (``SamplingParams.logprobs``): the emitted token at depth ``d`` was drawn from the row of
the path's node at depth ``d - 1`` (the root's for ``d = 0``); its log-probability and the row's top ones
are gathered from ``log_softmax`` of the raw logits (before the bans and penalties) on the device, after
the walk, and come back in the same read, so speculation reports the target's numbers as plain decoding does.

The step's metadata goes to the device in one copy; one launch draws every node's token, one walks every
tree, one more rejection-samples the draft rows, and everything comes back to the host in one read, with
what a proposer computed on the device from the outcome (the MLP speculator's next guesses, ``after_walk``).
Fed-only nodes (lookahead's window) are not verified: their argmax goes back to the proposer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanospec.kernels.tree_rejection import greedy_tree_verify, tree_rejection_sample
from nanospec.outputs import TokenLogprob
from nanospec.sequence import Sequence
from nanospec.speculative.penalties import apply_penalties
from nanospec.speculative.proposal import Proposal, Verdict
from nanospec.speculative.sampling import SamplingTensors


def verify(seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
           to_device: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
           after_walk: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]] | None = None) -> list[Verdict]:
    """One verdict per sequence. ``logits`` rows: per sequence its root's, then one per node (modified in place:
    stop tokens banned before ``min_tokens``, penalties applied). ``to_device`` moves host integer tensors to the
    logits' device (the runner's: one copy for them all); by default one ``.to`` each.

    ``after_walk(rows, last_tokens)``, called on the device once the outcome is known and before the read: per
    sequence the logits row that drew its last emitted token (the root's when no guess was accepted, else the
    last accepted node's) and that token, both ``[B]``; it returns tensors ``[B, ...]`` that are read
    with the verdicts, each sequence's rows landing in ``verdict.ahead`` (a proposer's next guesses)."""
    device = logits.device
    if to_device is None:
        to_device = lambda tensors: [t.to(device) for t in tensors]  # noqa: E731
    starts = [0]
    for p in proposals:
        starts.append(starts[-1] + 1 + len(p.token_ids))
    sizes = [1 + p.num_candidates for p in proposals]  # the root and the candidates
    depths = [[0] + p.depths[: p.num_candidates] for p in proposals]
    flat_rows = [start + j for start, n in zip(starts, sizes) for j in range(n)]
    n_max = max(sizes)
    first = [sum(sizes[:b]) for b in range(len(seqs))]  # where each sequence's rows start in flat_rows
    extra_rows = [r for p, start, end in zip(proposals, starts, starts[1:])
                  for r in range(start + 1 + p.num_candidates, end)]

    # the step's metadata, built on the host and moved in one copy: the rows of the roots and candidates, each
    # tree's nodes (padded to the largest), and the rows of fed-only nodes
    flat_rows_t, pad, node_tokens, parents, num_nodes, extra_rows_t = to_device([
        torch.tensor(flat_rows, dtype=torch.int64),
        torch.tensor([[f + min(j, n - 1) for j in range(n_max)] for f, n in zip(first, sizes)], dtype=torch.int64),
        torch.tensor([[0] + p.token_ids[: p.num_candidates] + [0] * (n_max - n) for p, n in zip(proposals, sizes)],
                     dtype=torch.int64),
        torch.tensor([[-1] + [q + 1 for q in p.parents[: p.num_candidates]] + [0] * (n_max - n)
                      for p, n in zip(proposals, sizes)], dtype=torch.int64),
        torch.tensor(sizes, dtype=torch.int64),
        torch.tensor(extra_rows, dtype=torch.int64)])

    num_top = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    if num_top is not None:  # raw: before the bans and penalties below
        raw_logprobs = torch.log_softmax(logits[flat_rows_t].float(), dim=-1)
    _ban_stop_tokens_before_min_tokens(logits, seqs, depths, flat_rows, sizes)
    apply_penalties(logits, seqs, proposals, [flat_rows[f: f + n] for f, n in zip(first, sizes)])

    # the target's own token at the root and at every candidate: plain sampling at that node's position
    target_logits = logits[flat_rows_t]
    if all(s.params.greedy for s in seqs):
        target_tokens = target_logits.argmax(dim=-1)
    else:
        target_tokens = SamplingTensors.of(seqs, device, depths=depths).sample(target_logits)
    path, emitted = greedy_tree_verify(target_tokens[pad], node_tokens, parents, num_nodes)

    sampled = [b for b, p in enumerate(proposals) if p.draft_probs is not None]
    if sampled:
        _rejection_sample(seqs, proposals, logits, starts, sizes, sampled, node_tokens, parents, num_nodes,
                          path, emitted)

    extra = logits[extra_rows_t].argmax(dim=-1) if extra_rows else extra_rows_t  # fed-only nodes' argmax
    to_read = [path.flatten(), emitted.flatten(), extra]
    ahead = after_walk(*_last_emitted(flat_rows_t, pad, path, emitted)) if after_walk is not None else []
    to_read += [t.flatten() for t in ahead]  # [B, ...] each: a row per sequence
    ahead_widths = [t.numel() // len(seqs) for t in ahead]
    if num_top is not None:
        to_read += _emitted_logprobs(raw_logprobs, pad, path, emitted, num_top)
    paths, emits, extras, *values = _read_once(to_read)  # the step's one device read
    ahead_values, logprob_lists = values[:len(ahead)], values[len(ahead):]
    verdicts = []
    for b, p in enumerate(proposals):
        row = slice(b * n_max, (b + 1) * n_max)
        verdict = Verdict([t for t in emits[row] if t >= 0], [n - 1 for n in paths[row] if n >= 0])
        k = seqs[b].params.logprobs
        if k is not None:
            logprob, top_values, top_ids = logprob_lists
            slots = range(b * n_max, b * n_max + len(verdict.emitted))
            verdict.logprobs = [TokenLogprob(emits[i], logprob[i], list(zip(top_ids[i * num_top: i * num_top + k],
                                                                             top_values[i * num_top: i * num_top + k])))
                                for i in slots]
        if p.num_candidates < len(p.token_ids):
            count = len(p.token_ids) - p.num_candidates
            verdict.extra_argmax, extras = extras[:count], extras[count:]
        if ahead:
            verdict.ahead = [v[b * w:(b + 1) * w] for v, w in zip(ahead_values, ahead_widths)]
        verdicts.append(verdict)
    return verdicts


def _last_emitted(flat_rows, pad, path, emitted) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, per sequence: the logits row its last emitted token was drawn from (the deepest accepted
    node's, or the root's: nodes are numbered parents first, so the path's largest is its deepest), and that
    token (the last of ``emitted``, whose unused slots are -1)."""
    node = path.max(dim=1, keepdim=True).values.clamp(min=0)
    rows = flat_rows[pad.gather(1, node).squeeze(1)]
    last = emitted.gather(1, ((emitted >= 0).sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    return rows, last


def _emitted_logprobs(raw_logprobs, pad, path, emitted, num_top) -> list[torch.Tensor]:
    """On the device, for every (sequence, depth) slot of ``emitted`` ([B, N]): the log-probability of the
    emitted token in the row it was drawn from, and that row's ``num_top`` largest (values, token ids)."""
    drawn_at = torch.cat([torch.zeros_like(path[:, :1]), path[:, :-1]], dim=1).clamp(min=0)  # the root, then the path
    row = pad.gather(1, drawn_at).flatten()  # into raw_logprobs
    logprob = raw_logprobs[row, emitted.clamp(min=0).flatten()]
    top = raw_logprobs.topk(num_top, dim=-1)
    return [logprob, top.values[row].flatten(), top.indices[row].flatten()]


def _read_once(tensors: list[torch.Tensor]) -> list[list]:
    """Every tensor's values on the host, in one device read (through float64 when some are floating point:
    token ids, far below 2**53, stay exact)."""
    floating = any(t.is_floating_point() for t in tensors)
    flat = torch.cat([t.double() for t in tensors] if floating else tensors).tolist()
    values, start = [], 0
    for t in tensors:
        chunk, start = flat[start: start + t.numel()], start + t.numel()
        values.append(chunk if t.is_floating_point() else [int(x) for x in chunk])
    return values


def _rejection_sample(seqs, proposals, logits, starts, sizes, sampled, node_tokens, parents, num_nodes, path,
                      emitted) -> None:
    """Overwrite the walks of the ``sampled`` rows (guesses drawn from a draft's ``q``) with rejection sampling."""
    device = logits.device
    n_max = max(sizes[b] for b in sampled)
    rows = torch.tensor([[starts[b] + min(j, sizes[b] - 1) for j in range(n_max)] for b in sampled], device=device)
    t = SamplingTensors.of([seqs[b] for b in sampled], device, depths=[[0] * n_max] * len(sampled))
    probs = t.probs(logits[rows.flatten()]).view(len(sampled), n_max, -1)
    draft_probs = torch.zeros_like(probs)
    for i, b in enumerate(sampled):
        draft_probs[i, 1:sizes[b]] = proposals[b].draft_probs
    index = torch.tensor(sampled, device=device)
    sampled_path, sampled_emitted = tree_rejection_sample(
        probs, node_tokens[index, :n_max], parents[index, :n_max], num_nodes[index], draft_probs,
        seeds=t.seeds.view(len(sampled), n_max)[:, 0], offsets=t.offsets.view(len(sampled), n_max)[:, 0])
    path[index] = -1
    emitted[index] = -1
    path[index, :n_max] = sampled_path
    emitted[index, :n_max] = sampled_emitted


def _ban_stop_tokens_before_min_tokens(logits, seqs, depths, flat_rows, sizes) -> None:
    """Rows whose token would be output token number < min_tokens: their stop tokens get -inf."""
    rows, cols = [], []
    row_iter = iter(flat_rows)
    for seq, node_depths, n in zip(seqs, depths, sizes):
        seq_rows = [next(row_iter) for _ in range(n)]
        missing = seq.params.min_tokens - seq.num_output_tokens
        if missing <= 0 or not seq.stop_token_ids:
            continue
        for row, depth in zip(seq_rows, node_depths):
            if depth < missing:
                rows += [row] * len(seq.stop_token_ids)
                cols += seq.stop_token_ids
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
