"""What the driver tells the tensor-parallel workers: a command is two broadcasts from rank 0 over the control group,

    header = [op, model, max_query_len, num_tensors,  (dtype code, ndim, dim 0, dim 1) per tensor ...]
    payload = cat(tensor.flatten().to(int64) for each tensor that is present)

``op`` an :class:`Op`, ``model`` :data:`TARGET` or :data:`DRAFT`; a ``ForwardBatch`` travels as its integer
tensors (an absent ``tree_mask``: dtype code 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from nanospec.model.forward_batch import TENSOR_FIELDS, ForwardBatch

TARGET, DRAFT = 0, 1
HEADER = 4 + 4 * 8  # room for 8 tensors
_DTYPES = {1: torch.int64, 2: torch.int32}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class Op(IntEnum):
    EXECUTE = 1    # run a forward (and the logits) over the batch
    COPY_KV = 2    # copy K/V slots: tensors (src_slots, dst_slots), every layer
    SHUTDOWN = 3   # leave the worker loop
    GATHER_EMBEDDING = 4  # all-gather the embedding's rows (the driver keeps the whole table)


@dataclass
class Command:
    op: Op
    model: int
    tensors: list[torch.Tensor | None]
    max_query_len: int = 0

    def batch(self) -> ForwardBatch:
        return ForwardBatch(**dict(zip(TENSOR_FIELDS, self.tensors)), max_query_len=self.max_query_len)


class CommandChannel:
    """Rank 0 ``send``s, every other rank ``receive``s, in the same order, over ``group`` (gloo)."""

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank

    def send(self, op: Op, model: int = TARGET, tensors: list[torch.Tensor | None] = (), max_query_len: int = 0):
        assert self.rank == 0, "only the driver (rank 0) sends commands"
        if len(tensors) > (HEADER - 4) // 4:
            raise ValueError(f"a command carries at most {(HEADER - 4) // 4} tensors, got {len(tensors)}")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([int(op), model, max_query_len, len(tensors)])
        present = []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if t.dim() > 2 or t.dtype not in _CODES:
                raise ValueError(f"a command tensor must be int64 / int32 with at most 2 dims, got {t.dtype} {t.shape}")
            shape = list(t.shape) + [0] * (2 - t.dim())
            header[4 + 4 * i: 8 + 4 * i] = torch.tensor([_CODES[t.dtype], t.dim(), *shape])
            present.append(t.detach().reshape(-1).to("cpu", torch.int64))
        dist.broadcast(header, 0, group=self.group)
        if present:
            dist.broadcast(torch.cat(present), 0, group=self.group)

    def send_batch(self, op: Op, model: int, batch: ForwardBatch) -> None:
        self.send(op, model, [getattr(batch, name) for name in TENSOR_FIELDS], batch.max_query_len)

    def receive(self) -> Command:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, model, max_query_len, count = header[:4].tolist()
        specs = [header[4 + 4 * i: 8 + 4 * i].tolist() for i in range(count)]
        sizes = [math.prod([d0, d1][:ndim]) if code else 0 for code, ndim, d0, d1 in specs]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        if any(code for code, *_ in specs):
            dist.broadcast(payload, 0, group=self.group)
        tensors, offset = [], 0
        for (code, ndim, d0, d1), n in zip(specs, sizes):
            tensors.append(payload[offset: offset + n].view([d0, d1][:ndim]).to(_DTYPES[code]) if code else None)
            offset += n
        return Command(Op(op), model, tensors, max_query_len)
