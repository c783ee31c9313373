"""Tensor parallelism (Megatron-LM's layout, as vLLM's): rank ``r`` of ``T`` holds

    q heads        [r H/T, (r+1) H/T)                                         H = num_attention_heads
    k, v heads     [r KV/T, (r+1) KV/T), or the one head r KV // T when T > KV (replicated)
    gate, up rows  [r F/T, (r+1) F/T)                                         F = intermediate_size
    vocab rows     [r V', (r+1) V') of the embedding and the head             V' = ceil(V / T)

qkv and gate_up are column-parallel; o and down row-parallel, each followed by an all-reduce. The embedding is
vocab-parallel (one exact all-reduce: one non-zero term per token); the head's slices are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanospec.model.quantization import Weight, pad_rows, select_rows


@dataclass
class ParallelGroup:
    """One tensor-parallel group as seen from one of its ranks: ``rank`` of ``size`` in ``group``. A model given a
    group that does not ``communicate`` (size 1) runs without it; ``force_collectives`` runs the collectives anyway
    (to test a backend, e.g. NCCL, at world size 1)."""

    group: object  # a torch.distributed ProcessGroup
    rank: int
    size: int
    force_collectives: bool = False

    @property
    def communicates(self) -> bool:
        return self.size > 1 or self.force_collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks of ``x`` (in place). Two ranks get bit-identical sums (a + b == b + a)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` ``[R, n]`` side by side along the last axis, in rank order: ``[R, size * n]``."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_shardable(config, size: int, what: str = "tensor_parallel_size", group_size: int | None = None) -> None:
    """ValueError, naming the value, when ``config`` cannot be split over ``size`` ranks: q heads and MLP width divide
    evenly, KV heads divide or replicate evenly, and with int4 weights each rank's o_proj and down_proj inputs are whole
    groups."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{what} must be a positive integer, got {size!r}")
    heads, kv_heads, ffn = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % size:
        raise ValueError(f"{what}={size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{what}={size} neither divides the model's {kv_heads} KV heads nor is a multiple of them")
    if ffn % size:
        raise ValueError(f"{what}={size} does not divide the model's intermediate_size {ffn}")
    if group_size is not None:
        for name, width in (("attention output", heads * config.head_dim), ("intermediate_size", ffn)):
            if width // size % group_size:
                raise ValueError(f"{what}={size} splits the model's {name} ({width}) into {width // size} inputs a "
                                 f"rank, not whole int4 groups of {group_size}: use int8 or float weights")


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The KV heads each of ``size`` ranks holds: its share, or one replicated head when ``size`` > ``num_kv_heads``."""
    return max(num_kv_heads // size, 1)


def head_range(num_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The heads ``[start, end)`` of rank ``rank`` (see the module; ``size`` divides ``num_heads`` or is a multiple)."""
    start = rank * num_heads // size
    return start, start + kv_heads_per_rank(num_heads, size)


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """The vocabulary rows ``[start, end)`` of rank ``rank``: ``ceil(V / size)`` each, the last shorter."""
    per_rank = -(-vocab_size // size)
    return min(rank * per_rank, vocab_size), min((rank + 1) * per_rank, vocab_size)


def rows(weight: Weight, start: int, end: int) -> Weight:
    """Rows ``[start, end)`` of a float or quantized ``(out, in)`` weight."""
    return weight[start:end].contiguous() if isinstance(weight, torch.Tensor) else weight.rows(start, end)


def columns(weight: Weight, start: int, end: int) -> Weight:
    """Columns ``[start, end)``; an int4 weight splits only on its group boundaries (a ValueError names them)."""
    return weight[:, start:end].contiguous() if isinstance(weight, torch.Tensor) else weight.columns(start, end)


class VocabParallelEmbedding:
    """Rank ``r`` holds rows ``vocab_range(V, r, T)``; ``h[t] = sum_r E_r[x_t - start_r]`` over the rank that holds
    ``x_t``: one all-reduce."""

    def __init__(self, weight: Weight, vocab_size: int, tp: ParallelGroup | None, dtype: torch.dtype):
        """``weight``: float rows, or quantized rows dequantized to ``dtype`` as they are looked up."""
        self.tp = tp if tp is not None and tp.communicates else None
        self.weight = weight
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.start, self.end = (0, vocab_size) if self.tp is None else vocab_range(vocab_size, tp.rank, tp.size)
        assert weight.shape[0] == self.end - self.start

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, 0)
        hidden = self._lookup(local) if self.weight.shape[0] else \
            torch.zeros(ids.shape[0], self.weight.shape[1], dtype=self.dtype, device=ids.device)
        hidden = hidden * mine.unsqueeze(-1).to(hidden.dtype)
        return self.tp.all_reduce(hidden)

    def whole(self) -> VocabParallelEmbedding:
        """The whole table as an embedding of no group: every rank's rows in ``dtype``, all-gathered (a collective:
        every rank of the group calls it)."""
        table = self._lookup(torch.arange(self.weight.shape[0], device=self.weight.device))
        if self.tp is not None:
            padded = pad_rows(table, -(-self.vocab_size // self.tp.size))
            table = self.tp.all_gather_last(padded.T).T[: self.vocab_size].contiguous()
        return VocabParallelEmbedding(table, self.vocab_size, None, self.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return torch.nn.functional.embedding(ids, self.weight)
        return select_rows(self.weight, ids).dequantize(self.dtype)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot go on (a worker died, or a command failed part-way); every later call raises it
    again."""
