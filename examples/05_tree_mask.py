"""A token tree, its attention mask and its positions, then one verification by hand.

    python examples/05_tree_mask.py

Candidates form a tree given by parent indices (node 0 is the root: the last committed token).
Every node sees its ancestors and itself (plus the whole cached context), and sits at position
``context_len + depth``. One target forward scores all nodes; greedy verification walks from the
root following the target's argmax; the accepted path's K/V is then moved next to the root.
"""

import argparse

import torch

from nanospec.kernels.attention_mask import unpack_mask
from nanospec.speculative.proposal import tree_depths, tree_mask
from nanospec.kernels.tree_verify import greedy_tree_verify

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

#          0        1       2       3        4       5        6
words = ["<root>", "the", "a", "cat", "dog", "sat", "ran"]
parents = [-1, 0, 0, 1, 1, 3, 3]  # root -> {the, a}; the -> {cat, dog}; cat -> {sat, ran}
context_len = 10

mask = unpack_mask(tree_mask(parents), len(parents))
depths = tree_depths(parents)
print("node  token    parent  position   sees (new tokens of this step)")
for i, word in enumerate(words):
    row = "".join("x" if mask[i, j] else "." for j in range(len(words)))
    print(f"{i:>4}  {word:<8} {parents[i]:>6}  {context_len + depths[i]:>8}   {row}")
print("packed as int64 bit words (what the attention kernel reads):",
      tree_mask(parents).flatten().tolist())

# pretend the target's argmax after each node is this (in word ids): after <root> "the", after "the" "cat", ...
target_argmax = torch.tensor([[1, 3, 0, 5, 0, 2, 0]])  # after "cat" the target wants "sat", after "sat" it wants "a"
node_tokens = torch.tensor([list(range(len(words)))])  # token id = index into `words`
path, emitted = greedy_tree_verify(target_argmax, node_tokens, torch.tensor([parents]), torch.tensor([len(words)]))
accepted = [words[n] for n in path[0].tolist() if n >= 0]
print("accepted path:", accepted, "| emitted:", [words[t] for t in emitted[0].tolist() if t >= 0])
print("the accepted nodes sit at storage", [context_len + n for n in path[0].tolist() if n >= 0],
      "and are compacted to", [context_len + 1 + d for d in range(len(accepted))])
