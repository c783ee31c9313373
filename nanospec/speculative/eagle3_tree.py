"""EAGLE-2's dynamic draft tree (Li et al. 2024) grown by an EAGLE-3 head, for a batch of sequences at once, on the
device. A node's **score** is the sum of the draft's log-probabilities along its path. With width ``w``, depth ``k``
and budget ``N``: depth 1 is the root's ``w`` most probable tokens; each deeper step feeds the last depth's ``w``
expanded nodes (a node's token and its parent's prenorm output, at position ``last accepted + depth``, attending to
the context and its ancestors) and generates each one's ``w`` most probable children, the best ``w`` of which are
expanded next. Then every generated node is ranked by score (shallower first on ties) and the best ``N`` are kept:
a child's score never exceeds its parent's, so the list and each of its prefixes is a tree. Each feed carries every
expanded node so far again, at the same scratch slots past the last accepted row, with each row's ancestors in its
mask: ``w * d`` rows at depth ``d``, and nothing past the last accepted row is ever kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    width: int   # w: children per expanded node, and expanded nodes per depth
    depth: int   # k
    budget: int  # N: nodes kept (at most num_generated)

    @property
    def num_generated(self) -> int:
        return self.width + (self.depth - 1) * self.width ** 2

    @property
    def num_nodes(self) -> int:
        return min(self.budget, self.num_generated)

    @property
    def max_rows(self) -> int:
        """The most rows one feed carries (every expanded node but the last depth's children)."""
        return self.width * max(self.depth - 1, 1)


# feed(input_ids [A, n], hidden [A, n, H], row_depths [n], ancestors [A, n, n] bool) -> prenorm outputs [A, n, H]
Feed = Callable[[torch.Tensor, torch.Tensor, list[int], torch.Tensor], torch.Tensor]


def grow_tree(head, root_state: torch.Tensor, shape: TreeShape, feed: Feed
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranked tree of each of ``A`` sequences from the head's prenorm output at its last accepted row
    (``root_state [A, H]``): ``(target token ids, parents (-1: the root), float32 scores)``, ``[A, num_nodes]`` each."""
    w, A, H = shape.width, root_state.shape[0], root_state.shape[-1]
    device = root_state.device
    scores, ids = head.logits(root_state).log_softmax(-1).topk(w, dim=-1)  # [A, w]
    tokens = head.to_target(ids)
    gen_tokens, gen_scores, gen_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
    num_generated = w
    frontier = torch.arange(w, device=device).expand(A, w)  # the expanded nodes' indices among the generated ones
    frontier_scores = scores
    rows_tokens, rows_hidden = tokens, root_state[:, None].expand(A, w, H)
    eye = torch.eye(w, dtype=torch.bool, device=device).expand(A, w, w)
    ancestors, row_depths = eye, [1] * w
    for d in range(1, shape.depth):
        out = feed(rows_tokens, rows_hidden, row_depths, ancestors)[:, -w:]  # the depth-d expanded nodes' outputs
        child_logp, child_ids = head.logits(out).log_softmax(-1).topk(w, dim=-1)  # [A, w, w]
        child_scores = (frontier_scores[..., None] + child_logp).flatten(1)      # [A, w * w]
        child_tokens = head.to_target(child_ids).flatten(1)
        gen_tokens.append(child_tokens)
        gen_scores.append(child_scores)
        gen_parents.append(frontier.repeat_interleave(w, dim=1))
        if d == shape.depth - 1:
            break
        frontier_scores, pick = child_scores.topk(w, dim=-1)  # the next depth's expanded nodes
        parent = torch.div(pick, w, rounding_mode="floor")    # which of this depth's expanded nodes each extends
        frontier = num_generated + pick
        num_generated += w * w
        n = ancestors.shape[1]
        parent_rows = (d - 1) * w + parent  # the parents' rows in the feed
        seen = torch.cat([ancestors.gather(1, parent_rows[..., None].expand(A, w, n)), eye], dim=2)  # [A, w, n + w]
        ancestors = torch.cat([torch.nn.functional.pad(ancestors, (0, w)), seen], dim=1)
        rows_tokens = torch.cat([rows_tokens, child_tokens.gather(1, pick)], dim=1)
        rows_hidden = torch.cat([rows_hidden, out.gather(1, parent[..., None].expand(A, w, H))], dim=1)
        row_depths += [d + 1] * w
    tokens, scores, parents = torch.cat(gen_tokens, 1), torch.cat(gen_scores, 1), torch.cat(gen_parents, 1)
    order = torch.sort(-scores, dim=1, stable=True).indices  # generated depth-major: shallower first on ties
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=device).expand_as(order))
    order = order[:, :shape.num_nodes]
    kept_parents = parents.gather(1, order)
    ranked_parents = torch.where(kept_parents >= 0, rank.gather(1, kept_parents.clamp(min=0)), -1)
    return tokens.gather(1, order), ranked_parents, scores.gather(1, order)
