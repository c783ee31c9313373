"""Micro-benchmark of token-tree verification: the Triton kernels against the PyTorch reference.

    PYTHONPATH=. python benchmarks/kernels/bench_tree_rejection.py

tree_rejection_sample (candidates drawn from a draft distribution) and
greedy_tree_verify at the SmolLM2-135M (V = 49152) and Llama-3.2-1B (V = 128256) vocabularies, batch 1
to 64, on two trees: a chain of 5 candidates, and a tree of 17 nodes (4 candidates after the root, 3
after each of them). The target and draft rows are softmaxes of random logits shifted towards each
other, so a realistic share of candidates is accepted. Prints microseconds per call
(triton.testing.do_bench, median), the speedup, the mean number of tokens emitted per row, and how many
rows differ between the kernel and the reference (they are meant to agree token for token).
Needs a CUDA GPU: without one it exits with status 2.
"""

from __future__ import annotations

import sys

import torch

from common import require_cuda, warm_up_gpu

VOCABS = {"SmolLM2-135M": 49152, "Llama-3.2-1B": 128256}
BATCHES = [1, 8, 64]
TREES = {
    "chain 5": [-1, 0, 1, 2, 3, 4],
    "tree 4x3": [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4],
}


def problem(batch: int, parents: list[int], vocab_size: int, device: str = "cuda"):
    """Target rows per node, candidates drawn i.i.d. from their parent's draft row, that row as draft_probs."""
    gen = torch.Generator(device=device).manual_seed(0)
    num_nodes = len(parents)
    shape = (batch, num_nodes, vocab_size)
    shared = torch.randn(shape, device=device, generator=gen) * 4
    target_probs = torch.softmax(shared + 0.3 * torch.randn(shape, device=device, generator=gen), dim=-1)
    draft_after = torch.softmax(shared + 0.3 * torch.randn(shape, device=device, generator=gen), dim=-1)
    parents = torch.tensor(parents, device=device).expand(batch, num_nodes).contiguous()
    draft_probs = draft_after[torch.arange(batch, device=device)[:, None], parents.clamp(min=0)]
    node_tokens = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=gen).reshape(batch, num_nodes)
    num_nodes = torch.full((batch,), num_nodes, device=device)
    return target_probs, node_tokens, parents, num_nodes, draft_probs


def main():
    require_cuda("bench_tree_rejection")
    warm_up_gpu()

    from triton.testing import do_bench

    from nanospec.kernels.tree_rejection import tree_rejection_sample_ref, tree_rejection_sample_triton
    from nanospec.kernels.tree_verify import greedy_tree_verify_ref, greedy_tree_verify_triton

    print(torch.cuda.get_device_name())
    header = ("model", "tree", "op", "batch", "triton us", "torch us", "speedup", "tokens/row", "rows differ")
    print("{:<14} {:<9} {:<18} {:>6} {:>10} {:>10} {:>8} {:>11} {:>12}".format(*header))
    for model, vocab_size in VOCABS.items():
        for tree, tree_parents in TREES.items():
            for batch in BATCHES:
                target_probs, node_tokens, parents, num_nodes, draft_probs = problem(batch, tree_parents, vocab_size)
                seeds = torch.arange(batch, device="cuda") + 1000
                offsets = torch.full((batch,), 37, device="cuda")
                sampling = dict(seeds=seeds, offsets=offsets)
                tree_args = (target_probs, node_tokens, parents, num_nodes)
                cases = {
                    "rejection (q)": (tree_rejection_sample_triton, tree_rejection_sample_ref,
                                      (*tree_args, draft_probs), sampling),
                    "greedy": (greedy_tree_verify_triton, greedy_tree_verify_ref,
                               (target_probs.argmax(-1), node_tokens, parents, num_nodes), {}),
                }
                for op, (triton_fn, ref_fn, args, kwargs) in cases.items():
                    (_, got), (_, expected) = triton_fn(*args, **kwargs), ref_fn(*args, **kwargs)
                    rows_differ = (got != expected).any(-1).sum().item()
                    tokens_per_row = (got >= 0).sum().item() / batch
                    triton_ms = do_bench(lambda: triton_fn(*args, **kwargs))
                    ref_ms = do_bench(lambda: ref_fn(*args, **kwargs))
                    print(f"{model:<14} {tree:<9} {op:<18} {batch:>6} {triton_ms * 1e3:>10.1f} {ref_ms * 1e3:>10.1f} "
                          f"{ref_ms / triton_ms:>7.2f}x {tokens_per_row:>11.2f} {rows_differ:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
