"""A tree-masked forward against a causal one over as many tokens: what verifying a token tree costs beyond a chain.

    python benchmarks/bench_tree_forward.py                          # embedded SmolLM2, its 4-bit weights
    python benchmarks/bench_tree_forward.py --contexts 64 512 1000 --tokens 4 8 16 30

The target runs one forward over ``m`` new tokens after a context of ``c`` (the engine's runner: the CPU attention
backend on a CPU, the Triton kernel on CUDA), once causal and once as a tree in which most nodes are not a prefix of
the step's tokens (node ``i`` under node 0 when ``i % 3 == 0``, else under node ``i - 1``: branches of three nodes,
as in lookahead's and an n-gram trie's), alternating; the median of ``--repeats`` of each. The goodput policy prices
a tree at the causal cost of its size, so the ratio is what that leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanospec import LLM  # noqa: E402
from nanospec.model.forward_batch import build_forward_batch  # noqa: E402
from nanospec.speculative.proposal import tree_depths, tree_mask  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--quantization", default="auto", help="'auto' (default), 'int4', 'int8' or 'none'")
    parser.add_argument("--device", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 1000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16, 30])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(args.model, quantization=quantization, device=args.device, max_num_seqs=1,
              max_model_len=max(args.contexts) + max(args.tokens) + 1)
    engine, block_manager = llm.engine, llm.engine.block_manager
    device = llm.model.device
    table: list[int] = []
    block_manager.reserve(table, max(args.contexts) + max(args.tokens))

    def forward(context: int, m: int, tree: bool) -> float:
        positions, masks = [None], [None]
        if tree:
            parents = [-1] + [0 if i % 3 == 0 else i - 1 for i in range(1, m)]
            positions, masks = [[context + d for d in tree_depths(parents)]], [tree_mask(parents)]
        batch = build_forward_batch([[1] * m], [context], [table], block_manager.block_size, [range(m)], "cpu",
                                    positions=positions, tree_masks=masks)
        start = time.perf_counter()
        engine.runner.execute(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    print(f"{'context':>7} {'tokens':>6} {'causal ms':>10} {'tree ms':>8} {'tree / causal':>14}")
    for context in args.contexts:
        prefill = build_forward_batch([[1] * context], [0], [table], block_manager.block_size, [[context - 1]], "cpu")
        engine.runner.execute(prefill)
        for m in args.tokens:
            causal, tree = [], []
            for _ in range(args.repeats):
                causal.append(forward(context, m, False))
                tree.append(forward(context, m, True))
            c, t = statistics.median(causal) * 1e3, statistics.median(tree) * 1e3
            print(f"{context:>7} {m:>6} {c:>10.1f} {t:>8.1f} {t / c:>13.2f}x", flush=True)
    block_manager.free(table)


if __name__ == "__main__":
    main()
