"""Matched verification of a token tree: follow the target's own tokens down each row's tree.

Row ``b``: a tree of ``num_nodes[b]`` nodes (node ``i > 0`` under ``parents[b, i] < i``, token ``node_tokens[b, i]``)
and ``target[b, i]``, the token the target draws after node ``i``. From the root, move to the first child whose token
is ``target[cur]``; when none, emit ``target[cur]`` and stop. Outputs ``[B, N]`` int64, -1 padded: ``path_nodes``
(root excluded) and ``emitted`` (one more than the path).
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton


@triton.jit
def _greedy_tree_verify_kernel(target_argmax_ptr, node_tokens_ptr, parents_ptr, num_nodes_ptr, path_nodes_ptr,
                               emitted_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    num_nodes = tl.load(num_nodes_ptr + row).to(tl.int32)
    nodes = tl.arange(0, BLOCK_N)
    in_tree = (nodes > 0) & (nodes < tl.minimum(num_nodes, N))
    parents = tl.load(parents_ptr + row * N + nodes, mask=in_tree, other=-1).to(tl.int32)
    tokens = tl.load(node_tokens_ptr + row * N + nodes, mask=in_tree, other=-1)
    target = tl.load(target_argmax_ptr + row * N + nodes, mask=nodes < N, other=-1)

    path = tl.full([BLOCK_N], -1, tl.int64)
    emitted = tl.full([BLOCK_N], -1, tl.int64)
    cur = tl.full((), 0, tl.int32)
    depth = tl.full((), 0, tl.int32)
    moved = tl.full((), 1, tl.int1)
    while moved:
        best = tl.sum(tl.where(nodes == cur, target, 0), axis=0)
        child = tl.min(tl.where((parents == cur) & (tokens == best), nodes, BLOCK_N), axis=0)
        moved = child < BLOCK_N
        emitted = tl.where(nodes == depth, best, emitted)
        path = tl.where(nodes == tl.where(moved, depth, -1), child.to(tl.int64), path)
        cur = tl.where(moved, child, cur)
        depth += moved.to(tl.int32)
    tl.store(path_nodes_ptr + row * N + nodes, path, mask=nodes < N)
    tl.store(emitted_ptr + row * N + nodes, emitted, mask=nodes < N)


def greedy_tree_verify_ref(target_argmax: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                           num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Follow ``target_argmax [B, N]`` down each row's tree: ``(path_nodes, emitted)``, both -1 padded."""
    batch, max_nodes = target_argmax.shape
    device = target_argmax.device
    rows = torch.arange(batch, device=device)
    nodes = torch.arange(max_nodes, device=device)
    in_tree = (nodes > 0) & (nodes < num_nodes.to(device)[:, None])
    parents = torch.where(in_tree, parents.to(device).long(), -1)
    tokens = node_tokens.to(device).long()
    target_argmax = target_argmax.long()

    path = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    emitted = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    for depth in range(max_nodes):
        if not walking.any():
            break
        best = target_argmax[rows, cur]
        matches = (parents == cur[:, None]) & (tokens == best[:, None])
        child = torch.where(matches, nodes, max_nodes).min(-1).values
        moved = walking & (child < max_nodes)
        emitted[:, depth] = torch.where(walking, best, -1)
        path[:, depth] = torch.where(moved, child, -1)
        cur = torch.where(moved, child, cur)
        walking = moved
    return path, emitted


def greedy_tree_verify_triton(target_argmax: torch.Tensor, node_tokens: torch.Tensor, parents: torch.Tensor,
                              num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, max_nodes = target_argmax.shape
    device = target_argmax.device
    path = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    emitted = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    if batch > 0:
        as_int64 = [t.to(device=device, dtype=torch.int64).contiguous() for t in (target_argmax, node_tokens, parents,
                                                                               num_nodes)]
        _greedy_tree_verify_kernel[(batch,)](*as_int64, path, emitted, max_nodes,
                                             BLOCK_N=triton.next_power_of_2(max_nodes), num_warps=1)
    return path, emitted


greedy_tree_verify = dispatch(greedy_tree_verify_triton, greedy_tree_verify_ref)
