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


def timing_context(block_manager: BlockManager, tokens: int, max_len: int, context: int = 64) -> int:
    """The cached tokens a timed sequence of ``tokens`` new ones follows: ``context``, or 0 where the pool or
    ``max_len`` has no room for them."""
    fits = block_manager.blocks_for(context + tokens) <= block_manager.num_free_blocks and context + tokens <= max_len
    return context if fits else 0


def forward_shapes(token_counts: list[int], per_seq: int, max_seqs: int) -> list[tuple[int, int]]:
    """(sequences, tokens each) of the forward timed for each count ``m``: one sequence of ``m`` tokens up to
    ``per_seq``, else ``ceil(m / per_seq)`` sequences of ``per_seq`` (at most ``max_seqs``, at least 1)."""
    return [(1, m) if m <= per_seq else (max(1, min(-(-m // per_seq), max_seqs)), per_seq) for m in token_counts]


def time_forwards(execute: Callable[[ForwardBatch], torch.Tensor], block_manager: BlockManager,
                  shapes: list[tuple[int, int]], *, device: torch.device, batch_device: torch.device | str,
                  context: int) -> list[float]:
    """Seconds of a verify-shaped forward of each of ``shapes`` (sequences, new tokens each) after ``context`` cached
    tokens each: best of two passes up to 16 tokens; a larger shape is run once untimed first (graph capture, kernel
    compiles). Only the first sequence's context is written: attention costs the same whatever the K/V holds."""
    bm = block_manager
    if not shapes:
        return []
    tables: list[list[int]] = [[] for _ in range(max(n for n, _ in shapes))]
    for table in tables:
        bm.reserve(table, context + max(t for _, t in shapes))

    def run(num_seqs: int, tokens: int) -> torch.Tensor:
        batch = build_forward_batch([[0] * tokens] * num_seqs, [context] * num_seqs, tables[:num_seqs], bm.block_size,
                                    [range(tokens)] * num_seqs, batch_device)
        return execute(batch)

    if context:
        execute(build_forward_batch([[0] * context], [0], tables[:1], bm.block_size, [[context - 1]], batch_device))
    costs: dict[tuple[int, int], float] = {}
    small = [shape for shape in reversed(shapes) if shape[0] * shape[1] <= 16]
    for num_seqs, tokens in list(shapes) + small:
        if num_seqs * tokens > 16 and (num_seqs, tokens) not in costs:
            run(num_seqs, tokens)  # untimed: the first forward of a shape (graph capture, kernel compiles)
        seconds = best_seconds(lambda: run(num_seqs, tokens), device, repeats=2 if num_seqs * tokens <= 16 else 1)
        costs[num_seqs, tokens] = min(costs.get((num_seqs, tokens), seconds), seconds)
    for table in tables:
        bm.free(table)
    return [costs[shape] for shape in shapes]


def run_one_forward(execute: Callable[[ForwardBatch], torch.Tensor], block_manager: BlockManager,
                    batch_device: torch.device | str) -> None:
    """One forward over a single token with no context (a probe of how the machine runs, not a timing)."""
    table: list[int] = []
    block_manager.reserve(table, 1)
    try:
        execute(build_forward_batch([[0]], [0], [table], block_manager.block_size, [[0]], batch_device))
    finally:
        block_manager.free(table)
