"""Runs a model on a step's batch: eagerly, or from static buffers through a captured CUDA graph.

A decode or verify batch (every row wants logits) is laid into static buffers padded to a bucket: ``S`` sequences
(1, 2, 4, ... up to ``max_num_seqs``) times ``q`` rows each. Sequence ``s`` owns rows ``s*q .. s*q+q-1``: its real
tokens, then padding rows that write no K/V (slot -1) and that no real row sees; its ``seq_len`` counts the padding,
so real row ``j`` still sits at ``context + j``. On CUDA each bucket's forward is captured as a graph the first time
it is needed (after a warm-up run that compiles the kernels); on a CPU (``enforce_eager=False``) the same static path
runs without graphs, so the padding is tested there. Prefills and mixed batches run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.cache.kv_cache import KVCache
from nanospec.kernels.attention_mask import num_words
from nanospec.kernels.kv_store import copy_kv_slots
from nanospec.model.forward_batch import TENSOR_FIELDS, ForwardBatch
from nanospec.model.llama import Llama


def buckets(limit: int) -> list[int]:
    """1, 2, 4, ... below ``limit``, then ``limit``."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i < limit] + [limit]


@dataclass
class _Graph:
    batch: ForwardBatch                  # views of the static buffers, at the bucket's size
    graph: torch.cuda.CUDAGraph | None   # None on a CPU: the static path runs eagerly
    logits: torch.Tensor | None          # the captured outputs: every row's logits
    hidden: torch.Tensor | None          # and final hidden states
    aux: torch.Tensor | None = None      # and the auxiliary layers' states (aux_layers)


class ModelRunner:
    def __init__(self, model: Llama, kv_cache: KVCache, *, max_num_seqs: int, max_query_len: int, max_model_len: int,
                 enforce_eager: bool):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.enforce_eager = enforce_eager
        self.use_graphs = not enforce_eager and self.device.type == "cuda"
        self.seq_buckets = buckets(max_num_seqs)
        self.query_buckets = buckets(max_query_len)
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.aux_layers: tuple[int, ...] = ()  # set before the first forward (graphs capture what it says)
        self.aux_hidden: torch.Tensor | None = None  # the last forward's, with aux_layers
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # pinned staging buffers for to_device, used in turn, each with the event of the copy that last read it
        empty = torch.empty(0, dtype=torch.int64)
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [(empty, None), (empty, None)]
        self._next_staging = 0
        if enforce_eager:
            return
        rows = max_num_seqs * max_query_len
        max_blocks = -(-(max_model_len + max_query_len) // kv_cache.block_size)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.static = ForwardBatch(  # the largest bucket; each bucket uses the front of each buffer
            input_ids=zeros(rows), positions=zeros(rows), slot_mapping=zeros(rows),
            block_tables=zeros(max_num_seqs, max_blocks, dtype=torch.int32),
            seq_lens=zeros(max_num_seqs, dtype=torch.int32), query_start_loc=zeros(max_num_seqs + 1, dtype=torch.int32),
            max_query_len=max_query_len, logits_indices=torch.arange(rows, device=self.device),
            tree_mask=zeros(rows, num_words(max_query_len)))

    def execute(self, batch: ForwardBatch, hidden_states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[R, vocab]`` float32 logits of ``batch.logits_indices`` (a host batch) and, when ``hidden_states``, the
        final hidden states they come from (``[R, hidden]``, after the final norm; else None)."""
        key = None if self.enforce_eager else self._bucket(batch)
        if key is None:
            hidden, self.aux_hidden = self._forward(self._to_device(batch))
            return self.model.compute_logits(hidden), hidden if hidden_states else None
        num_seqs, q, masked = key
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._prepare(num_seqs, q, masked)
        rows = self._fill(entry.batch, batch, q)
        if entry.graph is None:
            hidden, aux = self._forward(entry.batch)
            logits = self.model.compute_logits(hidden)
        else:
            entry.graph.replay()
            hidden, logits, aux = entry.hidden, entry.logits, entry.aux
        self.aux_hidden = aux[rows] if aux is not None else None
        return logits[rows], hidden[rows] if hidden_states else None

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's final hidden states, and the auxiliary layers' states when ``aux_layers`` asks."""
        out = self.model.forward(batch, self.kv_cache, self.aux_layers)
        return out if self.aux_layers else (out, None)

    def copy_kv_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """``cache[dst] = old cache[src]`` for K and V of every layer (slot indices, on any device)."""
        src_slots, dst_slots = src_slots.to(self.device), dst_slots.to(self.device)
        for layer in range(self.model.config.num_hidden_layers):
            copy_kv_slots(*self.kv_cache.layer(layer), src_slots, dst_slots)

    def _bucket(self, batch: ForwardBatch) -> tuple[int, int, bool] | None:
        """The bucket of a decode / verify batch (every row wants logits), or None: run it eagerly."""
        num_seqs = batch.seq_lens.shape[0]
        if batch.logits_indices.shape[0] != batch.num_tokens or num_seqs > self.seq_buckets[-1] \
                or batch.max_query_len > self.query_buckets[-1]:
            return None
        return (next(b for b in self.seq_buckets if b >= num_seqs),
                next(b for b in self.query_buckets if b >= batch.max_query_len), batch.tree_mask is not None)

    def _fill(self, static: ForwardBatch, batch: ForwardBatch, q: int) -> torch.Tensor:
        """Lay the batch into the bucket's static buffers; returns, on the device, the static rows of the batch's
        tokens in the batch's order. A host batch (the engine's) is laid out on the host and copied once; a batch
        already on the device (a draft's, whose input ids are its previous guesses) is laid out there."""
        num_seqs, real = static.seq_lens.shape[0], batch.seq_lens.shape[0]
        on = batch.seq_lens.device
        counts = batch.query_start_loc.diff()
        seq = torch.repeat_interleave(torch.arange(real, device=on), counts,  # the sequence of every real row
                                      output_size=batch.num_tokens)
        rows = seq * q + torch.arange(batch.num_tokens, device=on) - batch.query_start_loc[:-1].long()[seq]
        last = torch.zeros(num_seqs, dtype=torch.int64, device=on)  # padding rows: their sequence's last position
        last[:real] = batch.positions[batch.query_start_loc[1:].long() - 1]
        tables = torch.zeros(static.block_tables.shape, dtype=torch.int32, device=on)
        width = min(batch.block_tables.shape[1], tables.shape[1])
        tables[:real, :width] = batch.block_tables[:, :width]
        seq_lens = torch.full((num_seqs,), q, dtype=torch.int32, device=on)
        seq_lens[:real] = batch.seq_lens - counts.to(torch.int32) + q
        padding = lambda value: torch.full((num_seqs * q,), value, dtype=torch.int64, device=on)  # noqa: E731
        values = {"input_ids": padding(0).index_copy_(0, rows, batch.input_ids),
                  "positions": last.repeat_interleave(q).index_copy_(0, rows, batch.positions),
                  "slot_mapping": padding(-1).index_copy_(0, rows, batch.slot_mapping),
                  "block_tables": tables, "seq_lens": seq_lens,
                  "query_start_loc": torch.arange(0, num_seqs * q + 1, q, dtype=torch.int32, device=on)}
        if static.tree_mask is not None:  # a padding row sees itself only
            own = torch.arange(num_seqs * q, device=on) % q
            mask = torch.zeros(static.tree_mask.shape, dtype=torch.int64, device=on)
            mask.scatter_(1, (own // 64)[:, None], (torch.ones_like(own) << (own % 64))[:, None])
            mask[rows, : batch.tree_mask.shape[1]] = batch.tree_mask
            values["tree_mask"] = mask
        *device_values, rows = self.to_device([*values.values(), rows])
        for name, value in zip(values, device_values):
            getattr(static, name).copy_(value)
        return rows

    def _to_device(self, batch: ForwardBatch) -> ForwardBatch:
        names = [n for n in TENSOR_FIELDS if getattr(batch, n) is not None]
        moved = dict(zip(names, self.to_device([getattr(batch, n) for n in names])))
        return ForwardBatch(**{n: moved.get(n) for n in TENSOR_FIELDS}, max_query_len=batch.max_query_len)

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host integer tensors on the device, through one pinned buffer and one asynchronous copy (as they are
        on a CPU); tensors already on the GPU stay (tested by ``is_cuda``: ``torch.device("cuda") != cuda:0``). The
        buffers are used in turn, each refilled only once the copy that last read it has run."""
        host = [i for i, t in enumerate(tensors) if not t.is_cuda]
        if self.device.type != "cuda" or not host:
            return tensors
        flat = [tensors[i].reshape(-1).to(torch.int64) for i in host]
        total = sum(t.numel() for t in flat)
        index = self._next_staging
        self._next_staging = (index + 1) % len(self._staging)
        buffer, copied = self._staging[index]
        if copied is not None:
            copied.synchronize()
        if buffer.numel() < total:
            buffer = torch.empty(max(total, 2 * buffer.numel()), dtype=torch.int64, pin_memory=True)
        torch.cat(flat, out=buffer[:total])
        packed = buffer[:total].to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._staging[index] = (buffer, copied)
        out, offset = list(tensors), 0
        for i in host:
            t = tensors[i]
            out[i] = packed[offset:offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()
        return out

    def _prepare(self, num_seqs: int, q: int, masked: bool) -> _Graph:
        s = self.static
        rows = num_seqs * q
        batch = ForwardBatch(input_ids=s.input_ids[:rows], positions=s.positions[:rows],
                             slot_mapping=s.slot_mapping[:rows], block_tables=s.block_tables[:num_seqs],
                             seq_lens=s.seq_lens[:num_seqs], query_start_loc=s.query_start_loc[: num_seqs + 1],
                             max_query_len=q, logits_indices=s.logits_indices[:rows],
                             tree_mask=s.tree_mask[:rows] if masked else None)
        if not self.use_graphs:
            return _Graph(batch, None, None, None)
        # warm-up (compiles the kernels) and capture on the buffers as they are: padding-only rows, slot -1
        batch.slot_mapping.fill_(-1)
        batch.seq_lens.fill_(q)
        batch.query_start_loc.copy_(torch.arange(0, rows + 1, q, dtype=torch.int32, device=self.device))
        self.model.compute_logits(self._forward(batch)[0])
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, aux = self._forward(batch)
            logits = self.model.compute_logits(hidden)
        return _Graph(batch, graph, logits, hidden, aux)
