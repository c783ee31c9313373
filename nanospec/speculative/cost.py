"""What a forward costs on this machine, measured once at start-up: the goodput policy's ``T(m)`` (the
target over ``m`` new tokens) and ``D`` (one draft forward). Logits are included, as in a real step."""

from __future__ import annotations

import time
from typing import Callable

import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import build_forward_batch
from nanospec.model.llama import Llama


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (synchronising CUDA around each)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def time_forwards(model: Llama, kv_cache: KVCache, block_manager: BlockManager, token_counts: list[int],
                  context: int = 64, max_len: int | None = None) -> list[float]:
    """Seconds of one forward over each of ``token_counts`` new tokens after ``context`` cached ones (best of
    3; of 1 above 16 tokens). Where the pool or ``max_len`` cannot hold the largest counts they are timed at
    what fits, and without context if even that does not fit."""
    bm = block_manager
    max_len = max_len or model.config.max_position_embeddings
    longest = min(max(token_counts), bm.num_free_blocks * bm.block_size, max_len)
    if bm.blocks_for(context + longest) > bm.num_free_blocks or context + longest > max_len:
        context = 0
    table: list[int] = []
    bm.reserve(table, context + longest)

    def run(tokens: int, start: int) -> torch.Tensor:
        batch = build_forward_batch([[0] * tokens], [start], [table], bm.block_size, [[tokens - 1]], model.device)
        return model.compute_logits(model.forward(batch, kv_cache))

    if context:
        run(context, 0)
    costs = [best_seconds(lambda: run(min(m, longest), context), model.device, repeats=3 if m <= 16 else 1)
             for m in token_counts]
    bm.free(table)
    return costs
