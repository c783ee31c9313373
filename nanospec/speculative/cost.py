"""What a forward costs on this machine, measured once at start-up: the goodput policy's ``T(m)`` (the
target over ``m`` new tokens) and ``D`` (one draft forward). Logits are included, as in a real step."""

from __future__ import annotations

import time
from typing import Callable

import torch

from nanospec.cache.block_manager import BlockManager
from nanospec.model.forward_batch import ForwardBatch, build_forward_batch


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


def time_forwards(execute: Callable[[ForwardBatch], torch.Tensor], block_manager: BlockManager,
                  token_counts: list[int], *, per_seq: int, device: torch.device, batch_device: torch.device | str,
                  max_len: int, context: int = 64) -> list[float]:
    """Seconds of a verify-shaped forward over each of ``token_counts`` new tokens after ``context`` cached ones (larger
    counts as sequences of ``per_seq``), best of two passes where the count is small, so one stall does not price a
    point as free. Only the first sequence's context is written: attention over the others' costs the same whatever
    their K/V holds (zeros, or a finished sequence's), and writing them took a prefill of ``context`` tokens each."""
    bm = block_manager
    per_seq = max(1, min(per_seq, max_len - 1))
    if bm.blocks_for(context + per_seq) > bm.num_free_blocks or context + per_seq > max_len:
        context = 0
    most = min(max(-(-m // per_seq) for m in token_counts), bm.num_free_blocks // bm.blocks_for(context + per_seq))
    tables: list[list[int]] = [[] for _ in range(max(most, 1))]
    for table in tables:
        bm.reserve(table, context + per_seq)

    def run(num_seqs: int, tokens: int, start: int) -> torch.Tensor:
        batch = build_forward_batch([[0] * tokens] * num_seqs, [start] * num_seqs, tables[:num_seqs], bm.block_size,
                                    [range(tokens)] * num_seqs, batch_device)
        return execute(batch)

    if context:  # (the first sequence's context is written, which also warms the forward up)
        execute(build_forward_batch([[0] * context], [0], tables[:1], bm.block_size, [[context - 1]], batch_device))
    costs: dict[int, float] = {}
    for m in list(token_counts) + [m for m in reversed(token_counts) if m <= 16]:
        num_seqs, tokens = (1, min(m, per_seq)) if m <= per_seq else (min(-(-m // per_seq), len(tables)), per_seq)
        seconds = best_seconds(lambda: run(num_seqs, tokens, context), device, repeats=2 if m <= 16 else 1)
        costs[m] = min(costs.get(m, seconds), seconds)
    for table in tables:
        bm.free(table)
    return [costs[m] for m in token_counts]


def run_one_forward(execute: Callable[[ForwardBatch], torch.Tensor], block_manager: BlockManager,
                    batch_device: torch.device | str) -> None:
    """One forward over a single token with no context (a probe of how the machine runs, not a timing)."""
    table: list[int] = []
    block_manager.reserve(table, 1)
    try:
        execute(build_forward_batch([[0]], [0], [table], block_manager.block_size, [[0]], batch_device))
    finally:
        block_manager.free(table)
