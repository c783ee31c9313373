"""Lossless verification of a token tree drawn from a draft model, by rejection sampling (SpecInfer).

Row ``b`` holds a tree of ``num_nodes[b]`` nodes: node 0 the root, node ``i > 0`` under ``parents[b, i] < i`` with
token ``node_tokens[b, i]``; ``target_probs[b, i]`` is the target distribution after node ``i`` and
``draft_probs[b, c]`` the distribution q that child ``c`` was drawn from (one q for all children of a node).
Children are tried in increasing node index:

    cur = 0, p = norm(target_probs[b, 0]), c_0 = 0
    loop:
        for the j-th child c of cur:
            accept t_c with probability min(1, w(t_c) / q(t_c)),   w = norm(max(p - c_j q, 0)) (w = p for j = 0)
            on acceptance: emit t_c, cur = c, p = norm(target_probs[b, c]), continue the loop
            on rejection:  c_{j+1} = c_j + Z_j,  Z_j the mass of max(p - c_j q, 0)
        every child rejected (or none): emit a token drawn from w and stop

A residual without mass falls back to the node's target row. At depth ``d`` the j-th child tried is accepted iff
``uniform(seed, offset + d, V + j) * q(t) * W < w(t) * S_q`` (``W``: the residual's mass); the drawn token is the
exponential race at ``(seed, offset + d)``. Kernel and reference emit identical tokens: float64 sums rounded to
float32, divisions rounded to nearest, no fused multiply-add, ties to the lowest id. Outputs ``[B, N]`` int64, -1
padded: ``path_nodes`` (root excluded) and ``emitted`` (one more than the path).
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton
from nanospec.kernels.exponential_race import exponentials_ref, race
from nanospec.kernels.random import uniform, uniform_ref

_TINY = torch.finfo(torch.float32).tiny  # floor for a row sum, so an all-zero row gives no NaN


@triton.jit
def _row_sums(p_ptr, q_ptr, has_q, V, BLOCK_V: tl.constexpr):
    """(S_p, S_q) of one node, float64 sums rounded to float32 (floored at float32's tiny)."""
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        vocab = start + tl.arange(0, BLOCK_V)
        p_acc += tl.load(p_ptr + vocab, mask=vocab < V, other=0.0).to(tl.float32).to(tl.float64)
        q = tl.load(q_ptr + vocab, mask=vocab < tl.where(has_q, V, 0), other=0.0)  # a leaf has no q row
        q_acc += q.to(tl.float32).to(tl.float64)
    p_sum = tl.maximum(tl.sum(p_acc, axis=0).to(tl.float32), 1.1754943508222875e-38)
    return p_sum, tl.maximum(tl.sum(q_acc, axis=0).to(tl.float32), 1.1754943508222875e-38)


@triton.jit
def _residual_mass(p_ptr, q_ptr, p_sum, q_sum, coef, V, BLOCK_V: tl.constexpr):
    """Z = sum_v max(p_v / S_p - coef * q_v / S_q, 0): float64 sum rounded to float32."""
    acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        vocab = start + tl.arange(0, BLOCK_V)
        mask = vocab < V
        p = tl.load(p_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
        residual = tl.maximum(tl.math.div_rn(p, p_sum) - coef * tl.math.div_rn(q, q_sum), 0.0)
        acc += residual.to(tl.float64)
    return tl.sum(acc, axis=0).to(tl.float32)


@triton.jit
def _draw_token(p_ptr, q_ptr, p_sum, q_sum, coef, use_residual, seed, offset, V, BLOCK_V: tl.constexpr):
    """The exponential race over the residual ``norm(max(p - coef * q, 0))`` when ``use_residual`` and it has mass,
    else over p (ties to the lowest id)."""
    best_score = tl.full((), 0.0, tl.float32)
    best_token = tl.full((), 0, tl.int64)
    if use_residual:
        for start in range(0, V, BLOCK_V):
            vocab = start + tl.arange(0, BLOCK_V)
            p = tl.load(p_ptr + vocab, mask=vocab < V, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + vocab, mask=vocab < V, other=0.0).to(tl.float32)
            residual = tl.maximum(tl.math.div_rn(p, p_sum) - coef * tl.math.div_rn(q, q_sum), 0.0)
            exponential = (-tl.log(uniform(seed, offset, vocab).to(tl.float64))).to(tl.float32)
            score = tl.math.div_rn(residual, exponential)
            tile_best = tl.max(score, axis=0)  # a later tile wins only if strictly better: ties go to the lowest id
            best_token = tl.where(tile_best > best_score, start + tl.argmax(score, axis=0), best_token)
            best_score = tl.maximum(tile_best, best_score)
    if best_score == 0.0:
        best_token = race(p_ptr, seed, offset, V, BLOCK_V)
    return best_token


@triton.jit
def _tree_rejection_sample_kernel(target_probs_ptr, draft_probs_ptr, node_tokens_ptr, parents_ptr, num_nodes_ptr,
                                  seeds_ptr, offsets_ptr, path_nodes_ptr, emitted_ptr, N, V,
                                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    num_nodes = tl.load(num_nodes_ptr + row).to(tl.int32)
    seed = tl.load(seeds_ptr + row)
    offset = tl.load(offsets_ptr + row)
    nodes = tl.arange(0, BLOCK_N)
    in_tree = (nodes > 0) & (nodes < tl.minimum(num_nodes, N))
    parents = tl.load(parents_ptr + row * N + nodes, mask=in_tree, other=-1).to(tl.int32)
    tokens = tl.load(node_tokens_ptr + row * N + nodes, mask=in_tree, other=0).to(tl.int32)
    p_rows = target_probs_ptr + row * N * V
    q_rows = draft_probs_ptr + row * N * V

    path = tl.full([BLOCK_N], -1, tl.int64)
    emitted = tl.full([BLOCK_N], -1, tl.int64)
    cur = tl.full((), 0, tl.int32)
    depth = tl.full((), 0, tl.int32)
    moved = tl.full((), 1, tl.int1)
    # The state of the node being verified; after the walk, of the node where it stopped (for the draw).
    first_child = tl.full((), 0, tl.int32)
    p_sum = tl.full((), 1.0, tl.float32)
    q_sum = tl.full((), 1.0, tl.float32)
    coef = tl.full((), 0.0, tl.float32)  # the residual is max(p - coef * q, 0)
    num_tried = tl.full((), 0, tl.int32)
    while moved:
        is_child = parents == cur
        first_child = tl.min(tl.where(is_child, nodes, BLOCK_N), axis=0)
        p_ptr = p_rows + cur * V
        q_ptr = q_rows + tl.minimum(first_child, N - 1) * V
        p_sum, q_sum = _row_sums(p_ptr, q_ptr, first_child < BLOCK_N, V, BLOCK_V)

        # Try the children in order until one is accepted. mass = W, the current residual's mass.
        mass = p_sum
        coef = tl.full((), 0.0, tl.float32)
        num_tried = tl.full((), 0, tl.int32)
        child = first_child
        token = tl.full((), 0, tl.int32)
        accepted = tl.full((), 0, tl.int1)
        while (child < BLOCK_N) & (accepted == 0):
            token = tl.sum(tl.where(nodes == child, tokens, 0), axis=0)
            in_vocab = (token >= 0) & (token < V)  # a token outside the vocabulary has p = q = 0: rejected
            p_token = tl.load(p_ptr + token, mask=in_vocab, other=0.0).to(tl.float32)
            q_token = tl.load(q_ptr + token, mask=in_vocab, other=0.0).to(tl.float32)
            residual_token = tl.maximum(tl.math.div_rn(p_token, p_sum) - coef * tl.math.div_rn(q_token, q_sum), 0.0)
            weight = tl.where(num_tried == 0, p_token, residual_token)
            accepted = uniform(seed, offset + depth, V + num_tried) * q_token * mass < weight * q_sum
            if accepted == 0:
                coef = tl.where(num_tried == 0, 1.0, coef + mass)
                mass = _residual_mass(p_ptr, q_ptr, p_sum, q_sum, coef, V, BLOCK_V)
                num_tried += 1
                child = tl.min(tl.where(is_child & (nodes > child), nodes, BLOCK_N), axis=0)

        accepted_at = nodes == tl.where(accepted, depth, -1)
        path = tl.where(accepted_at, child.to(tl.int64), path)
        emitted = tl.where(accepted_at, token.to(tl.int64), emitted)
        cur = tl.where(accepted, child, cur)
        depth += accepted.to(tl.int32)
        moved = accepted

    # The recovered token (every child of cur rejected) or the bonus token (cur is a leaf), at depth.
    token = _draw_token(p_rows + cur * V, q_rows + tl.minimum(first_child, N - 1) * V, p_sum, q_sum, coef,
                        num_tried > 0, seed, offset + depth, V, BLOCK_V)
    emitted = tl.where(nodes == depth, token.to(tl.int64), emitted)
    tl.store(path_nodes_ptr + row * N + nodes, path, mask=nodes < N)
    tl.store(emitted_ptr + row * N + nodes, emitted, mask=nodes < N)


def tree_rejection_sample_ref(target_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                              num_nodes: torch.Tensor, draft_probs: torch.Tensor, *, seeds: torch.Tensor,
                              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's walk for every row at once: a loop over depth and over the j-th child, vectorised over rows."""
    batch, max_nodes, vocab_size = target_probs.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    nodes = torch.arange(max_nodes, device=device)
    seeds = seeds.to(device=device, dtype=torch.int64)
    offsets = offsets.to(device=device, dtype=torch.int64)
    p, q = target_probs.float(), draft_probs.float()

    in_tree = (nodes > 0) & (nodes < num_nodes.to(device)[:, None])
    parents = torch.where(in_tree, parents.to(device).long(), -1)
    tokens = torch.where(in_tree, node_tokens.to(device).long(), 0)

    def next_child(after: torch.Tensor) -> torch.Tensor:
        """The first child of cur with an index above ``after``, or max_nodes."""
        is_next = (parents == cur[:, None]) & (nodes > after[:, None])
        return torch.where(is_next, nodes, max_nodes).min(-1).values

    path = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    emitted = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    depth = torch.zeros(batch, dtype=torch.int64, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    # Per row, the state of the node being verified; after the walk, of the node where it stopped.
    first_child = torch.zeros(batch, dtype=torch.int64, device=device)
    p_sum = torch.ones(batch, device=device)
    q_sum = torch.ones(batch, device=device)
    coef = torch.zeros(batch, device=device)  # the residual is max(p - coef * q, 0)
    num_tried = torch.zeros(batch, dtype=torch.int64, device=device)
    for level in range(max_nodes):
        w = walking.nonzero()[:, 0]
        if w.numel() == 0:
            break
        first_child = torch.where(walking, next_child(torch.zeros_like(cur)), first_child)
        q_row = first_child.clamp(max=max_nodes - 1)
        p_sum[w] = p[w, cur[w]].sum(-1, dtype=torch.float64).float().clamp_min(_TINY)
        q_sum[w] = q[w, q_row[w]].sum(-1, dtype=torch.float64).float().clamp_min(_TINY)
        mass = p_sum.clone()
        coef = torch.where(walking, 0.0, coef)
        num_tried = torch.where(walking, 0, num_tried)
        accepted_child = torch.full((batch,), -1, dtype=torch.int64, device=device)
        child = first_child
        for j in range(max_nodes):
            trying = walking & (accepted_child < 0) & (child < max_nodes)
            if not trying.any():
                break
            child = child.clamp(max=max_nodes - 1)
            token = tokens[rows, child]
            in_vocab = (token >= 0) & (token < vocab_size)  # a token outside the vocabulary has p = q = 0
            safe_token = token.clamp(0, vocab_size - 1)
            p_token = torch.where(in_vocab, p[rows, cur, safe_token], 0.0)
            q_token = torch.where(in_vocab, q[rows, q_row, safe_token], 0.0)
            weight = p_token if j == 0 else (p_token / p_sum - coef * (q_token / q_sum)).clamp_min(0.0)
            accept = trying & (uniform_ref(seeds, offsets + level, vocab_size + j) * q_token * mass < weight * q_sum)
            rejected = trying & ~accept
            accepted_child = torch.where(accept, child, accepted_child)
            coef = torch.where(rejected, coef + mass if j > 0 else 1.0, coef)
            r = rejected.nonzero()[:, 0]  # a pass over the vocabulary, for the rows that rejected
            residual = p[r, cur[r]] / p_sum[r, None] - coef[r, None] * (q[r, q_row[r]] / q_sum[r, None])
            mass[r] = residual.clamp_min(0.0).sum(-1, dtype=torch.float64).float()
            num_tried += rejected.long()
            child = torch.where(rejected, next_child(child), max_nodes)

        moved = accepted_child >= 0
        path[:, level] = torch.where(moved, accepted_child, -1)
        emitted[:, level] = torch.where(moved, tokens[rows, accepted_child.clamp(min=0)], -1)
        cur = torch.where(moved, accepted_child, cur)
        depth += moved.long()
        walking = moved

    # One draw per row at the node where it stopped: the residual after rejections, the target at a leaf.
    exponential = exponentials_ref(seeds, offsets + depth, vocab_size)
    p_stop, q_stop = p[rows, cur], q[rows, first_child.clamp(max=max_nodes - 1)]
    token = (p_stop / exponential).argmax(-1)
    residual = (p_stop / p_sum[:, None] - coef[:, None] * (q_stop / q_sum[:, None])).clamp_min(0.0)
    residual_score = residual / exponential
    residual_token = residual_score.argmax(-1)
    has_mass = residual_score.gather(-1, residual_token[:, None])[:, 0] > 0
    emitted[rows, depth] = torch.where((num_tried > 0) & has_mass, residual_token, token)
    return path, emitted


def tree_rejection_sample_triton(target_probs: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                                 num_nodes: torch.Tensor, draft_probs: torch.Tensor, *, seeds: torch.Tensor,
                                 offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, max_nodes, vocab_size = target_probs.shape
    device = target_probs.device
    path = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    emitted = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    if batch == 0:
        return path, emitted
    block_v = min(triton.next_power_of_2(vocab_size), 2048)
    as_int64 = [t.to(device=device, dtype=torch.int64).contiguous() for t in (node_tokens, parents, num_nodes, seeds,
                                                                           offsets)]
    _tree_rejection_sample_kernel[(batch,)](
        target_probs.contiguous(), draft_probs.contiguous(), *as_int64, path, emitted, max_nodes, vocab_size,
        BLOCK_N=triton.next_power_of_2(max_nodes), BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        enable_fp_fusion=False)  # a * b - c must round twice, as in the reference
    return path, emitted


tree_rejection_sample = dispatch(tree_rejection_sample_triton, tree_rejection_sample_ref)
